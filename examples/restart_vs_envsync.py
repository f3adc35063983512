"""The same curriculum loop done two ways: restart the collector, or push with envsync.

The loop: collect ``batches_per_stage`` batches of ``DriftEnv`` at one difficulty, raise the
difficulty, repeat for ``stages`` stages.

* **restart**: plain torchrl. Each stage shuts the ``MultiAsyncCollector`` down and builds a
  new one whose env factories carry the new difficulty.
* **envsync**: one collector for the whole loop; each stage is
  ``sender.push(config={"difficulty": d}, wait="applied")``.

Both are timed end to end, and the switch itself: from the last batch of a stage to the first
batch of the next (the restart way), or push->applied (envsync). Both ways must produce only
frames of the stage's difficulty once the stage has begun (envsync: frames tagged with the
stage's version; a ``MultiAsyncCollector`` may still deliver batches collected before the
push, truthfully tagged with the older version, and those are counted apart).

Needs: envsync alone.

    python examples/restart_vs_envsync.py                         # 4 workers, spawn
    python examples/restart_vs_envsync.py --start-method fork     # restarts are cheaper with fork
    python examples/restart_vs_envsync.py --smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from tensordict import TensorDictBase
from torchrl.collectors import MultiAsyncCollector

from envsync import EnvStateSender
from envsync.envs import make_drift_env, start_method

DEFAULT_OUT = Path(__file__).resolve().parent / "out"


@dataclass
class Args:
    """Arguments of the example."""

    workers: int = 4
    stages: int = 6
    batches_per_stage: int = 4
    frames_per_batch: int = 200
    start_method: str = "spawn"
    out: Path = DEFAULT_OUT

    @classmethod
    def smoke(cls) -> Args:
        """A tiny budget for CI."""
        return cls(workers=2, stages=3, batches_per_stage=2, frames_per_batch=50, start_method="fork")


def difficulty(stage: int) -> float:
    return 0.2 * stage


@dataclass
class Timing:
    """What one way of running the loop cost."""

    total: float = 0.0
    switches: list[float] = field(default_factory=list)
    frames: int = 0
    stale_frames: int = 0
    failures: list[str] = field(default_factory=list)

    def check(self, batch: TensorDictBase, stage: int, way: str) -> None:
        """Every frame shows the stage's difficulty (its observation's second entry)."""
        self.frames += batch.batch_size.numel()
        seen = batch["next", "observation"][..., 1]
        if not bool((seen - difficulty(stage)).abs().max() < 1e-6):
            self.failures.append(f"{way}, stage {stage}: frames show difficulties {sorted(set(seen.tolist()))}")


def with_restarts(args: Args) -> Timing:
    """Plain torchrl: a new collector per stage."""
    timing = Timing()
    start = time.perf_counter()
    switch_start: float | None = None
    for stage in range(args.stages):
        collector = MultiAsyncCollector(
            [partial(make_drift_env, difficulty=difficulty(stage))] * args.workers,
            None,
            frames_per_batch=args.frames_per_batch,
            total_frames=-1,
        )
        try:
            for i, batch in enumerate(collector):
                if i == 0 and switch_start is not None:
                    timing.switches.append(time.perf_counter() - switch_start)
                timing.check(batch, stage, "restart")
                if i + 1 == args.batches_per_stage:
                    break
            switch_start = time.perf_counter()
        finally:
            collector.shutdown()
    timing.total = time.perf_counter() - start
    return timing


def with_envsync(args: Args) -> Timing:
    """envsync: one collector, one push per stage."""
    timing = Timing()
    start = time.perf_counter()
    sender = EnvStateSender(config={"difficulty": difficulty(0)}, apply="set_difficulty", apply_at="step")
    collector = MultiAsyncCollector(
        [sender.env_fn(make_drift_env)] * args.workers,
        None,
        frames_per_batch=args.frames_per_batch,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
    )
    try:
        batches = iter(collector)
        version = 0
        for stage in range(args.stages):
            if stage > 0:
                pushed = time.perf_counter()
                version = sender.push(config={"difficulty": difficulty(stage)}, wait="applied")
                timing.switches.append(time.perf_counter() - pushed)
            collected = 0
            while collected < args.batches_per_stage:
                batch = next(batches)
                is_fresh = batch["next", "env_version"].reshape(-1) == version
                fresh = batch[is_fresh]
                # count with the mask: TensorDict.numel() reports 1, not 0, for an empty batch
                timing.stale_frames += int((~is_fresh).sum())
                if bool(is_fresh.any()):
                    timing.check(fresh, stage, "envsync")
                    collected += 1
    finally:
        collector.shutdown()
        sender.close()
    timing.total = time.perf_counter() - start
    return timing


def report(args: Args, restart: Timing, envsync: Timing) -> str:
    def row(way: str, timing: Timing) -> str:
        median = statistics.median(timing.switches) * 1e3 if timing.switches else float("nan")
        worst = max(timing.switches, default=float("nan")) * 1e3
        return (
            f"{way:<7}  {timing.total:>9.2f}  {median:>18.2f}  {worst:>17.2f}"
            f"  {timing.frames:>6}  {timing.stale_frames:>5}"
        )

    speedup = statistics.median(restart.switches) / statistics.median(envsync.switches)
    return "\n".join(
        [
            f"{args.workers} workers, start method {args.start_method!r}, {args.stages} stages "
            f"x {args.batches_per_stage} batches of {args.frames_per_batch} frames",
            "",
            "way      total (s)  median switch (ms)  worst switch (ms)  frames  stale",
            "-------  ---------  ------------------  -----------------  ------  -----",
            row("restart", restart),
            row("envsync", envsync),
            "",
            f"a switch is {speedup:,.0f}x faster with envsync "
            "(restart: last batch -> first batch of the new collector; envsync: push -> applied)",
            "stale: frames collected before the push and delivered after it, tagged with the older version",
        ]
    )


def parse_args(argv: Sequence[str] | None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny budget (CI)")
    for arg in dataclasses.fields(Args):
        parser.add_argument(f"--{arg.name.replace('_', '-')}", type=type(arg.default), default=None)
    given = vars(parser.parse_args(argv))
    args = Args.smoke() if given.pop("smoke") else Args()
    return dataclasses.replace(args, **{k: v for k, v in given.items() if v is not None})


def main(argv: Sequence[str] | None = None) -> None:
    """Run both ways; exit non-zero if either produced frames of the wrong difficulty."""
    args = parse_args(argv)
    with start_method(args.start_method):
        restart = with_restarts(args)
        envsync = with_envsync(args)
    print(report(args, restart, envsync))
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "args": {k: str(v) for k, v in dataclasses.asdict(args).items()},
        "restart": dataclasses.asdict(restart),
        "envsync": dataclasses.asdict(envsync),
    }
    (args.out / "restart_vs_envsync.json").write_text(json.dumps(result, indent=2))
    failures = restart.failures + envsync.failures
    if len(restart.switches) != args.stages - 1 or len(envsync.switches) != args.stages - 1:
        failures.append("a stage switch was not timed")
    if failures:
        sys.exit("FAILED:\n" + "\n".join(failures))


if __name__ == "__main__":
    main()
