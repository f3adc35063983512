"""Automatic domain randomisation (ADR) over the sub-envs of a ParallelEnv, with ``curriculum.ADR``.

A ``Collector`` drives one ``ParallelEnv`` of envsync's ``DriftEnv`` (observation ``[x,
difficulty]``). ``envsync.curriculum.ADR`` keeps a range ``[low, high]`` for the difficulty
and follows DeXtreme's rule: at each sub-env's reset it draws that sub-env's next config (a
share of them pinned to a boundary of the range, the others uniform inside it) and pushes it
as a row of its own; episodes played at a boundary fill that boundary's queue, and a full
queue widens the range where the agent succeeds (mean return above ``success``) and narrows
it where it fails (below ``failure``). ``apply_at="reset"`` switches each sub-env at its own
next reset, so no episode mixes two configs and no sub-env waits for another.

The loop is one call, ``adr.observe(batch)``: the ledger inside attributes every finished
episode to the exact config its ``(env_index, env_version)`` names. A fixed proportional
controller stands in for the agent, so the range settles where the controller stops coping
with the drift. The script plots the range over the frames, and checks that every frame's
observation shows the difficulty of the config its tags name.

Needs: envsync alone. The plot needs matplotlib (`pip install "envsync[bench]"`); without it
the run goes on and says so instead of drawing.

    python examples/adr.py            # 4 sub-envs, 90 batches
    python examples/adr.py --smoke    # 3 sub-envs, 8 batches
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule
from torchrl.collectors import Collector
from torchrl.envs import ParallelEnv

from envsync import EnvStateSender, curriculum
from envsync.envs import make_drift_env

DEFAULT_OUT = Path(__file__).resolve().parent / "out"


@dataclass
class Args:
    """Arguments of the example."""

    envs: int = 4
    batches: int = 90
    frames_per_batch: int = 400
    boundary_fraction: float = 0.5
    queue: int = 3
    success: float = 42.0
    failure: float = 30.0
    step: float = 0.25
    seed: int = 0
    out: Path = DEFAULT_OUT

    @classmethod
    def smoke(cls) -> Args:
        """A tiny budget for CI."""
        return cls(envs=3, batches=8, frames_per_batch=300, queue=1)


def controller() -> TensorDictModule:
    """The stand-in agent: push against the offset, ``action = clip(-5 x, -1, 1)``."""
    return TensorDictModule(
        lambda obs: (-5.0 * obs[..., :1]).clamp(-1.0, 1.0), in_keys=["observation"], out_keys=["action"]
    )


def untruthful(sender: EnvStateSender, batch: TensorDictBase) -> list[str]:
    """The tags of the batch whose frames do not show the config ``sender.config_at`` names."""
    wrong = []
    envs = batch["env_index"].flatten().tolist()
    for tag, obs in (("env_version", "observation"), (("next", "env_version"), ("next", "observation"))):
        pairs = list(zip(envs, batch[tag].flatten().tolist(), strict=True))
        named = {pair: sender.config_at(*pair)["difficulty"].item() for pair in set(pairs)}
        expected = torch.tensor([named[pair] for pair in pairs])
        if not torch.allclose(batch[obs][..., 1].flatten(), expected):
            wrong.append(str(tag))
    return wrong


def run(args: Args) -> tuple[curriculum.ADR, list[str]]:
    """Collect ``batches`` batches over one ParallelEnv under ADR; return it and any failures."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="reset")
    collector = Collector(
        sender.env_fn(lambda: ParallelEnv(args.envs, make_drift_env)),
        controller(),
        frames_per_batch=args.frames_per_batch,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
        auto_register_policy_transforms=False,  # the controller needs no InitTracker
    )
    adr = curriculum.ADR(
        sender,
        ranges={"difficulty": (0.0, 0.25)},
        bounds={"difficulty": (0.0, 5.0)},
        delta=args.step,
        boundary_fraction=args.boundary_fraction,
        queue=args.queue,
        thresholds=(args.failure, args.success),
        seed=args.seed,
    )
    failures = []
    try:
        for index, batch in enumerate(collector):
            wrong = untruthful(sender, batch)
            failures += [f"batch {index}: {tag} names a config its observation does not show" for tag in wrong]
            adr.observe(batch)
            if index + 1 == args.batches:
                break
    finally:
        collector.shutdown()
        sender.close()
    return adr, failures


def report(adr: curriculum.ADR) -> str:
    lines = ["frames   low    high   moved", "-------  -----  -----  ---------------"]
    for record in adr.history():
        low, high, moved = record["difficulty.low"], record["difficulty.high"], record.get("boundary", "(start)")
        lines.append(f"{record['frames']:>7}  {low:5.2f}  {high:5.2f}  {moved}")
    results = {f"{n}.{'low' if s == 0 else 'high'}": c for (n, s), c in adr.results.items()}
    lines += ["", f"results credited per boundary: {results}"]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny budget (CI)")
    for arg in dataclasses.fields(Args):
        parser.add_argument(f"--{arg.name.replace('_', '-')}", type=type(arg.default), default=None)
    given = vars(parser.parse_args(argv))
    args = Args.smoke() if given.pop("smoke") else Args()
    return dataclasses.replace(args, **{k: v for k, v in given.items() if v is not None})


def main(argv: Sequence[str] | None = None) -> None:
    """Run ADR; exit non-zero if a frame's tags and its observation disagree, or if no
    episode was credited to a boundary (the range could not move)."""
    args = parse_args(argv)
    adr, failures = run(args)
    print(report(adr))
    args.out.mkdir(parents=True, exist_ok=True)
    boundary = sum(adr.results.values())
    result: dict[str, Any] = {"history": adr.history(), "boundary_results": boundary, "failures": failures}
    (args.out / "adr.json").write_text(json.dumps(result, indent=2))
    if not curriculum.plot(adr, args.out / "adr.png", title="ADR over the sub-envs of a ParallelEnv"):
        print('no plot: matplotlib is missing; pip install "envsync[bench]"')
    if not boundary:
        failures.append("no episode was credited to a boundary")
    if failures:
        sys.exit("FAILED:\n" + "\n".join(failures))
    print(f"every frame showed the config its (env_index, env_version) names; plot and JSON in {args.out}")


if __name__ == "__main__":
    main()
