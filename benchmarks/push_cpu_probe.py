"""Where a small idle push spends its time: wall clock, and the CPU of every process involved.

An idle ``MultiAsyncCollector`` of DriftEnv workers (``apply_at="step"``, spawn by default)
and gymnasium's ``AsyncVectorEnv`` of the same env (fork, gymnasium's default on Linux) with
as many workers. ``--pushes`` pushes of one config value with ``wait="applied"``, then as many
``AsyncVectorEnv.call("set_difficulty", x)``. Per path it prints the mean wall time and the
CPU time per call of the main process and of each worker process (read from ``/proc`` in
clock ticks, so use a few thousand calls). With ``--profile`` it also profiles the sender's
side of 300 more pushes.

    python benchmarks/push_cpu_probe.py [--workers 4] [--pushes 3000] [--start-method spawn] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing as mp
import os
import pstats
import time
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
from torchrl.collectors import MultiAsyncCollector

from envsync import EnvStateSender
from envsync.envs import DriftEnv, make_drift_env


def _ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _measure(call: Callable[[int], Any], workers: Sequence[int], pushes: int) -> str:
    """Mean wall time and CPU per call of this process and of each worker."""
    pids = [os.getpid(), *workers]
    before = [_ticks(p) for p in pids]
    start = time.perf_counter()
    for i in range(pushes):
        call(i)
    wall = time.perf_counter() - start
    spent = [(_ticks(p) - b) / os.sysconf("SC_CLK_TCK") / pushes * 1e6 for p, b in zip(pids, before, strict=True)]
    each = ", ".join(f"{us:.0f}" for us in spent[1:])
    return f"{wall / pushes * 1e6:.0f} µs wall; CPU per call: main {spent[0]:.0f} µs, workers {each} µs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--pushes", type=int, default=3000)
    parser.add_argument("--start-method", default="spawn", choices=["fork", "spawn"], help="of the collector")
    parser.add_argument("--profile", action="store_true", help="profile 300 more pushes")
    args = parser.parse_args()
    vec = gym.vector.AsyncVectorEnv([DriftEnv] * args.workers, context="fork")
    vec.reset(seed=0)
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
        time.sleep(2)  # every worker bound and idle

        def push(i: int) -> None:
            sender.push(config={"difficulty": 0.1 * (i % 10)}, wait="applied")

        def call(i: int) -> None:
            vec.call("set_difficulty", 0.1 * (i % 10))

        print(f"{args.workers} idle workers, {args.pushes} calls each")
        print(f"envsync push ({args.start_method}):", _measure(push, [p.pid for p in collector.procs], args.pushes))
        print("gymnasium call (fork):", _measure(call, [p.pid for p in vec.processes], args.pushes))
        if args.profile:
            profile = cProfile.Profile()
            profile.enable()
            for i in range(300):
                push(i)
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(18)
    finally:
        collector.shutdown()
        sender.close()
        vec.close()


if __name__ == "__main__":
    main()
