"""Envs, apply callables and a doomed main process for tests/test_faults.py.

Importable by spawn workers (like ``helpers``), and runnable as the main module of a child
process: ``python tests/fault_helpers.py OUT_JSON`` builds a sender and a ``MultiSyncCollector``
(fork), records its pids and shared-memory files in ``OUT_JSON``, then SIGKILLs itself while
pushing.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import threading
import time
from functools import partial
from typing import Any

from helpers import CounterEnv, make_counter_env, start_method
from tensordict import TensorDictBase

SLEEPY_CONFIG = {"difficulty": 0.0, "sleep": 0.0, "sleeper": -1.0}
"""Config template of :func:`sleepy_apply`: ``sleeper`` is the label that sleeps (-1: every env)."""


def shm_naming() -> tuple[str, str]:
    """(SHM_DIR, PREFIX) of envsync's shared-memory files, wherever the module lives now."""
    for name in ("envsync.links.shared_memory", "envsync.transports.shared_memory"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        return module.SHM_DIR, module.PREFIX
    raise ImportError("no envsync.links.shared_memory nor envsync.transports.shared_memory")


def envsync_files(pid: int) -> list[str]:
    """The envsync shared-memory files owned by ``pid``."""
    directory, prefix = shm_naming()
    return sorted(n for n in os.listdir(directory) if n.startswith(f"{prefix}{pid}-"))


class SlowCounterEnv(CounterEnv):
    """A :class:`CounterEnv` whose episodes never end and whose steps take ``delay`` seconds."""

    def __init__(self, label: int = 0, delay: float = 0.005) -> None:
        super().__init__(label=label, max_steps=10**9)
        self.delay = delay

    def _step(self, tensordict: TensorDictBase) -> Any:
        time.sleep(self.delay)
        return super()._step(tensordict)


def make_slow_counter_env(label: int = 0, delay: float = 0.005) -> SlowCounterEnv:
    return SlowCounterEnv(label=label, delay=delay)


def make_endless_counter_env(label: int = 0) -> CounterEnv:
    """A :class:`CounterEnv` whose episode never ends: its step counter runs on across batches."""
    return CounterEnv(label=label, max_steps=10**9)


def sleepy_apply(env: Any, config: TensorDictBase) -> None:
    """Set the difficulty, then sleep ``config["sleep"]`` seconds if this env's label is
    ``config["sleeper"]`` (or ``sleeper`` is -1)."""
    base = env.base_env if hasattr(env, "base_env") else env
    base.set_difficulty(float(config["difficulty"]))
    sleeper = float(config["sleeper"])
    if sleeper < 0 or sleeper == base.label:
        time.sleep(float(config["sleep"]))


def push_until_killed(out_path: str, kill_after: float = 0.3) -> None:
    """Attach a sender to a fork ``MultiSyncCollector``, write the pids and envsync files to
    ``out_path``, then push in a loop until a timer thread SIGKILLs this process."""
    from conftest import build

    from envsync import EnvStateSender

    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method("fork"):
        collector = build("sync", sender, [partial(make_counter_env, label=i) for i in range(2)], frames_per_batch=20)
    next(iter(collector))
    record = {"pid": os.getpid(), "workers": [p.pid for p in collector.procs], "files": envsync_files(os.getpid())}
    with open(out_path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(out_path + ".tmp", out_path)
    threading.Timer(kill_after, os.kill, (os.getpid(), signal.SIGKILL)).start()
    step = 0
    while True:
        step += 1
        sender.push(config={"difficulty": float(step)}, wait="applied")


if __name__ == "__main__":
    push_until_killed(sys.argv[1])
