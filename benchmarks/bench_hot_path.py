"""What does envsync cost a collector when nothing is pending?

Frames per second and per CPU second of the same collector with envsync attached
(``sender.env_fn`` + ``sender.schemes()``, no push) and without, for an env whose step costs
~300 µs (``BusyDriftEnv`` busy-waits; ~630 CPU µs a frame with torchrl's own work) and for a
cheap one (``DriftEnv`` through ``GymEnv``; ~300 CPU µs a frame, nearly all torchrl).
Collectors: the single-process ``Collector`` and a ``MultiSyncCollector`` (workers idle between
batches, so every window starts from the same state). The two variants take turns in short
windows, so they share the machine's noise; medians over the windows, and the ratio
with / without of frames per CPU second (the issue's target: >= 0.99).

    python benchmarks/bench_hot_path.py [--quick]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import psutil
from bench_common import RESULTS, Report, median, parse_args, save_plot, start_method, target
from bench_envs import make_busy_env
from tqdm import tqdm

from envsync import EnvStateSender
from envsync.envs import make_drift_env

NAME = "hot_path"
ENVS: dict[str, Callable[[], Any]] = {"busy-300us": partial(make_busy_env, step_us=300.0), "cheap": make_drift_env}


@dataclass
class Args:
    envs: list[str] = field(default_factory=lambda: list(ENVS))
    collectors: list[str] = field(default_factory=lambda: ["single", "sync-2"])
    frames_per_batch: int = 200
    batches: int = 2  # batches per timed window
    windows: int = 30  # timed windows per variant
    start_method: str = "fork"
    quick: bool = False
    out: Path = RESULTS


def quick(args: Args) -> Args:
    return replace(args, collectors=["single"], batches=1, windows=2)


VARIANTS = ("without", "with")


def _build(kind: str, variant: str, make_env: Callable[[], Any], sender: EnvStateSender, args: Args) -> Any:
    from torchrl.collectors import Collector, MultiSyncCollector

    factory = sender.env_fn(make_env) if variant == "with" else make_env
    extra = {"weight_sync_schemes": sender.schemes()} if variant == "with" else {}
    common = {"frames_per_batch": args.frames_per_batch, "total_frames": -1, **extra}
    if kind == "single":
        return Collector(factory, None, **common)
    workers = int(kind.split("-")[1])
    return MultiSyncCollector([factory] * workers, None, **common)


def _cpu_seconds(collector: Any) -> float:
    """CPU time used so far by this process and by the collector's worker processes."""
    total = time.process_time()
    for proc in getattr(collector, "procs", []):
        times = psutil.Process(proc.pid).cpu_times()
        total += times.user + times.system
    return total


def _window(collector: Any, batches: Iterator[Any], args: Args) -> tuple[float, float]:
    """Frames per second and frames per CPU second over ``args.batches`` batches (after one
    batch that is not timed). CPU time is what the collector itself burns, whatever else
    runs on the machine."""
    next(batches)
    cpu, wall = _cpu_seconds(collector), time.perf_counter()
    for _ in range(args.batches):
        next(batches)
    wall, cpu = time.perf_counter() - wall, _cpu_seconds(collector) - cpu
    frames = args.batches * args.frames_per_batch
    return frames / wall, frames / cpu


def _measure(env_name: str, kind: str, args: Args, bar: tqdm) -> dict[str, Any]:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="reset")
    collectors: dict[str, Any] = {}
    fps: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    cpf: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    try:
        with start_method(args.start_method):
            for variant in VARIANTS:
                collectors[variant] = _build(kind, variant, ENVS[env_name], sender, args)
        iterators = {variant: iter(collector) for variant, collector in collectors.items()}
        for i in range(args.windows):
            for variant in VARIANTS[i % 2 :] + VARIANTS[: i % 2]:
                per_second, per_cpu_second = _window(collectors[variant], iterators[variant], args)
                fps[variant].append(per_second)
                cpf[variant].append(per_cpu_second)
                bar.update()
    finally:
        for collector in collectors.values():
            collector.shutdown()
        sender.close()
    without, with_ = (median(fps[variant]) for variant in VARIANTS)
    cpu_without, cpu_with = (median(cpf[variant]) for variant in VARIANTS)
    # pooled: every window's frames over every window's CPU seconds (less sensitive to the
    # 10 ms ticks in which the workers' CPU time is counted than a median of windows)
    pooled_without, pooled_with = (len(cpf[v]) / sum(1 / x for x in cpf[v]) for v in VARIANTS)
    return {
        "env": env_name,
        "collector": kind,
        "fps_without": without,
        "fps_with": with_,
        "overhead_pct": (1 - with_ / without) * 100,
        "cpf_without": cpu_without,
        "cpf_with": cpu_with,
        "cpf_ratio": cpu_with / cpu_without,
        "cpf_ratio_pooled": pooled_with / pooled_without,
        "overhead_cpu_pct": (1 - cpu_with / cpu_without) * 100,
        "cpu_us_per_frame": 1e6 / cpu_without,
        "cpu_us_per_frame_added": (1 / cpu_with - 1 / cpu_without) * 1e6,
        "raw_fps": fps,
        "raw_frames_per_cpu_s": cpf,
    }


