"""What does a push allocate in the main process?

On an idle ``MultiAsyncCollector`` of 4 workers (``apply_at="step"``, ``wait="applied"``):

- a small fixed-shape config (``{"difficulty": x}``): the bytes the main process holds more
  after ``--pushes`` pushes than before, per push, measured with ``tracemalloc`` (Python and
  numpy allocations) after ``--warmup`` pushes (the sender's records reach their steady size:
  undo, the per-env config history pruned at ``2 * keep + 1`` entries); and the process's
  resident set growth over the same pushes (torch's CPU allocator has no statistics; the
  resident set sees every allocation that stays);
- a 32 MB config (``{"table": t}``, kept by each env's config method): the peak extra
  resident memory of one push over what the process held just before it (``VmHWM`` after a
  ``clear_refs`` reset, Linux), in payloads, median over ``--big-pushes``; and what the
  process holds after them over what it held after the first (the records: the current
  config, the undo of the latest push, the config history's ``keep_bytes``).

    python benchmarks/bench_memory.py [--quick]
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from bench_common import RESULTS, Report, median, parse_args, start_method, target
from bench_envs import keep_table, make_buffer_env

from envsync import EnvStateSender

NAME = "memory"
MB = 1 << 20


@dataclass
class Args:
    workers: int = 4
    warmup: int = 400  # small pushes before measuring (the history reaches its pruned size)
    pushes: int = 1000  # small pushes measured
    big_pushes: int = 12  # 32 MB config pushes
    big_mb: int = 32
    start_method: str = "fork"
    quick: bool = False
    out: Path = RESULTS


def quick(args: Args) -> Args:
    return replace(args, workers=2, warmup=150, pushes=200, big_pushes=4, big_mb=8)


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # resets VmHWM to the current resident set
        return True
    except OSError:
        return False


def _peak() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _small(sender: EnvStateSender, args: Args) -> dict[str, float]:
    tracemalloc.start()  # before the warm-up: what it made and frees later is counted both ways
    for i in range(args.warmup):
        sender.push(config={"difficulty": float(i % 7)}, wait="applied")
    gc.collect()
    before, rss_before = tracemalloc.get_traced_memory()[0], _rss()
    for i in range(args.pushes):
        sender.push(config={"difficulty": float(i % 7)}, wait="applied")
    gc.collect()
    after, rss_after = tracemalloc.get_traced_memory()[0], _rss()
    tracemalloc.stop()
    return {
        "small_traced_bytes_per_push": (after - before) / args.pushes,
        "small_rss_bytes_per_push": (rss_after - rss_before) / args.pushes,
    }


def _big(sender: EnvStateSender, numel: int, args: Args) -> dict[str, Any]:
    payload = numel * 4
    sender.push(config={"table": torch.rand(numel)}, wait="applied")
    gc.collect()
    first = _rss()
    peaks = []
    for _ in range(args.big_pushes):
        table = torch.rand(numel)  # the caller's tensor exists before the push: not the push's
        gc.collect()
        if not _reset_peak():
            raise RuntimeError("this kernel does not reset VmHWM (/proc/self/clear_refs)")
        start = _rss()
        sender.push(config={"table": table}, wait="applied")
        peaks.append((_peak() - start) / payload)
        del table
    gc.collect()
    return {
        "big_peak_payloads": median(peaks),
        "big_peak_payloads_max": max(peaks),
        "big_held_payloads": (_rss() - first) / payload,
        "raw_peaks": peaks,
    }


def run(args: Args) -> dict[str, Any]:
    from torchrl.collectors import MultiAsyncCollector

    numel = args.big_mb * MB // 4
    sender = EnvStateSender(config={"difficulty": 0.0, "table": torch.zeros(numel)}, apply=keep_table, apply_at="step")
    collector = None
    try:
        with start_method(args.start_method):
            collector = MultiAsyncCollector(
                [sender.env_fn(partial(make_buffer_env, 1))] * args.workers,
                None,
                frames_per_batch=64,
                total_frames=-1,
                weight_sync_schemes=sender.schemes(),
            )
        row: dict[str, Any] = {"workers": args.workers, "payload": f"{args.big_mb} MB"}
        row |= _small(sender, args)
        row |= _big(sender, numel, args)
    finally:
        if collector is not None:
            collector.shutdown()
        sender.close()
    keep_mb = sender.config_history.keep_bytes / MB
    report = Report(
        name=NAME,
        args=args,
        rows=[row],
        tables=[("What a push leaves and takes in the main process", COLUMNS)],
        summary={"plots": []},
        targets=[
            target(
                "small fixed-shape config push: bytes the main process keeps per push after warm-up (tracemalloc)",
                row["small_traced_bytes_per_push"],
                0,
                higher_is_better=False,
                unit=" B",
            ),
            target(
                f"{row['payload']} config push: peak extra memory, in payloads",
                row["big_peak_payloads"],
                1,
                higher_is_better=False,
            ),
        ],
        notes=[
            f"MultiAsyncCollector of {args.workers} workers built with {args.start_method}, idle; wait='applied'",
            f"the records after the big pushes: the current config, the latest push's undo and the config "
            f"history's older entries up to keep_bytes ({keep_mb:.0f} MiB)",
            "resident-set figures are page-granular and include the allocator's caching",
        ],
    )
    return report.write(args.out)


COLUMNS = [
    ("workers", "workers"),
    ("small_traced_bytes_per_push", "small push: bytes kept per push (tracemalloc)"),
    ("small_rss_bytes_per_push", "small push: resident growth per push (B)"),
    ("payload", "big config"),
    ("big_peak_payloads", "big push: peak extra memory (payloads, median)"),
    ("big_peak_payloads_max", "big push: peak extra (payloads, max)"),
    ("big_held_payloads", "held after the big pushes over after the first (payloads)"),
]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return run(parse_args(argv, Args, __doc__, quick))


if __name__ == "__main__":
    main()
