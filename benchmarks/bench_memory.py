"""What does a push allocate in the main process?

On an idle ``MultiAsyncCollector`` of 4 workers (``apply_at="step"``, ``wait="applied"``):

- a small fixed-shape config (``{"difficulty": x}``): the bytes the main process holds more
  per push, measured with ``tracemalloc`` (Python and numpy allocations) after each of
  ``--blocks`` blocks of ``--pushes`` pushes, after ``--warmup`` pushes (the sender's records
  reach their steady size: the undo of the latest push, the per-env config history pruned
  every ``envsync.sender.history.SLACK`` records back to ``keep + 1`` entries). Each env's history
  swings through that cycle at its own pace, so the readings are fitted as ``a + per_push *
  pushes + per_entry * entries + per_version * versions held``; ``per_push`` is what a push
  leaves. And the process's
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

import numpy as np
import torch
from bench_common import RESULTS, Report, median, parse_args, start_method, target
from bench_envs import keep_table, make_buffer_env

from envsync import EnvStateSender

NAME = "memory"
MB = 1 << 20


@dataclass
class Args:
    workers: int = 4
    warmup: int = 3000  # small pushes before measuring (caches and the records reach their steady size)
    pushes: int = 4000  # small pushes per block
    blocks: int = 8  # blocks measured
    big_pushes: int = 12  # 32 MB config pushes
    big_mb: int = 32
    start_method: str = "fork"
    quick: bool = False
    out: Path = RESULTS


def quick(args: Args) -> Args:
    return replace(args, workers=2, warmup=150, pushes=50, blocks=3, big_pushes=4, big_mb=8)


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


def _held() -> int:
    """The bytes of every traced block but tracemalloc's own (a snapshot's records)."""
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
    return sum(stat.size for stat in snapshot.statistics("filename"))


def _small(sender: EnvStateSender, args: Args) -> dict[str, float]:
    """Bytes held after each of ``blocks`` blocks of ``pushes`` pushes, fitted by least
    squares as ``a + per_push * pushes + per_entry * entries + per_version * versions``: the
    config history's entries swing within their pruning cycle (each env at its own point of
    it; a fleet-wide push's leaves are shared by every env's entry of that version, and held
    while one of them is), and caches and free lists move each reading by some hundred bytes
    either way. The readings' own records are made before the first reading."""
    tracemalloc.start()  # before the warm-up: what it made and frees later is counted both ways
    for i in range(args.warmup):
        sender.push(config={"difficulty": float(i % 7)}, wait="applied")
    history = sender.config_history
    _held()  # its filter's compiled pattern is cached on first use: not a push's
    readings = np.zeros((args.blocks + 1, 4))
    rss = [_rss(), 0]
    for block in range(args.blocks + 1):
        gc.collect()
        kept = [history.versions(env) for env in range(args.workers)]
        readings[block, :3] = block * args.pushes, sum(map(len, kept)), len(set().union(*kept))
        del kept
        readings[block, 3] = _held()
        for i in range(args.pushes):
            sender.push(config={"difficulty": float(i % 7)}, wait="applied")
    rss[1] = _rss()
    tracemalloc.stop()
    design = np.column_stack((np.ones(len(readings)), readings[:, :3]))
    fit = np.linalg.lstsq(design, readings[:, 3], rcond=None)[0]
    return {
        "small_traced_bytes_per_push": float(fit[1]),
        "small_bytes_per_history_entry": float(fit[2]),
        "small_bytes_per_history_version": float(fit[3]),
        "small_history_entries": f"{int(readings[:, 1].min())}-{int(readings[:, 1].max())}",
        "small_traced_spread": float(np.abs(design @ fit - readings[:, 3]).max()),
        "small_rss_bytes_per_push": (rss[1] - rss[0]) / (args.blocks * args.pushes),
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
                "small fixed-shape config push: bytes the main process keeps per push after warm-up "
                "(tracemalloc, fitted; a block kept per push would be >= 16 B)",
                row["small_traced_bytes_per_push"],
                1,
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
            f"small pushes: {args.blocks} blocks of {args.pushes} after {args.warmup}; the readings move by a few "
            "hundred bytes either way (free lists, caches, the history's pruning cycle), so a trend under 1 B per "
            "push (one 16-byte block kept per 16 pushes) is what this resolves",
        ],
    )
    return report.write(args.out)


COLUMNS = [
    ("workers", "workers"),
    ("small_traced_bytes_per_push", "small push: bytes kept per push (tracemalloc, fitted)"),
    ("small_bytes_per_history_entry", "bytes per config history entry (fitted)"),
    ("small_bytes_per_history_version", "bytes per version the history holds (fitted)"),
    ("small_history_entries", "config history entries, all envs (min-max over the readings)"),
    ("small_traced_spread", "readings off the fit, at most (B)"),
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
