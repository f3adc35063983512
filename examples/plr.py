"""Prioritized level replay (PLR) over the sub-envs of a ParallelEnv, with ``curriculum.PLR``.

A ``Collector`` drives one ``ParallelEnv`` of envsync's ``DriftEnv`` (observation ``[x,
difficulty]``). The levels are eight difficulties. ``envsync.curriculum.PLR`` follows the
``level_replay`` sampler of Jiang et al. (2021): at each sub-env's reset it draws that
sub-env's next level, a new one until every level has been played (``rho=1``), then, with a
probability that grows with the share of levels seen, a replay by rank of score mixed with
staleness. The score of a level is the negative return of its latest episode (the default:
no value function needed), so the levels the agent copes with worst come back most often.

A fixed proportional controller stands in for the agent. The script prints each level's
score and how many episodes ran on it, plots the scores, and checks that every frame's
observation shows the difficulty of the config its tags name.

Needs: envsync alone. The plot needs matplotlib (`pip install "envsync[bench]"`); without it
the run goes on and says so instead of drawing.

    python examples/plr.py            # 4 sub-envs, 60 batches
    python examples/plr.py --smoke    # 3 sub-envs, 10 batches
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter
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
LEVELS = (0.0, 0.4, 0.8, 1.2, 1.6, 2.0, 2.4, 2.8)


@dataclass
class Args:
    """Arguments of the example."""

    envs: int = 4
    batches: int = 60
    frames_per_batch: int = 400
    temperature: float = 0.3
    staleness_coef: float = 0.1
    seed: int = 0
    out: Path = DEFAULT_OUT

    @classmethod
    def smoke(cls) -> Args:
        """A tiny budget for CI."""
        return cls(envs=3, batches=10, frames_per_batch=300)


def controller() -> TensorDictModule:
    """The stand-in agent: push against the offset, ``action = clip(-5 x, -1, 1)``."""
    return TensorDictModule(
        lambda obs: (-5.0 * obs[..., :1]).clamp(-1.0, 1.0), in_keys=["observation"], out_keys=["action"]
    )


def untruthful(sender: EnvStateSender, batch: TensorDictBase) -> bool:
    """Whether some frame does not show the difficulty of the config its tags name."""
    envs, versions = batch["env_index"].flatten().tolist(), batch["next", "env_version"].flatten().tolist()
    pairs = list(zip(envs, versions, strict=True))
    named = {pair: sender.config_at(*pair)["difficulty"].item() for pair in set(pairs)}
    expected = torch.tensor([named[pair] for pair in pairs])
    return not torch.allclose(batch["next", "observation"][..., 1].flatten(), expected)


def run(args: Args) -> tuple[curriculum.PLR, Counter[float], list[str]]:
    """Collect under PLR; return it, the episodes run per level and any failures."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="reset")
    collector = Collector(
        sender.env_fn(lambda: ParallelEnv(args.envs, make_drift_env)),
        controller(),
        frames_per_batch=args.frames_per_batch,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
        auto_register_policy_transforms=False,  # the controller needs no InitTracker
    )
    plr = curriculum.PLR(
        sender,
        [{"difficulty": d} for d in LEVELS],
        temperature=args.temperature,
        staleness_coef=args.staleness_coef,
        seed=args.seed,
    )
    played: Counter[float] = Counter()
    failures = []
    try:
        for index, batch in enumerate(collector):
            if untruthful(sender, batch):
                failures.append(f"batch {index}: a frame names a difficulty its observation does not show")
            for episode in plr.observe(batch):
                if episode.version > 0:  # version 0 is the template, before PLR's first draw
                    played[round(episode.config["difficulty"].item(), 3)] += 1
            if index + 1 == args.batches:
                break
    finally:
        collector.shutdown()
        sender.close()
    return plr, played, failures


def report(plr: curriculum.PLR, played: Counter[float]) -> str:
    lines = ["difficulty  score    episodes", "----------  -------  --------"]
    for level, difficulty in enumerate(LEVELS):
        score = f"{plr.scores[level].item():7.2f}" if plr.seen[level] else "    n/a"
        lines.append(f"{difficulty:>10.1f}  {score}  {played[round(difficulty, 3)]:>8}")
    lines += ["", f"draws: {plr.draws}"]
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
    """Run PLR; exit non-zero if a frame's tags and its observation disagree, or if no level
    was ever scored."""
    args = parse_args(argv)
    plr, played, failures = run(args)
    print(report(plr, played))
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "levels": list(LEVELS),
        "scores": plr.scores.tolist(),
        "seen": plr.seen.tolist(),
        "draws": plr.draws,
        "played": {str(k): v for k, v in sorted(played.items())},
        "failures": failures,
    }
    (args.out / "plr.json").write_text(json.dumps(result, indent=2))
    if not curriculum.plot(plr, args.out / "plr.png", title="PLR: score per level (difficulty index)"):
        print('no plot: matplotlib is missing; pip install "envsync[bench]"')
    if not any(result["seen"]):
        failures.append("no level was scored")
    if failures:
        sys.exit("FAILED:\n" + "\n".join(failures))
    print(f"every frame showed the config its (env_index, env_version) names; plot and JSON in {args.out}")


if __name__ == "__main__":
    main()
