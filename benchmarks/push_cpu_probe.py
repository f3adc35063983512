"""Where a small idle push spends its time: wall clock and the main process's CPU per push.

An idle ``MultiAsyncCollector`` of 4 fork-built DriftEnv workers (``apply_at="step"``), 300
pushes of one config value with ``wait="applied"``; prints the medians, and with
``--profile`` a cProfile of 300 more pushes (the sender's side only).

    python benchmarks/push_cpu_probe.py [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing as mp
import pstats
import statistics
import time

from torchrl.collectors import MultiAsyncCollector

from envsync import EnvStateSender
from envsync.envs import make_drift_env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", action="store_true", help="profile 300 more pushes")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--start-method", default="fork", choices=["fork", "spawn"])
    args = parser.parse_args()
    mp.set_start_method(args.start_method, force=True)
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = MultiAsyncCollector(
        [sender.env_fn(make_drift_env)] * args.workers,
        None,
        frames_per_batch=200,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
    )
    try:
        time.sleep(3)  # every worker bound and idle
        wall, cpu = [], []
        for i in range(300):
            start, start_cpu = time.perf_counter(), time.process_time()
            sender.push(config={"difficulty": float(i % 5)}, wait="applied")
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        print(
            f"push to {args.workers} idle workers: {statistics.median(wall) * 1e6:.0f} µs wall, "
            f"{statistics.median(cpu) * 1e6:.0f} µs of this process's CPU (medians of 300)"
        )
        if args.profile:
            profile = cProfile.Profile()
            profile.enable()
            for i in range(300):
                sender.push(config={"difficulty": float(i % 5)}, wait="applied")
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(18)
    finally:
        collector.shutdown()
        sender.close()


if __name__ == "__main__":
    main()
