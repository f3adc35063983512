"""A large config: a terrain table pushed once, then a small index walked over it.

Each worker env is the drift task of ``envsync.envs`` with a *terrain*: a float32 table of
difficulties (4 MB by default, think a height map or a per-level randomisation table) and a
``row`` into it; the env's difficulty is ``table[row]``, and its observation carries the
difficulty, so every frame shows the config it ran. The script pushes a table to every
worker of a ``MultiSyncCollector``, then walks ``row`` over it one small push per batch,
pushes a second table half-way, and checks every frame against ``sender.config_at`` (the
table and row its tags name).

The table travels once: the sender writes a fleet-wide push once into shared memory for all
workers, and each worker copies a config name out only when it was written since it last
read it, so the small ``row`` pushes after a big table cost what a small push costs
(``docs/concepts.md``, "How a push travels"). The script prints both.

Needs: envsync alone.

    python examples/terrain_table.py            # 4 workers, a 4 MB table, 40 rows
    python examples/terrain_table.py --smoke    # 2 workers, a 256 KB table, a few seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchrl.collectors import MultiSyncCollector
from torchrl.envs import GymWrapper

from envsync import EnvStateSender
from envsync.envs import DriftEnv

DEFAULT_OUT = Path(__file__).resolve().parent / "out"


@dataclass
class Args:
    """Arguments of the example."""

    workers: int = 4
    table_len: int = 1 << 20  # float32 entries: 4 MB
    rows: int = 40  # row pushes (one batch each); a new table half-way
    frames_per_batch: int = 100
    seed: int = 0
    out: Path = DEFAULT_OUT

    @classmethod
    def smoke(cls) -> Args:
        """A tiny budget for CI."""
        return cls(workers=2, table_len=1 << 16, rows=6, frames_per_batch=40)


class TerrainDrift(DriftEnv):
    """The drift task whose difficulty is read from a terrain table at a row."""

    def set_terrain(self, table: np.ndarray, row: int) -> None:
        """The config method: keep the table (no copy), take its ``row``-th difficulty."""
        self.table = table
        self.set_difficulty(float(table[row]))


def make_env() -> GymWrapper:
    return GymWrapper(TerrainDrift())


def check(sender: EnvStateSender, batch: Any, cache: dict[tuple[int, int], float]) -> list[str]:
    """Every frame's difficulty is ``table[row]`` of the config its tags name."""
    failures = []
    shown = batch["next", "observation"][..., 1].reshape(-1)
    envs = batch["next", "env_index"].reshape(-1).tolist()
    versions = batch["next", "env_version"].reshape(-1).tolist()
    for i, (env, version) in enumerate(zip(envs, versions, strict=True)):
        if (env, version) not in cache:
            config = sender.config_at(env, version)
            cache[(env, version)] = float(config["table"][int(config["row"])])
        expected = cache[(env, version)]
        if abs(float(shown[i]) - expected) > 1e-6:
            failures.append(f"env {env}, version {version}: difficulty {float(shown[i])}, expected {expected}")
    return failures


def run(args: Args) -> tuple[dict[str, Any], list[str]]:
    rng = torch.Generator().manual_seed(args.seed)
    sender = EnvStateSender(
        config={"table": torch.zeros(args.table_len), "row": 0}, apply="set_terrain", apply_at="step"
    )
    collector = MultiSyncCollector(
        [sender.env_fn(make_env)] * args.workers,
        None,
        frames_per_batch=args.frames_per_batch,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
    )
    table_ms, row_ms, failures, frames = [], [], [], 0
    cache: dict[tuple[int, int], float] = {}
    try:
        batches = iter(collector)
        for step in range(args.rows):
            if step in (0, args.rows // 2):  # a new terrain
                table = torch.rand(args.table_len, generator=rng)
                start = time.perf_counter()
                sender.push(config={"table": table}, wait="applied")
                table_ms.append((time.perf_counter() - start) * 1e3)
            row = int(torch.randint(args.table_len, (), generator=rng))
            start = time.perf_counter()
            sender.push(config={"row": row}, wait="applied")
            row_ms.append((time.perf_counter() - start) * 1e3)
            batch = next(batches)
            frames += batch.numel()
            failures += check(sender, batch, cache)
    finally:
        collector.shutdown()
        sender.close()
    result = {
        "workers": args.workers,
        "table_mb": args.table_len * 4 / (1 << 20),
        "table_push_ms": table_ms,
        "row_push_ms_median": statistics.median(row_ms),
        "frames_checked": frames,
        "configs_checked": len(cache),
    }
    return result, failures


def parse_args(argv: Sequence[str] | None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny budget (CI)")
    for arg in dataclasses.fields(Args):
        parser.add_argument(f"--{arg.name.replace('_', '-')}", type=type(arg.default), default=None)
    given = vars(parser.parse_args(argv))
    args = Args.smoke() if given.pop("smoke") else Args()
    return dataclasses.replace(args, **{k: v for k, v in given.items() if v is not None})


def main(argv: Sequence[str] | None = None) -> None:
    """Run the walk; exit non-zero if a frame does not show the config its tags name."""
    args = parse_args(argv)
    result, failures = run(args)
    pushes = ", ".join(f"{ms:.1f}" for ms in result["table_push_ms"])
    print("| workers | table | table push->applied (ms) | row push->applied, median (ms) | frames checked |")
    print("|---|---|---|---|---|")
    print(
        f"| {result['workers']} | {result['table_mb']:.2f} MB | {pushes} | {result['row_push_ms_median']:.2f} "
        f"| {result['frames_checked']} |"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "terrain_table.json").write_text(json.dumps({**result, "failures": failures[:20]}, indent=2))
    if failures:
        sys.exit("FAILED:\n" + "\n".join(failures[:20]))
    print(f"every frame showed table[row] of the config its tags name; JSON in {args.out}")


if __name__ == "__main__":
    main()
