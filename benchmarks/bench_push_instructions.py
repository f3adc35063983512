"""What does a small push cost the main process, counted in instructions, against
gymnasium's ``AsyncVectorEnv.call`` of the same method?

``bench_switch_latency.py`` times both; on this shared 2-core machine one run moves by
±15%, more than the changes to the push path it has to resolve. The workers cost the same
on both sides (``push_cpu_probe.py``: ~20 µs of CPU per call each); the gap is the main
process. Here the main process runs under valgrind's callgrind, with instrumentation on
(``callgrind_control -i on``) only for the counted calls; the workers are spawned and run
natively (``--trace-children=no``), so they answer at full speed and the count is the main
process's own work, repeatable within ~0.1%.

envsync: ``push(config={"difficulty": x}, wait="applied")`` to an idle
``MultiAsyncCollector`` of ``DriftEnv`` workers, ``apply_at="step"``. gymnasium:
``AsyncVectorEnv.call("set_difficulty", x)`` on as many ``DriftEnv`` workers. Under valgrind
the main process runs ~50x slower than the workers, so it seldom finds an acknowledgement
missing and sleeps less often than in a timed run, on both sides alike.

``--quick`` runs the children without valgrind (their calls timed only): valgrind imports
torch in ~50 s.

    python benchmarks/bench_push_instructions.py [--quick] [--workers 4 16] [--pushes 500]   # ~8 min
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench_common import RESULTS, CountedChild, Report, paired_bars, parse_args, require_callgrind, save_plot

NAME = "push_instructions"
SYSTEMS = ("envsync", "gymnasium")
WARM_UP = 50


@dataclass
class Args:
    workers: list[int] = field(default_factory=lambda: [4, 16])
    pushes: int = 500  # counted calls per system and worker count
    systems: list[str] = field(default_factory=lambda: list(SYSTEMS))
    count: bool = True  # count instructions (quick leaves valgrind out)
    quick: bool = False
    out: Path = RESULTS


def quick(args: Args) -> Args:
    return replace(args, workers=[2], pushes=50, count=False)


def child(system: str, workers: int, pushes: int) -> None:
    """Start the workers, warm up, then make ``pushes`` calls between two prompts."""
    import multiprocessing as mp

    from envsync.envs import DriftEnv

    mp.set_start_method("spawn", force=True)  # the workers run outside valgrind
    if system == "envsync":
        from torchrl.collectors import MultiAsyncCollector

        from envsync import EnvStateSender
        from envsync.envs import make_drift_env

        sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
        collector = MultiAsyncCollector(
            [sender.env_fn(make_drift_env)] * workers,
            None,
            frames_per_batch=200,
            total_frames=-1,
            weight_sync_schemes=sender.schemes(),
        )

        def call(i: int) -> None:
            sender.push(config={"difficulty": 0.1 * (i % 10)}, wait="applied")

        def close() -> None:
            collector.shutdown()
            sender.close()

    else:
        import gymnasium as gym

        vec = gym.vector.AsyncVectorEnv([DriftEnv] * workers, context="spawn")
        vec.reset(seed=0)

        def call(i: int) -> None:
            vec.call("set_difficulty", 0.1 * (i % 10))

        close = vec.close
    try:
        for i in range(WARM_UP):
            call(i)
        print("ready", os.getpid(), flush=True)
        sys.stdin.readline()
        start = time.perf_counter()
        for i in range(pushes):
            call(i)
        print("done", time.perf_counter() - start, flush=True)
        sys.stdin.readline()
    finally:
        close()


def _count(system: str, workers: int, pushes: int, count: bool) -> dict[str, Any]:
    """Run one system's child (under callgrind when ``count``); its main process's calls."""
    child = CountedChild(
        __file__, [system, str(workers), str(pushes)], count=count, trace_children=False, what=f"{system} child"
    )
    try:
        (pid,), done, _ = child.counted(timeout=300)
        total = child.instructions(pid) if count else None
    finally:
        child.close()
    return {"instructions": total, "seconds": float(done[0])}


def _measure(workers: int, args: Args) -> dict[str, Any]:
    none = {"instructions": None, "seconds": float("nan")}
    counts = {s: _count(s, workers, args.pushes, args.count) if s in args.systems else none for s in SYSTEMS}
    per_call = {s: (c["instructions"] / args.pushes if c["instructions"] else None) for s, c in counts.items()}
    envsync, gym = per_call["envsync"], per_call["gymnasium"]
    return {
        "workers": workers,
        "pushes": args.pushes,
        "envsync_instructions_per_push": envsync,
        "gym_instructions_per_call": gym,
        "envsync_over_gym": envsync / gym if envsync and gym else None,
        # wall time of the counted calls (under valgrind: the main process's slowdown, not a latency)
        "envsync_us_per_push": counts["envsync"]["seconds"] / args.pushes * 1e6,
        "gym_us_per_call": counts["gymnasium"]["seconds"] / args.pushes * 1e6,
        "counted": args.count,
    }


COLUMNS = [
    ("workers", "workers"),
    ("pushes", "calls counted"),
    ("envsync_instructions_per_push", "main-process instructions per envsync push"),
    ("gym_instructions_per_call", "per gymnasium call"),
    ("envsync_over_gym", "envsync / gymnasium"),
    ("envsync_us_per_push", "µs per push (under valgrind: its slowdown)"),
    ("gym_us_per_call", "µs per call"),
]


def _plot(rows: list[dict[str, Any]], out: Path) -> Path:
    fig, _ = paired_bars(
        [f"{r['workers']} workers" for r in rows],
        ("envsync push", [r["envsync_instructions_per_push"] or 0 for r in rows]),
        ("gymnasium call", [r["gym_instructions_per_call"] or 0 for r in rows]),
        "main-process instructions per call",
        "A small push, counted by callgrind",
    )
    return save_plot(fig, out, NAME)


def run(args: Args) -> dict[str, Any]:
    if args.count:
        require_callgrind()
    rows = [_measure(workers, args) for workers in args.workers]
    report = Report(
        name=NAME,
        args=args,
        rows=rows,
        tables=[("Instructions the main process executes per call (callgrind)", COLUMNS)],
        summary={"plots": [_plot(rows, args.out).name]},
        targets=[],
        notes=[
            f"{args.pushes} calls counted per system after {WARM_UP} warm-up calls; workers spawned and run "
            "natively (--trace-children=no): the count is the main process's own work",
            "a diagnostic of where the small push's gap to gymnasium lies (the issue's target is the timed "
            "latency in bench_switch_latency.py); the workers cost about the same on both sides",
        ]
        + ([] if args.count else ["--quick: not counted (no valgrind), calls timed only"]),
    )
    return report.write(args.out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return run(parse_args(argv, Args, __doc__, quick))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
