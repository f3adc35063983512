"""Where an in-process push to worlds spends its time, stage by stage.

A ``Collector`` of ``WorldsEnv`` (``bench_envs.py``) of ``--worlds`` worlds, idle after a batch,
envsync attached with ``apply="set_difficulty", apply_at="step"``; ``--pushes`` pushes of
``--rows`` rows (a random set of worlds each, ``envs=`` a tensor; every world when ``--rows``
is the number of worlds) with ``wait="applied"``. A timer (``perf_counter_ns``, ~0.3 µs a
stage) is put around each stage of the push by wrapping envsync's own functions in this
process: preparing it (the targets checked, the rows fitted), publishing it (and, within it,
the link's table and the config history), the worker loop's turn run in the sender's thread
(and, within it, the group's apply, the receiver's, reading the rows, the env's write with
the applied table, the acknowledgement), and the wait. Prints the median and mean of the
whole push and each stage's mean per push (a stage nested in another is indented under it).

    python benchmarks/push_stages_probe.py [--worlds 4096] [--rows 410] [--pushes 500]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from bench_envs import make_worlds_env
from tensordict import TensorDict
from torchrl.collectors import Collector

from envsync import EnvStateSender
from envsync.integrations.torchrl import group, native
from envsync.links import rows_reader, slots
from envsync.sender import acks, core, updates
from envsync.worker import rows

STAGES: list[tuple[Any, str, str]] = [
    (updates.Updates, "push", "prepare"),
    (core.Core, "publish", "publish"),
    (slots.SlotWriter, "write_rows", "  the link's table"),
    (core.Core, "record_history", "  the config history"),
    (core.Core, "wake", "the loop's turn, in this thread"),
    (group.EnvGroup, "apply_if_idle", "  the group's apply"),
    (rows.RowsReceiver, "apply", "    the receiver's"),
    (rows_reader.RowsReader, "read", "      reading the rows"),
    (native.RowApplier, "apply", "      the env's write + the applied table"),
    (rows_reader.RowsReader, "ack_applied", "      the acknowledgement"),
    (acks, "wait", "the wait"),
]


def _timed(totals: dict[str, int], owner: Any, name: str, label: str) -> Callable[[], None]:
    """Time ``owner.name`` into ``totals[label]``; returns what puts the function back."""
    function = getattr(owner, name)

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return function(*args, **kwargs)
        finally:
            totals[label] = totals.get(label, 0) + time.perf_counter_ns() - start

    setattr(owner, name, timed)
    return lambda: setattr(owner, name, function)


def _pushes(n: int, k: int, pushes: int, totals: dict[str, int]) -> list[int]:
    """Nanoseconds of each of ``pushes`` pushes of ``k`` rows to an idle collector of ``n``
    worlds (after 50 not counted; ``totals`` cleared after them)."""
    generator = torch.Generator().manual_seed(0)
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = Collector(
        sender.env_fn(partial(make_worlds_env, n)),
        None,
        frames_per_batch=n,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
    )

    def push() -> int:
        values = torch.rand(k, generator=generator)
        if k == n:
            start = time.perf_counter_ns()
            sender.push(config=TensorDict(difficulty=values, batch_size=[n]), wait="applied")
        else:
            ids = torch.randperm(n, generator=generator)[:k].sort().values
            start = time.perf_counter_ns()
            sender.push(config={"difficulty": values}, envs=ids, wait="applied")
        return time.perf_counter_ns() - start

    try:
        next(iter(collector))
        for _ in range(50):
            push()
        totals.clear()
        times = [push() for _ in range(pushes)]
        assert torch.equal(collector.env.difficulty, sender.read_attributes(["difficulty"])["difficulty"])
        return times
    finally:
        collector.shutdown()
        sender.close()


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=410)
    parser.add_argument("--pushes", type=int, default=500)
    args = parser.parse_args(argv)
    n, k = args.worlds, min(args.rows, args.worlds)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    totals: dict[str, int] = {}
    restores = [_timed(totals, owner, name, label) for owner, name, label in STAGES]
    try:
        times = _pushes(n, k, args.pushes, totals)
    finally:  # this process as it was (a test imports this module)
        for restore in restores:
            restore()
        torch.set_num_threads(threads)
    out = {"median": statistics.median(times) / 1e3, "mean": statistics.mean(times) / 1e3}
    print(f"{k} of {n} worlds, push(wait='applied'): median {out['median']:.0f} µs, mean {out['mean']:.0f} µs")
    for _, _, label in STAGES:
        out[label.strip()] = totals.get(label, 0) / args.pushes / 1e3
        print(f"{label:42s} {out[label.strip()]:7.1f} µs")
    return out


if __name__ == "__main__":
    main()
