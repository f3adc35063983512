"""What does a wait cost the waiting process while the worlds answer late?

A natively batched env of n worlds (``bench_envs.WorldsEnv``) in each of the 2 workers of an
idle ``MultiSyncCollector`` (fork), ``apply_at="reset"``: a push of a row per world with
``wait="applied"`` cannot be applied before the worlds' next reset, which an idle collector
never reaches (the reset-mode trap), so the wait blocks until its timeout (``--window``
seconds) and raises ``AckTimeout``. Measured: the wait's wall time and the main process's
CPU time meanwhile (``time.process_time``: every thread of the process), against the same
window slept (the baseline, in the same run: what a process that only waits costs).

A wait reads each link's counters as columns at every acknowledgement or slice (50 ms) and
asks liveness once per worker process: its CPU must not grow with the worlds (it walked every
world each slice before: a core busy at 4,096 worlds, past its timeout at 65,536).

    python benchmarks/bench_wait.py [--quick]
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from bench_common import RESULTS, Report, median, parse_args, save_plot, start_method, target
from tensordict import TensorDict

NAME = "wait"


@dataclass
class Args:
    worlds: list[int] = field(default_factory=lambda: [4096, 16384, 65536])  # over the 2 workers
    window: float = 2.0  # seconds a wait blocks (its timeout)
    repeats: int = 3
    quick: bool = False
    out: Path = RESULTS


def quick(args: Args) -> Args:
    return replace(args, worlds=[256], window=0.3, repeats=1)


def _cpu_of(fn: Any) -> tuple[float, float]:
    """Wall and main-process CPU seconds of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def _measure(n: int, args: Args) -> dict[str, Any]:
    import bench_envs
    from torchrl.collectors import MultiSyncCollector

    from envsync import AckTimeout, EnvStateSender

    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="reset")
    factories = [sender.env_fn(partial(bench_envs.make_worlds_env, n // 2))] * 2
    with start_method("fork"):
        collector = MultiSyncCollector(
            factories, None, frames_per_batch=n, total_frames=-1, weight_sync_schemes=sender.schemes()
        )
    waits, sleeps, late = [], [], []
    try:
        next(iter(collector))
        for _ in range(args.repeats):
            rows = TensorDict(difficulty=torch.rand(n, dtype=torch.float64), batch_size=[n])

            def wait(r: TensorDict = rows) -> None:
                try:
                    sender.push(config=r, wait="applied", timeout=args.window)
                except AckTimeout as err:
                    late.append(len(err.envs))

            waits.append(_cpu_of(wait))
            sleeps.append(_cpu_of(partial(time.sleep, args.window)))
    finally:
        collector.shutdown()
        sender.close()
    wall, cpu = median([w for w, _ in waits]), median([c for _, c in waits])
    return {
        "worlds": n,
        "wait_wall_s": wall,
        "wait_cpu_s": cpu,
        "cpu_share": cpu / wall,
        "sleep_cpu_s": median([c for _, c in sleeps]),
        "over_timeout": wall / args.window,
        "late_envs": median(late) if late else 0,
        "samples": len(waits),
    }


def _plot(rows: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar([f"{r['worlds']:,}" for r in rows], [100 * r["cpu_share"] for r in rows])
    ax.set_xlabel("worlds (2 workers)")
    ax.set_ylabel("% of a core while waiting")
    ax.set_title("A blocked wait: the waiting process's CPU")
    return save_plot(fig, out, NAME)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv, Args, __doc__, quick)
    rows = [_measure(n, args) for n in args.worlds]
    plot = _plot(rows, args.out)
    worst = max(r["cpu_share"] for r in rows)
    columns = [
        ("worlds", "worlds"),
        ("wait_wall_s", "wait s (wall)"),
        ("over_timeout", "x timeout"),
        ("wait_cpu_s", "main-process CPU s"),
        ("cpu_share", "CPU / wall"),
        ("sleep_cpu_s", "CPU s, the same window slept"),
        ("late_envs", "late envs"),
    ]
    report = Report(
        name=NAME,
        args=args,
        rows=rows,
        tables=[(f"A wait for 'applied' that the worlds answer late ({args.window:g} s timeout)", columns)],
        summary={"plots": [plot.name], "worst_cpu_share": worst},
        targets=[target("main-process CPU / wall while a wait blocks, worst n", worst, 0.05, higher_is_better=False)],
        notes=[
            "MultiSyncCollector of 2 forked workers, each a natively batched env of n/2 worlds, idle after one "
            "batch; apply_at='reset': every world receives the push and holds it for its next reset",
            "the wait raises AckTimeout after its timeout, naming the late envs and the reset-mode trap",
        ],
    )
    return report.write(args.out)


if __name__ == "__main__":
    main()
