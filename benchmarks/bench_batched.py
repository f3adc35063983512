"""What does envsync cost a batched env?

1. **Idle push vs torchrl's own dispatch.** A ``Collector`` drives a ``ParallelEnv`` of
   ``TickEnv`` sub-envs, idle between batches. We time ``sender.push(config=...,
   wait="applied")`` (``apply_at="step"``: applied at once in every sub-env's process) and
   torchrl's dispatch of the same method through the ``ParallelEnv``'s attribute forwarding
   (``collector.env.set_difficulty(x)``, which returns once every sub-process has run it),
   alternating, on the same collector. Target: push / dispatch <= 1.5.
2. **Hot path.** Frames per CPU second of ``Collector(SerialEnv(n))`` and
   ``Collector(ParallelEnv(n))`` of ``BusyDriftEnv`` (~300 µs steps), with envsync attached
   and nothing pending vs without, variants taking turns in short windows (CPU time of this
   process and every child process, the ``ParallelEnv``'s sub-processes included). Target:
   >= 0.99.

    python benchmarks/bench_batched.py [--quick]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import psutil
from bench_common import RESULTS, Report, median, parse_args, save_plot, start_method, target
from bench_envs import make_busy_env, make_tick_env
from tqdm import tqdm

from envsync import EnvStateSender

NAME = "batched"


@dataclass
class Args:
    envs: int = 4
    calls: int = 200  # alternating push / dispatch pairs
    frames_per_batch: int = 400
    batches: int = 8  # batches per hot-path window (long windows: a ParallelEnv's CPU time is noisy)
    windows: int = 12  # hot-path windows per variant
    start_method: str = "fork"
    quick: bool = False
    out: Path = RESULTS


def quick(args: Args) -> Args:
    return replace(args, envs=2, calls=10, batches=1, windows=2, frames_per_batch=100)


def make_batched(kind: str, n: int, make_env: Callable[[], Any]) -> Any:
    from torchrl.envs import ParallelEnv, SerialEnv

    return SerialEnv(n, make_env) if kind == "serial" else ParallelEnv(n, make_env)


def _collector(make_env: Callable[[], Any], args: Args, sender: EnvStateSender | None) -> Any:
    from torchrl.collectors import Collector

    extra = {} if sender is None else {"weight_sync_schemes": sender.schemes()}
    factory = make_env if sender is None else sender.env_fn(make_env)
    return Collector(factory, None, frames_per_batch=args.frames_per_batch, total_frames=-1, **extra)


def _push_vs_dispatch(args: Args, bar: tqdm) -> dict[str, Any]:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method(args.start_method):
        collector = _collector(partial(make_batched, "parallel", args.envs, make_tick_env), args, sender)
    push, dispatch = [], []
    try:
        next(iter(collector))  # started, then idle
        for i in range(args.calls):
            value = float(i % 7)
            start = time.perf_counter()
            sender.push(config={"difficulty": value}, wait="applied")
            push.append(time.perf_counter() - start)
            start = time.perf_counter()
            collector.env.set_difficulty(value + 0.5)
            dispatch.append(time.perf_counter() - start)
            bar.update()
    finally:
        collector.shutdown()
        sender.close()
    return {
        "what": f"idle push to Collector(ParallelEnv({args.envs}))",
        "push_us": median(push) * 1e6,
        "dispatch_us": median(dispatch) * 1e6,
        "push_over_dispatch": median(push) / median(dispatch),
    }


def _cpu_seconds() -> float:
    """CPU time of this process and of every process it started (workers, sub-processes)."""
    total = time.process_time()
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def _window(batches: Iterator[Any], args: Args) -> float:
    next(batches)
    cpu = _cpu_seconds()
    for _ in range(args.batches):
        next(batches)
    return args.batches * args.frames_per_batch / (_cpu_seconds() - cpu)


def _hot_path(kind: str, args: Args, bar: tqdm) -> dict[str, Any]:
    make = partial(make_batched, kind, args.envs, partial(make_busy_env, step_us=300.0))
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="reset")
    variants = {"without": None, "with": sender}
    collectors: dict[str, Any] = {}
    cpf: dict[str, list[float]] = {v: [] for v in variants}
    try:
        with start_method(args.start_method):
            for name, owner in variants.items():
                collectors[name] = _collector(make, args, owner)
        iterators = {name: iter(c) for name, c in collectors.items()}
        order = list(variants)
        for i in range(args.windows):
            for name in order[i % 2 :] + order[: i % 2]:
                cpf[name].append(_window(iterators[name], args))
                bar.update()
    finally:
        for collector in collectors.values():
            collector.shutdown()
        sender.close()
    # pooled: every window's frames over every window's CPU seconds
    without, with_ = (len(cpf[v]) / sum(1 / x for x in cpf[v]) for v in ("without", "with"))
    return {
        "what": f"hot path, Collector({'SerialEnv' if kind == 'serial' else 'ParallelEnv'}({args.envs})), busy-300us",
        "cpf_without": without,
        "cpf_with": with_,
        "cpf_ratio": with_ / without,
        "cpf_ratio_median": median(cpf["with"]) / median(cpf["without"]),
        "raw_frames_per_cpu_s": cpf,
    }


COLUMNS = [
    ("what", "measurement"),
    ("push_us", "envsync push, wait=applied (µs)"),
    ("dispatch_us", "ParallelEnv attribute dispatch (µs)"),
    ("push_over_dispatch", "push / dispatch"),
    ("cpf_without", "frames per CPU s without envsync (pooled)"),
    ("cpf_with", "frames per CPU s with envsync (pooled)"),
    ("cpf_ratio", "with / without"),
    ("cpf_ratio_median", "same, medians of windows"),
]


def _plot(rows: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib.pyplot as plt

    push, hot = rows[0], rows[1:]
    fig, (push_ax, hot_ax) = plt.subplots(1, 2, figsize=(10, 3.8))
    push_ax.bar(["envsync push", "ParallelEnv dispatch"], [push["push_us"], push["dispatch_us"]])
    push_ax.set(ylabel="median µs", title=push["what"])
    labels = [r["what"].split(", ")[1] for r in hot]
    x = range(len(hot))
    hot_ax.bar([i - 0.2 for i in x], [r["cpf_without"] for r in hot], width=0.4, label="without envsync")
    hot_ax.bar([i + 0.2 for i in x], [r["cpf_with"] for r in hot], width=0.4, label="envsync, nothing pending")
    for i, r in zip(x, hot, strict=True):
        hot_ax.annotate(f"{r['cpf_ratio']:.3f}", (i + 0.2, r["cpf_with"]), ha="center", va="bottom", fontsize=8)
    hot_ax.set_xticks(list(x), labels, fontsize=8)
    hot_ax.set(ylabel="frames per CPU second (pooled)", title="hot path, busy-300us sub-envs")
    hot_ax.legend(fontsize=8)
    fig.suptitle("Batched envs: idle push and hot path")
    return save_plot(fig, out, NAME)


def run(args: Args) -> dict[str, Any]:
    rows = []
    with tqdm(total=args.calls + 2 * 2 * args.windows, desc=NAME, unit="step") as bar:
        rows.append(_push_vs_dispatch(args, bar))
        for kind in ("serial", "parallel"):
            rows.append(_hot_path(kind, args, bar))
    targets = [
        target(
            f"idle push to Collector(ParallelEnv({args.envs})) / torchrl's attribute dispatch of the same method",
            rows[0]["push_over_dispatch"],
            1.5,
            higher_is_better=False,
        )
    ]
    targets += [
        target(f"{r['what']}: frames per CPU s with envsync / without", r["cpf_ratio"], 0.99, higher_is_better=True)
        for r in rows[1:]
    ]
    report = Report(
        name=NAME,
        args=args,
        rows=rows,
        tables=[("Medians", COLUMNS)],
        summary={"plots": [_plot(rows, args.out).name]},
        targets=targets,
        notes=[
            f"push and dispatch alternate on one idle collector, {args.calls} pairs; sub-envs started with "
            f"{args.start_method}; the dispatch is torchrl's ParallelEnv.__getattr__ forwarding (one message per "
            "sub-process, answers awaited)",
            f"hot path: {args.windows} windows per variant of {args.batches} x {args.frames_per_batch} frames, "
            "variants taking turns; CPU time of this process and every child process, pooled over the windows (every "
            "window's frames over every window's CPU seconds); a ParallelEnv's parent spins while its sub-processes "
            "step, so its windows vary by +-10% on 2 cores",
        ],
    )
    return report.write(args.out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return run(parse_args(argv, Args, __doc__, quick))


if __name__ == "__main__":
    main()
