"""The workload the users reported: switch a config on a running collector, or restart it?

A gymnasium env (envsync's ``DriftEnv`` through ``GymEnv``) in a torchrl
``MultiAsyncCollector`` of 1, 4, 10 and 20 workers, built with spawn (torchrl's default, set
explicitly), ``policy=None``, ``total_frames=-1``. Per worker count:

- envsync: the collector is iterated; every ``2 * window`` batches the loop body either
  switches the difficulty or, as a control, does nothing (alternately). A switch calls
  ``sender.push(config={"difficulty": x}, wait="received")`` and then
  ``sender.wait(version, until="applied")`` (``apply_at="step"``: each worker applies it at
  its next step, while the loop body waits), and checks that ``sender.versions()`` all show
  the new version. Frames/s over the ``window`` batches before a mark and the ``window``
  batches after it (the push included) give an after/before ratio per mark; the controls
  show how much that ratio moves by noise alone.
- The switches alternate between ``+d`` and ``-d`` (the run starts at ``+d``): DriftEnv's
  dynamics under ``-d`` mirror those under ``+d``, so episodes last as long and a frame costs
  the same before and after a switch. (A harder difficulty ends episodes sooner, and resets
  cost more than steps: switching 0.1 -> 0.2 -> ... would measure the config, not envsync.)
- a restart, what users do today to switch: ``collector.shutdown()`` + building the same
  collector + its first batch.

    python benchmarks/bench_workload.py [--quick] [--workers 1 4 10 20]

``--quick`` (1 and 4 workers, 2 pushes, 1 restart each) builds with fork to stay well under a
minute; ``--quick --start-method spawn`` takes ~1 min on 2 cores.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench_common import RESULTS, Report, median, parse_args, save_plot, start_method, target
from tqdm import tqdm

from envsync import EnvStateSender
from envsync.envs import make_drift_env

NAME = "workload"


@dataclass
class Args:
    workers: list[int] = field(default_factory=lambda: [1, 4, 10, 20])
    frames_per_batch: int = 500  # one worker's batch: ~0.1-0.2 s of DriftEnv on this machine
    switches: int = 5  # pushes per worker count (and as many control marks)
    window: int = 10  # batches before and after each mark (at least the worker count)
    difficulty: float = 0.5  # the switches alternate between -difficulty and +difficulty
    restarts: int = 2  # restarts per worker count below `many_workers`
    many_workers: int = 10  # from this worker count on, `many_restarts` restarts
    many_restarts: int = 1
    start_method: str = "spawn"
    quick: bool = False
    out: Path = RESULTS


def quick(args: Args) -> Args:
    # fork: four spawn workers take ~20 s to start here, twice per worker count (build, restart)
    small = replace(args, workers=[1, 2], frames_per_batch=200, switches=2, window=2, restarts=1, many_restarts=1)
    return replace(small, start_method="fork")


def _build(sender: EnvStateSender, workers: int, args: Args) -> Any:
    from torchrl.collectors import MultiAsyncCollector

    with start_method(args.start_method):
        return MultiAsyncCollector(
            [sender.env_fn(make_drift_env)] * workers,
            None,
            frames_per_batch=args.frames_per_batch,
            total_frames=-1,
            weight_sync_schemes=sender.schemes(),
        )


@dataclass
class Mark:
    batch: int  # index of the batch after which the loop body pushed (or, a control, did nothing)
    start: float  # perf_counter when the push began (or the control mark)


@dataclass
class Switch(Mark):
    received_s: float
    applied_s: float
    all_applied: bool  # sender.versions() all equal the pushed version afterwards


def _iterate(batches: Any, sender: EnvStateSender, workers: int, args: Args, bar: tqdm) -> dict[str, Any]:
    """Warm up for ``window`` batches, then every ``2 * window`` batches a mark from the loop
    body: a switch, then a control, alternately."""
    window = max(args.window, workers)
    marks = 2 * args.switches
    first = 2 * window - 1  # batch index of the first mark: a warm-up window, then a "before" window
    last = first + 2 * window * (marks - 1) + window  # the last mark's "after" window ends here
    arrivals: list[float] = []
    done: list[Mark] = []
    sender.push(config={"difficulty": args.difficulty}, wait="applied")  # the warm-up runs at +d
    for i, _batch in enumerate(batches):
        arrivals.append(time.perf_counter())
        if i == last:
            break
        if i < first or (i - first) % (2 * window) or len(done) == marks:
            continue
        start = time.perf_counter()
        if len(done) % 2:
            done.append(Mark(i, start))
            continue
        difficulty = args.difficulty * (-1 if len(done) % 4 == 0 else 1)  # -d, +d, -d, ...
        version = sender.push(config={"difficulty": difficulty}, wait="received")
        received = time.perf_counter()
        sender.wait(version, until="applied")
        applied = time.perf_counter()
        ok = all(v == version for v in sender.versions())
        done.append(Switch(i, start, received - start, applied - start, ok))
        bar.update()
    frames = window * args.frames_per_batch

    def fps(mark: Mark) -> tuple[float, float]:
        before = frames / (mark.start - arrivals[mark.batch - window])
        return before, frames / (arrivals[mark.batch + window] - mark.start)

    switches = [m for m in done if isinstance(m, Switch)]
    controls = [m for m in done if not isinstance(m, Switch)]
    return {
        "window": window,
        "switches": switches,
        "fps": [fps(s) for s in switches],
        "control_fps": [fps(c) for c in controls],
    }


def _measure(workers: int, args: Args, bar: tqdm) -> dict[str, Any]:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    restarts = args.many_restarts if workers >= args.many_workers else args.restarts
    restart_s: list[float] = []
    collector = None
    try:
        start = time.perf_counter()
        collector = _build(sender, workers, args)
        batches = iter(collector)
        next(batches)
        cold_s = time.perf_counter() - start
        bar.update()
        iterated = _iterate(batches, sender, workers, args, bar)
        for _ in range(restarts):
            start = time.perf_counter()
            collector.shutdown()
            collector = None
            collector = _build(sender, workers, args)
            next(iter(collector))
            restart_s.append(time.perf_counter() - start)
            bar.update()
    finally:
        if collector is not None:
            collector.shutdown()
        sender.close()
    return _row(workers, cold_s, restart_s, iterated)


def _row(workers: int, cold_s: float, restart_s: list[float], iterated: dict[str, Any]) -> dict[str, Any]:
    switches: list[Switch] = iterated["switches"]
    received = [s.received_s for s in switches]
    applied = [s.applied_s for s in switches]
    ratios = [after / before for before, after in iterated["fps"]]
    controls = [after / before for before, after in iterated["control_fps"]]
    row: dict[str, Any] = {
        "workers": workers,
        "build_first_batch_ms": cold_s * 1e3,
        "restart_ms": median(restart_s) * 1e3,
        "restarts": len(restart_s),
        "push_received_us": median(received) * 1e6,
        "push_applied_us": median(applied) * 1e6,
        "push_applied_max_us": max(applied) * 1e6,
        "switches": len(switches),
        "all_applied": all(s.all_applied for s in switches),
        "fps_before": median([before for before, _ in iterated["fps"]]),
        "fps_after": median([after for _, after in iterated["fps"]]),
        "after_over_before": median(ratios),
        "after_over_before_min": min(ratios),
        "control_after_over_before": median(controls),
        "control_after_over_before_min": min(controls),
        "window": iterated["window"],
        "raw_s": {
            "restarts": restart_s,
            "received": received,
            "applied": applied,
            "fps_before_after": iterated["fps"],
            "control_fps_before_after": iterated["control_fps"],
        },
    }
    row["restart_over_received"] = row["restart_ms"] * 1e3 / row["push_received_us"]
    row["restart_over_applied"] = row["restart_ms"] * 1e3 / row["push_applied_us"]
    return row


LATENCY_COLUMNS = [
    ("workers", "workers"),
    ("restart_ms", "restart (ms)"),
    ("restarts", "restarts"),
    ("push_received_us", "push->received (µs)"),
    ("push_applied_us", "push->applied by all (µs)"),
    ("push_applied_max_us", "push->applied, slowest (µs)"),
    ("switches", "pushes"),
    ("all_applied", "versions() all new"),
    ("restart_over_received", "restart / push->received"),
    ("restart_over_applied", "restart / push->applied"),
]
THROUGHPUT_COLUMNS = [
    ("workers", "workers"),
    ("window", "window (batches)"),
    ("fps_before", "frames/s before"),
    ("fps_after", "frames/s after (push included)"),
    ("after_over_before", "after / before (median)"),
    ("after_over_before_min", "after / before (worst)"),
    ("control_after_over_before", "control: after / before (median)"),
    ("control_after_over_before_min", "control: after / before (worst)"),
    ("build_first_batch_ms", "first build + first batch (ms)"),
]


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def worst(key: str) -> tuple[float, int]:
        row = min(rows, key=lambda r: r[key])
        return row[key], row["workers"]

    received, w_received = worst("restart_over_received")
    applied, w_applied = worst("restart_over_applied")
    ratio, w_ratio = worst("after_over_before")
    return [
        target(
            f"spawn restart / push->received, every worker count (worst: {w_received})",
            received,
            1000,
            higher_is_better=True,
        ),
        target(
            f"spawn restart / push->applied, every worker count (worst: {w_applied})",
            applied,
            1000,
            higher_is_better=True,
        ),
        target(
            f"frames/s after / before a push, median per worker count (worst: {w_ratio})",
            ratio,
            0.95,
            higher_is_better=True,
            unit="",
        ),
    ]


def _plot(rows: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib.pyplot as plt

    workers = [r["workers"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, scale, label in (
        ("restart_ms", 1e3, "restart (shutdown + build + first batch, spawn)"),
        ("push_applied_us", 1.0, "envsync push -> applied by every worker"),
        ("push_received_us", 1.0, "envsync push -> received"),
    ):
        ax.plot(workers, [r[key] * scale for r in rows], marker="o", label=label)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="workers",
        ylabel="median (µs, log)",
        title="Switching DriftEnv's difficulty in a MultiAsyncCollector being iterated",
    )
    ax.set_xticks(workers, [str(w) for w in workers])
    ax.minorticks_off()
    ax.legend(fontsize=8)
    return save_plot(fig, out, NAME)


def run(args: Args) -> dict[str, Any]:
    def restarts(w: int) -> int:
        return args.many_restarts if w >= args.many_workers else args.restarts

    start = time.perf_counter()
    rows = []
    with tqdm(total=sum(1 + args.switches + restarts(w) for w in args.workers), desc=NAME, unit="step") as bar:
        for workers in args.workers:
            bar.set_postfix(workers=workers)
            rows.append(_measure(workers, args, bar))
    seconds = time.perf_counter() - start
    report = Report(
        name=NAME,
        args=args,
        rows=rows,
        tables=[("Switch latency (medians)", LATENCY_COLUMNS), ("Throughput around a push", THROUGHPUT_COLUMNS)],
        summary={"plots": [_plot(rows, args.out).name], "seconds": seconds},
        targets=_targets(rows),
        notes=[
            f"DriftEnv through GymEnv in a MultiAsyncCollector built with {args.start_method}, policy=None, "
            f"frames_per_batch={args.frames_per_batch} (per worker batch), total_frames=-1",
            "envsync: apply_at='step'; from the loop body, push(config={'difficulty': x}, wait='received'), "
            "then wait(version, until='applied'); push->applied counts from the start of the push; "
            "'versions() all new' checks sender.versions() right after",
            f"{args.switches} pushes and {args.switches} control marks (nothing done) per worker count, "
            "alternately, one every 2 x window batches; frames/s over the window before a mark and the window "
            f"after it (the push included); the difficulty alternates -{args.difficulty}, +{args.difficulty}, "
            f"... from +{args.difficulty} (mirror-image dynamics: a frame costs the same under both)",
            f"restart = shutdown() + build the same collector + first batch; {args.restarts} per worker count "
            f"below {args.many_workers} workers, {args.many_restarts} from {args.many_workers} on (spawning "
            "that many workers on this machine takes a while); envsync stays attached across restarts",
            f"the whole run took {seconds:.0f} s",
        ],
    )
    return report.write(args.out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return run(parse_args(argv, Args, __doc__, quick))


if __name__ == "__main__":
    main()
