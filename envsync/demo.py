"""The main demo: a short curriculum on a MultiAsyncCollector, without a restart.

Run with ``envsync demo`` (or ``python -m envsync demo``). Four workers collect
:class:`~envsync.envs.DriftEnv`; every few batches the difficulty rises and envsync pushes it
into the running workers. It prints, per switch, the push->applied latency, the frames
collected per version, and, for comparison, the time of one shutdown + recreate of the same
collector.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from envsync import EnvStateSender
from envsync.envs import make_drift_env, start_method


@dataclass
class DemoArgs:
    """Arguments of the demo."""

    workers: int = 4
    switches: int = 8
    batches_per_switch: int = 4
    frames_per_batch: int = 200
    start_method: str = "spawn"  # of the workers: torchrl's default; "fork" starts them faster


def _build(sender: EnvStateSender, args: DemoArgs) -> Any:
    from torchrl.collectors import MultiAsyncCollector

    with start_method(args.start_method):
        return MultiAsyncCollector(
            [sender.env_fn(make_drift_env)] * args.workers,
            None,
            frames_per_batch=args.frames_per_batch,
            total_frames=-1,
            weight_sync_schemes=sender.schemes(),
        )


def run(args: DemoArgs) -> dict[str, Any]:
    """Run the curriculum; return latencies (s), frames per version and the restart time (s)."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = _build(sender, args)
    latencies: list[float] = []
    frames: Counter[int] = Counter()
    total = (args.switches + 1) * args.batches_per_switch
    try:
        with tqdm(total=total, desc="collecting", unit="batch") as bar:
            for i, batch in enumerate(collector):
                frames.update(batch["next", "env_version"].reshape(-1).tolist())
                bar.update()
                if i + 1 == total:
                    break
                if (i + 1) % args.batches_per_switch == 0:
                    start = time.perf_counter()
                    difficulty = 0.1 * (len(latencies) + 1)
                    version = sender.push(config={"difficulty": difficulty}, wait="applied")
                    latencies.append(time.perf_counter() - start)
                    bar.set_postfix(version=version)
        start = time.perf_counter()
        collector.shutdown()
        collector = _build(sender, args)
        next(iter(collector))
        restart = time.perf_counter() - start
    finally:
        collector.shutdown()
        sender.close()
    return {"latencies": latencies, "frames": dict(sorted(frames.items())), "restart": restart}


def report(result: dict[str, Any]) -> str:
    """Format the demo's result as a plain-text table."""
    lines = ["switch  version  push->applied", "------  -------  -------------"]
    for i, latency in enumerate(result["latencies"], start=1):
        lines.append(f"{i:>6}  {i:>7}  {latency * 1e3:>10.2f} ms")
    lines += ["", "version  difficulty  frames", "-------  ----------  ------"]
    for version, count in result["frames"].items():
        lines.append(f"{version:>7}  {0.1 * version:>10.1f}  {count:>6}")
    worst = max(result["latencies"], default=float("nan"))
    lines += [
        "",
        f"one shutdown + recreate + first batch of the same collector: {result['restart']:.2f} s",
        f"slowest envsync switch: {worst * 1e3:.2f} ms ({result['restart'] / worst:,.0f}x faster)",
    ]
    return "\n".join(lines)


def main(args: DemoArgs | None = None) -> None:
    """Run the demo and print its table."""
    print(report(run(args or DemoArgs())))
