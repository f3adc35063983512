"""How long does an exact merge of normaliser statistics across workers take?

Each of 4 workers runs a ``VecNormV2`` (decay 1) over an observation of 1 KB or 1 MB
(float32). On an idle ``MultiSyncCollector``, after a batch, ``sender.sync_stats("VecNormV2")``
gathers every worker's statistics (count, mean and ``m2`` in float64), merges them exactly and
pushes the result to every worker, waiting until each has loaded it. The floor: the bytes a
sync has to move at the least, copied in this process: every worker's moments once out and
once back (2 x workers x one ``copy_`` of count + mean + m2).

    python benchmarks/bench_sync_stats.py [--quick]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from bench_common import RESULTS, Report, median, parse_args, save_plot, start_method, timed
from bench_envs import make_vecnorm_env
from tqdm import tqdm

from envsync import EnvStateSender

NAME = "sync_stats"
KB, MB = 1 << 10, 1 << 20


@dataclass
class Args:
    sizes: list[int] = field(default_factory=lambda: [KB, MB])  # bytes of the float32 observation
    workers: int = 4
    repeats: int = 10
    start_method: str = "fork"
    quick: bool = False
    out: Path = RESULTS


def quick(args: Args) -> Args:
    return replace(args, sizes=[KB], workers=2, repeats=2)


def _label(nbytes: int) -> str:
    return f"{nbytes // MB} MB" if nbytes >= MB else f"{nbytes // KB} KB"


def _floor(numel: int, workers: int) -> float:
    src = [torch.rand(numel, dtype=torch.float64) for _ in range(2)] + [torch.rand((), dtype=torch.float64)]
    dst = [torch.empty_like(t) for t in src]
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)  # first touch of the pages is not part of a copy
    return 2 * workers * timed(lambda: [d.copy_(s) for d, s in zip(dst, src, strict=True)])


def _measure(nbytes: int, args: Args, bar: tqdm) -> dict[str, Any]:
    from torchrl.collectors import MultiSyncCollector

    numel = nbytes // 4
    sender = EnvStateSender(config={}, apply=None, apply_at="step")
    collector = None
    times: dict[str, list[float]] = {"sync": [], "floor": []}
    try:
        with start_method(args.start_method):
            collector = MultiSyncCollector(
                [sender.env_fn(partial(make_vecnorm_env, numel))] * args.workers,
                None,
                frames_per_batch=8 * args.workers,
                total_frames=-1,
                weight_sync_schemes=sender.schemes(),
            )
        batches = iter(collector)
        for i in range(args.repeats + 1):
            next(batches)
            seconds = {"sync": timed(lambda: sender.sync_stats("VecNormV2")), "floor": _floor(numel, args.workers)}
            if i:  # the first round warms caches and threads up
                for key, value in seconds.items():
                    times[key].append(value)
            bar.update()
        counts = sender.gather(["stats.0"])["stats", "0", "observation", "count"]
        if not bool((counts == counts[0]).all()):
            raise RuntimeError(f"the workers do not hold the same merged statistics: {counts.tolist()}")
    finally:
        if collector is not None:
            collector.shutdown()
        sender.close()
    row: dict[str, Any] = {
        "size": _label(nbytes),
        "workers": args.workers,
        "sync_ms": median(times["sync"]) * 1e3,
        "floor_ms": median(times["floor"]) * 1e3,
        "raw_s": times,
    }
    row["sync_over_floor"] = row["sync_ms"] / row["floor_ms"]
    return row


COLUMNS = [
    ("size", "observation"),
    ("workers", "workers"),
    ("sync_ms", "sync_stats: gather + merge + push->applied (ms)"),
    ("floor_ms", "memcpy floor (ms)"),
    ("sync_over_floor", "sync_stats / floor"),
]


def _plot(rows: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    labels = [r["size"] for r in rows]
    ax.bar([x - 0.2 for x in range(len(rows))], [r["sync_ms"] for r in rows], width=0.4, label="sync_stats")
    ax.bar([x + 0.2 for x in range(len(rows))], [r["floor_ms"] for r in rows], width=0.4, label="memcpy floor")
    ax.set_xticks(range(len(rows)), labels)
    ax.set(ylabel="median time (ms, log)", yscale="log", title=f"sync_stats over {rows[0]['workers']} workers")
    ax.legend(fontsize=8)
    return save_plot(fig, out, NAME)


def run(args: Args) -> dict[str, Any]:
    with tqdm(total=len(args.sizes) * (args.repeats + 1), desc=NAME, unit="sync") as bar:
        rows = [_measure(nbytes, args, bar) for nbytes in args.sizes]
    report = Report(
        name=NAME,
        args=args,
        rows=rows,
        tables=[("Median time of one sync_stats round", COLUMNS)],
        summary={"plots": [_plot(rows, args.out).name]},
        targets=[],
        notes=[
            f"collector: MultiSyncCollector ({args.start_method}), idle between batches; a batch between syncs",
            "floor: 2 x workers x copy_ of the float64 moments (count, mean, m2) in this process",
        ],
    )
    return report.write(args.out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return run(parse_args(argv, Args, __doc__, quick))


if __name__ == "__main__":
    main()
