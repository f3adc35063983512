"""Run every benchmark, then print (and write) the issue's targets in one table.

python benchmarks/run_all.py [--quick] [--out DIR]     # or: envsync bench [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# bench_ray's local cluster on loopback (docs/ray.md): set before the benchmarks below import
# Ray (through torchrl), which reads it once, at its import
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import bench_batched  # noqa: E402
import bench_curriculum  # noqa: E402
import bench_hot_path  # noqa: E402
import bench_memory  # noqa: E402
import bench_payload  # noqa: E402
import bench_rebuild  # noqa: E402
import bench_switch_latency  # noqa: E402
import bench_sync_stats  # noqa: E402
import bench_throughput_switch  # noqa: E402
import bench_wait  # noqa: E402
import bench_workload  # noqa: E402
from bench_common import RESULTS, targets_table  # noqa: E402

BENCHMARKS: list[Any] = [
    bench_switch_latency,
    bench_payload,
    bench_memory,
    bench_hot_path,
    bench_throughput_switch,
    bench_workload,
    bench_sync_stats,
    bench_batched,
    bench_rebuild,
    bench_wait,
    bench_curriculum,  # its Syllabus half only where syllabus-rl is installed (the bench extra)
]
if shutil.which("callgrind_control") is not None:  # valgrind: instructions per frame, ~3.5 min (~1 min quick)
    import bench_hot_path_instructions

    BENCHMARKS.insert(BENCHMARKS.index(bench_hot_path) + 1, bench_hot_path_instructions)
if importlib.util.find_spec("ray") is not None:  # the ray extra: a local two-node cluster, ~30 s quick
    import bench_ray

    BENCHMARKS.append(bench_ray)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny budget for every benchmark")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: benchmarks/results[/quick])")
    args = parser.parse_args(argv)
    out = args.out or (RESULTS / "quick" if args.quick else RESULTS)
    passed = ["--out", str(out)] + (["--quick"] if args.quick else [])
    start = time.perf_counter()
    documents = [bench.main(passed) for bench in BENCHMARKS]
    targets = [t | {"benchmark": d["benchmark"]} for d in documents for t in d["targets"]]
    text = f"## Targets ({'quick' if args.quick else 'full'} run, {time.perf_counter() - start:.0f} s)\n\n"
    text += targets_table(targets) + "\n"
    (out / "targets.md").write_text(text)
    (out / "targets.json").write_text(json.dumps(targets, indent=2) + "\n")
    print("\n" + text)
    return documents


if __name__ == "__main__":
    main()
