"""What does envsync cost a collector when nothing is pending, counted in instructions?

``bench_hot_path.py`` times frames per CPU second; on a shared 2-core machine one window
moves by several percent, more than the 1% it has to resolve. Here each variant runs under
valgrind's callgrind, with instrumentation switched on (``callgrind_control -i on``) only
for the timed batches, in the collector's own process and in its workers: the count of
instructions executed is the same from run to run within ~0.1%, whatever else the machine
does. The ratio of instructions per frame, with envsync ÷ without, is the CPU cost of the
hot path on this code (valgrind weighs every instruction alike; caches and the scheduler
play no part).

The env is the cheap one (``DriftEnv`` through ``GymEnv``, where envsync's share is
largest); a busy-waiting env would count its spin, which follows the wall clock.

    python benchmarks/bench_hot_path_instructions.py [--quick]
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench_common import (
    RESULTS,
    CountedChild,
    Report,
    paired_bars,
    parse_args,
    require_callgrind,
    save_plot,
    target,
)

NAME = "hot_path_instructions"
VARIANTS = ("without", "with")
FRAMES_PER_BATCH = 100


@dataclass
class Args:
    collectors: list[str] = field(default_factory=lambda: ["single", "sync-2"])
    frames: int = 1000  # counted frames per variant (per process of a multi-process collector: all)
    quick: bool = False
    out: Path = RESULTS


def quick(args: Args) -> Args:
    return replace(args, collectors=["single"], frames=200)


def child(variant: str, kind: str, frames: int) -> None:
    """Build the collector, warm it up, then count ``frames`` frames between two prompts."""
    import torch
    from torchrl.collectors import Collector, MultiSyncCollector

    from envsync import EnvStateSender
    from envsync.envs import make_drift_env

    torch.set_num_threads(1)
    torch.manual_seed(0)
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="reset")
    factory = sender.env_fn(make_drift_env) if variant == "with" else make_drift_env
    extra = {"weight_sync_schemes": sender.schemes()} if variant == "with" else {}
    per_batch = FRAMES_PER_BATCH
    if kind == "single":
        collector: Any = Collector(factory, None, frames_per_batch=per_batch, total_frames=-1, **extra)
    else:
        import multiprocessing as mp

        # spawn: each worker is its own valgrind (--trace-children), which callgrind_control reaches
        mp.set_start_method("spawn", force=True)
        workers = int(kind.split("-")[1])
        per_batch *= workers
        collector = MultiSyncCollector([factory] * workers, None, frames_per_batch=per_batch, total_frames=-1, **extra)
    try:
        batches = iter(collector)
        for _ in range(3):
            next(batches)
        pids = [os.getpid(), *(p.pid for p in getattr(collector, "procs", []))]
        print("ready", *pids, flush=True)
        sys.stdin.readline()
        counted = max(frames // per_batch, 1)
        for _ in range(counted):
            next(batches)
        print("done", counted * per_batch, flush=True)
        sys.stdin.readline()
    finally:
        collector.shutdown()
        sender.close()


def _count(variant: str, kind: str, frames: int) -> dict[str, Any]:
    """Run one variant under callgrind; the instructions of its counted frames, all processes."""
    child = CountedChild(__file__, [variant, kind, str(frames)], count=True, what=f"{variant} child")
    try:
        pids, done, seconds = child.counted(timeout=300)
        total = child.instructions()
    finally:
        child.close()
    frames = int(done[0])
    return {
        "instructions": total,
        "frames": frames,
        "per_frame": total / frames,
        "valgrind_s": seconds,
        "processes": len(pids),
    }


def _measure(kind: str, args: Args) -> dict[str, Any]:
    counts = {variant: _count(variant, kind, args.frames) for variant in VARIANTS}
    without, with_ = (counts[v]["per_frame"] for v in VARIANTS)
    return {
        "collector": kind,
        "frames": counts["with"]["frames"],
        "instructions_per_frame_without": without,
        "instructions_per_frame_with": with_,
        "added_per_frame": with_ - without,
        "with_over_without": with_ / without,
        "frames_per_instruction_ratio": without / with_,
        "processes": counts["with"]["processes"],
        "valgrind_s": sum(c["valgrind_s"] for c in counts.values()),
    }


COLUMNS = [
    ("collector", "collector"),
    ("frames", "frames counted"),
    ("processes", "processes counted"),
    ("instructions_per_frame_without", "instructions per frame without envsync"),
    ("instructions_per_frame_with", "with envsync, nothing pending"),
    ("added_per_frame", "added per frame"),
    ("frames_per_instruction_ratio", "frames per instruction, with / without"),
]


def _plot(rows: list[dict[str, Any]], out: Path) -> Path:
    fig, ax = paired_bars(
        [r["collector"] for r in rows],
        ("without", [r["instructions_per_frame_without"] for r in rows]),
        ("with envsync", [r["instructions_per_frame_with"] for r in rows]),
        "instructions per frame (callgrind)",
        "Hot path, nothing pending: instructions per frame",
    )
    for i, r in enumerate(rows):
        ratio = r["with_over_without"]
        ax.annotate(f"+{(ratio - 1) * 100:.2f}%", (i + 0.2, r["instructions_per_frame_with"]), ha="center", va="bottom")
    return save_plot(fig, out, NAME)


def run(args: Args) -> dict[str, Any]:
    require_callgrind()
    rows = [_measure(kind, args) for kind in args.collectors]
    report = Report(
        name=NAME,
        args=args,
        rows=rows,
        tables=[("Instructions executed per frame, counted by callgrind (cheap env)", COLUMNS)],
        summary={"plots": [_plot(rows, args.out).name]},
        targets=[
            target(
                f"hot path, cheap env, {r['collector']}: frames per instruction with envsync / without",
                r["frames_per_instruction_ratio"],
                0.99,
                higher_is_better=True,
            )
            for r in rows
        ],
        notes=[
            f"{args.frames} frames counted per variant after 3 warm-up batches of {FRAMES_PER_BATCH} frames per "
            "process; policy=None with torch.manual_seed(0) (both variants collect the same frames); "
            "multi-process collectors spawn their workers, each under its own valgrind (--trace-children), and "
            "every process is counted: the workers' frames and the main process's gathering",
            "instructions, not time: repeatable within ~0.1% from run to run; the issue's hot-path target is "
            "frames per CPU second >= 0.99 of the same collector without envsync",
        ],
    )
    return report.write(args.out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return run(parse_args(argv, Args, __doc__, quick))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
