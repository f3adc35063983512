"""Does collection slow down after a switch?

A ``MultiAsyncCollector`` is iterated; every ``2 * window`` batches the loop body either
pushes a new config (``wait="applied"``) or, as a control, does nothing. Frames/s over the
``window`` batches before each mark and the ``window`` batches after it (the push included)
give one after/before ratio per mark; the control marks show how much the ratio moves by
noise alone. The env (``TickEnv``) counts its steps and shows its difficulty in every
observation, so the run also counts frames lost between batches of a worker, and frames
whose version tag names another difficulty than the one they show (both should be 0).

    python benchmarks/bench_throughput_switch.py [--quick]
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from bench_common import RESULTS, Report, median, parse_args, save_plot, start_method, target
from bench_envs import make_tick_env
from tqdm import tqdm

from envsync import EnvStateSender

NAME = "throughput_switch"


@dataclass
class Args:
    workers: int = 2
    frames_per_batch: int = 200
    window: int = 10  # batches before and after each mark
    marks: int = 12  # half pushes, half controls, alternating
    apply_at: str = "step"
    start_method: str = "fork"
    quick: bool = False
    out: Path = RESULTS


def quick(args: Args) -> Args:
    return replace(args, window=2, marks=2)


@dataclass
class Mark:
    batch: int  # index of the first batch collected after the mark
    start: float  # perf_counter when the loop body began the push (or the control)
    push: bool
    version: int
    push_s: float


@dataclass
class Collected:
    arrivals: list[float] = field(default_factory=list)  # perf_counter when each batch arrived
    versions: list[list[int]] = field(default_factory=list)  # each batch's ("next", "env_version")
    marks: list[Mark] = field(default_factory=list)
    lost_frames: int = 0
    untruthful_frames: int = 0
    _last_tick: dict[int, int] = field(default_factory=dict)

    def add(self, batch: Any, difficulty_of: dict[int, float]) -> None:
        self.arrivals.append(time.perf_counter())
        versions = batch["next", "env_version"].reshape(-1).tolist()
        self.versions.append(versions)
        observations = batch["next", "observation"].reshape(-1, 3)
        label, ticks = int(observations[0, 1]), observations[:, 2].tolist()
        if label in self._last_tick:
            self.lost_frames += int(ticks[0]) - self._last_tick[label] - 1
        self._last_tick[label] = int(ticks[-1])
        shown = observations[:, 0].tolist()
        self.untruthful_frames += sum(abs(d - difficulty_of[v]) > 1e-5 for d, v in zip(shown, versions, strict=True))


def _collect(args: Args, bar: tqdm) -> Collected:
    """Iterate, push or not at each mark, and record every batch."""
    from torchrl.collectors import MultiAsyncCollector

    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at=args.apply_at)
    run = Collected()
    difficulty_of = {0: 0.0}
    total = (2 * args.marks + 1) * args.window
    collector = None
    try:
        with start_method(args.start_method):
            collector = MultiAsyncCollector(
                [sender.env_fn(partial(make_tick_env, label=i)) for i in range(args.workers)],
                None,
                frames_per_batch=args.frames_per_batch,
                total_frames=-1,
                weight_sync_schemes=sender.schemes(),
            )
        for i, batch in enumerate(collector):
            run.add(batch, difficulty_of)
            bar.update()
            if len(run.arrivals) == total:
                break
            if (i + 1) % (2 * args.window) == 0:
                start = time.perf_counter()
                push = len(run.marks) % 2 == 0
                version = -1
                if push:
                    difficulty = 0.1 * (len(run.marks) + 1)
                    version = sender.push(config={"difficulty": difficulty}, wait="applied")
                    difficulty_of[version] = difficulty
                run.marks.append(Mark(i + 1, start, push, version, time.perf_counter() - start))
    finally:
        if collector is not None:
            collector.shutdown()
        sender.close()
    return run


def _analyse(args: Args, run: Collected) -> list[dict]:
    arrivals, versions = run.arrivals, run.versions
    rows = []
    frames = args.window * args.frames_per_batch
    for mark in run.marks:
        before = frames / (mark.start - arrivals[mark.batch - 1 - args.window])
        after = frames / (arrivals[mark.batch - 1 + args.window] - mark.start)
        after_frames = [v for batch in versions[mark.batch : mark.batch + args.window] for v in batch]
        new = sum(v >= mark.version for v in after_frames) / len(after_frames) if mark.push else float("nan")
        rows.append(
            {
                "mark": "push" if mark.push else "control",
                "batch": mark.batch,
                "push_ms": mark.push_s * 1e3 if mark.push else float("nan"),
                "fps_before": before,
                "fps_after": after,
                "after_over_before": after / before,
                "new_version_share": new,
            }
        )
    return rows


COLUMNS = [
    ("mark", "mark"),
    ("batch", "at batch"),
    ("push_ms", "push->applied (ms)"),
    ("fps_before", "frames/s before"),
    ("fps_after", "frames/s after (push included)"),
    ("after_over_before", "after / before"),
    ("new_version_share", "share of later frames on the new version"),
]


def _plot(args: Args, arrivals: list[float], marks: list[Mark], out: Path) -> Path:
    import matplotlib.pyplot as plt

    t0 = arrivals[0]
    span = args.window
    times = [arrivals[i] - t0 for i in range(span, len(arrivals))]
    rates = [span * args.frames_per_batch / (arrivals[i] - arrivals[i - span]) for i in range(span, len(arrivals))]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(times, rates, lw=1, label=f"frames/s over the last {span} batches")
    for mark in marks:
        style = {"color": "red", "ls": "-"} if mark.push else {"color": "grey", "ls": ":"}
        ax.axvline(mark.start - t0, lw=1, **style)
    ax.plot([], [], color="red", label="push (wait='applied')")
    ax.plot([], [], color="grey", ls=":", label="control (no push)")
    ax.set(
        xlabel="seconds",
        ylabel="frames/s",
        ylim=(0, None),
        title=f"MultiAsyncCollector, {args.workers} workers: throughput around switches",
    )
    ax.legend(fontsize=8, loc="lower right")
    return save_plot(fig, out, NAME)


def run(args: Args) -> dict[str, Any]:
    with tqdm(total=(2 * args.marks + 1) * args.window, desc=NAME, unit="batch") as bar:
        collected = _collect(args, bar)
    rows = _analyse(args, collected)
    pushes = [r["after_over_before"] for r in rows if r["mark"] == "push"]
    controls = [r["after_over_before"] for r in rows if r["mark"] == "control"]
    summary = {
        "median_after_over_before_push": median(pushes),
        "median_after_over_before_control": median(controls),
        "batches": len(collected.arrivals),
        "lost_frames": collected.lost_frames,
        "untruthful_frames": collected.untruthful_frames,
        "plots": [_plot(args, collected.arrivals, collected.marks, args.out).name],
    }
    report = Report(
        name=NAME,
        args=args,
        rows=rows,
        tables=[("Frames/s before and after each mark", COLUMNS)],
        summary=summary,
        targets=[
            target(
                "no throughput drop after a switch: median after/before over pushes",
                summary["median_after_over_before_push"],
                0.95,
                higher_is_better=True,
            )
        ],
        notes=[
            f"{args.workers} workers, TickEnv, apply_at={args.apply_at!r}, frames_per_batch={args.frames_per_batch}, "
            f"windows of {args.window} batches; built with {args.start_method}",
            f"median after/before: pushes {summary['median_after_over_before_push']:.3f}, "
            f"controls {summary['median_after_over_before_control']:.3f} (the noise band)",
            f"{summary['batches']} batches: {collected.lost_frames} frames lost between batches of a worker, "
            f"{collected.untruthful_frames} frames whose version tag names another difficulty than they show",
        ],
    )
    return report.write(args.out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return run(parse_args(argv, Args, __doc__, quick))


if __name__ == "__main__":
    main()