COLUMNS = [
    ("env", "env"),
    ("collector", "collector"),
    ("fps_without", "frames/s without envsync"),
    ("fps_with", "frames/s with envsync"),
    ("overhead_pct", "overhead, wall clock (%)"),
    ("cpu_us_per_frame", "CPU µs per frame without envsync"),
    ("cpu_us_per_frame_added", "CPU µs per frame added by envsync"),
    ("overhead_cpu_pct", "overhead, CPU time (%)"),
    ("cpf_ratio", "frames per CPU s, with / without"),
    ("cpf_ratio_pooled", "same, pooled over windows"),
]


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        target(
            f"hot path, {r['env']} (~{r['cpu_us_per_frame']:.0f} CPU µs/frame), {r['collector']}: "
            "frames per CPU s with envsync / without",
            r["cpf_ratio"],
            0.99,
            higher_is_better=True,
        )
        for r in rows
    ]


def _plot(rows: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib.pyplot as plt

    labels = [f"{r['env']}\n{r['collector']}" for r in rows]
    x = range(len(rows))
    fig, (wall_ax, cpu_ax) = plt.subplots(1, 2, figsize=(max(9, 3.4 * len(rows)), 4))
    for ax, prefix, pct, title in (
        (wall_ax, "fps", "overhead_pct", "frames per second (wall clock)"),
        (cpu_ax, "cpf", "overhead_cpu_pct", "frames per CPU second"),
    ):
        ax.bar([i - 0.2 for i in x], [r[f"{prefix}_without"] for r in rows], width=0.4, label="without envsync")
        ax.bar([i + 0.2 for i in x], [r[f"{prefix}_with"] for r in rows], width=0.4, label="envsync, nothing pending")
        for i, r in zip(x, rows, strict=True):
            ax.annotate(f"{-r[pct]:+.1f}%", (i + 0.2, r[f"{prefix}_with"]), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.set(ylabel="median", title=title)
    wall_ax.legend(fontsize=8)
    fig.suptitle("Collector throughput with and without envsync")
    return save_plot(fig, out, NAME)


def run(args: Args) -> dict[str, Any]:
    pairs = [(e, k) for e in args.envs for k in args.collectors]
    rows = []
    with tqdm(total=len(pairs) * len(VARIANTS) * args.windows, desc=NAME, unit="window") as bar:
        for env_name, kind in pairs:
            bar.set_postfix(env=env_name, collector=kind)
            rows.append(_measure(env_name, kind, args, bar))
    report = Report(
        name=NAME,
        args=args,
        rows=rows,
        tables=[("Medians, envsync attached with nothing pending vs not attached", COLUMNS)],
        summary={"plots": [_plot(rows, args.out).name]},
        targets=_targets(rows),
        notes=[
            f"{args.windows} windows per variant of {args.batches} x {args.frames_per_batch} frames, variants "
            f"taking turns; policy=None (random actions); multi-process collectors built with {args.start_method}",
            "overhead = 1 - with / without, on frames per second (wall clock) and on frames per CPU second (this "
            "process + the collector's workers: what the collector burns, whatever else the machine runs); "
            "negative values are noise; the workers' CPU time is read from /proc in 10 ms ticks",
            "target: frames per CPU second with envsync / without (medians over windows) >= 0.99, every env and "
            "collector",
        ],
    )
    return report.write(args.out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return run(parse_args(argv, Args, __doc__, quick))


if __name__ == "__main__":
    main()
