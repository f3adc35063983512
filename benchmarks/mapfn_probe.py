"""Probe: what ``collector.map_fn`` does to a ``MultiAsyncCollector`` that is being iterated.

Run by ``bench_switch_latency.py`` in a subprocess with a hard timeout, because the call can
leave the iterator blocked for ever. It iterates a few batches, calls ``map_fn`` from the loop
body (as a user would), then watches the batches of the next ``--window`` seconds. Each
worker's env counts every step it takes, so a gap between two batches of one worker is a
batch that was thrown away. Prints one line ``RESULT {json}`` and exits.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from bench_envs import make_tick_env


@dataclass
class ProbeArgs:
    workers: int = 2
    frames_per_batch: int = 100
    warm_batches: int = 4
    window: float = 5.0


@dataclass
class ProbeResult:
    workers: int
    frames_per_batch: int
    map_fn_s: float | None = None
    batches_after: int = 0
    dropped_batches: int = 0
    stalled_workers: list[int] = field(default_factory=list)
    iterator_blocked: bool = False
    error: str | None = None


def _iterate(collector: Any, args: ProbeArgs, log: list[tuple[int, int, int]], result: ProbeResult) -> None:
    """The user's loop: record (label, first tick, last tick) per batch; call map_fn once."""
    try:
        for i, batch in enumerate(collector):
            ticks = batch["next", "observation"][..., 2].reshape(-1)
            log.append((int(batch["observation"].reshape(-1, 3)[0, 1]), int(ticks[0]), int(ticks[-1])))
            if i + 1 == args.warm_batches:
                start = time.perf_counter()
                collector.map_fn("env.set_difficulty", list_of_kwargs=[{"difficulty": 1.0}] * args.workers)
                result.map_fn_s = time.perf_counter() - start
                log.append((-1, -1, -1))
    except Exception as err:  # the probe reports whatever happens, it never raises
        result.error = repr(err)


def _ticks_now(collector: Any, timeout: float) -> list[int] | None:
    """Every worker env's step count, asked through the pipes (``None`` if they do not answer)."""
    answer: list[Any] = []
    thread = threading.Thread(target=lambda: answer.append(collector.get_distant_attr("env.tick")), daemon=True)
    thread.start()
    thread.join(timeout)
    return [int(t) for t in answer[0]] if answer else None


def _analyse(log: list[tuple[int, int, int]], ticks: list[int] | None, args: ProbeArgs, result: ProbeResult) -> None:
    marker = log.index((-1, -1, -1)) if (-1, -1, -1) in log else len(log)
    after = log[marker + 1 :]
    result.batches_after = len(after)
    result.iterator_blocked = result.map_fn_s is not None and not after
    result.stalled_workers = sorted(set(range(args.workers)) - {label for label, _, _ in after})
    last: dict[int, int] = {}
    for label, first, end in (entry for entry in log if entry[0] >= 0):
        if label in last:
            result.dropped_batches += (first - last[label] - 1) // args.frames_per_batch
        last[label] = end
    if ticks is not None:  # a stalled worker's frames stepped but never delivered: rollouts thrown away
        stalled = result.stalled_workers
        result.dropped_batches += sum((ticks[w] - last.get(w, 0)) // args.frames_per_batch for w in stalled)


def run(args: ProbeArgs) -> ProbeResult:
    from torchrl.collectors import MultiAsyncCollector

    mp.set_start_method("fork", force=True)
    makers = [partial(make_tick_env, label=i) for i in range(args.workers)]
    collector = MultiAsyncCollector(makers, None, frames_per_batch=args.frames_per_batch, total_frames=-1)
    result = ProbeResult(workers=args.workers, frames_per_batch=args.frames_per_batch)
    log: list[tuple[int, int, int]] = []
    thread = threading.Thread(target=_iterate, args=(collector, args, log, result), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60.0
    while result.map_fn_s is None and result.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    thread.join(args.window)
    _analyse(list(log), _ticks_now(collector, timeout=5.0), args, result)
    print("RESULT " + json.dumps(asdict(result)), flush=True)
    for proc in collector.procs:  # the iterator may be stuck: stop our own workers by handle
        proc.terminate()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    defaults = ProbeArgs()
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    run(ProbeArgs(**vars(parser.parse_args())))
    os._exit(0)


if __name__ == "__main__":
    main()
