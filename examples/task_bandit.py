"""A task-choosing bandit: ``curriculum.Bandit`` (UCB1) picks each worker's task from its returns.

A teacher picks, for each worker on its own, which task variant to collect next: the arms are
difficulty levels of envsync's ``DriftEnv``. The teacher wants tasks at the edge of the
learner's ability: the reward of an episode is ``1 - |return - target| / target``, highest
when the return sits at ``target`` (a random policy stands in for the learner, so the best
arm is the difficulty whose return is closest to the target).

``curriculum.Bandit(per="worker")`` gives a worker its next arm as soon as it runs its
previous one, as a version of its own for that worker's env (``apply_at="reset"``: at the
env's next reset), so every whole episode under a pull is credited to its arm through the
frame's tags alone, and the other workers go on undisturbed. Every frame's observation
carries the difficulty it ran under, and the script checks that it is always the difficulty
of the config its tags name.

Needs: envsync alone. The plot needs matplotlib (`pip install "envsync[bench]"`); without it
the run goes on and says so instead of drawing.

    python examples/task_bandit.py            # 4 workers, 240 rewarded episodes
    python examples/task_bandit.py --smoke    # 2 workers, 16 rewarded episodes
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
from torchrl.collectors import MultiAsyncCollector

from envsync import EnvStateSender, curriculum
from envsync.envs import make_drift_env

DEFAULT_OUT = Path(__file__).resolve().parent / "out"
ARMS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass
class Args:
    """Arguments of the example."""

    workers: int = 4
    episodes: int = 240
    target_return: float = 25.0
    rule: str = "ucb1"
    frames_per_batch: int = 200
    out: Path = DEFAULT_OUT

    @classmethod
    def smoke(cls) -> Args:
        """A tiny budget for CI."""
        return cls(workers=2, episodes=16, frames_per_batch=100)


def untruthful(sender: EnvStateSender, batch: TensorDictBase) -> bool:
    """Whether some frame does not show the difficulty of the config its tags name."""
    pairs = list(
        zip(batch["env_index"].flatten().tolist(), batch["next", "env_version"].flatten().tolist(), strict=True)
    )
    named = {pair: sender.config_at(*pair)["difficulty"].item() for pair in set(pairs)}
    expected = torch.tensor([named[pair] for pair in pairs])
    return not torch.allclose(batch["next", "observation"][..., 1].flatten(), expected)


def run(args: Args) -> tuple[curriculum.Bandit, list[str]]:
    """Collect until ``episodes`` episodes rewarded an arm; return the bandit and any failures."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="reset")
    collector = MultiAsyncCollector(
        [sender.env_fn(make_drift_env)] * args.workers,
        None,
        frames_per_batch=args.frames_per_batch,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
    )
    target = args.target_return
    bandit = curriculum.Bandit(
        sender,
        [{"difficulty": d} for d in ARMS],
        rule=args.rule,
        per="worker",
        reward=lambda episode: 1.0 - abs(episode.episode_return - target) / target,
    )
    failures, max_batches = [], 40 * args.episodes
    try:
        for index, batch in enumerate(collector):
            if untruthful(sender, batch):
                failures.append(f"batch {index}: a frame names a difficulty its observation does not show")
            bandit.observe(batch)
            if int(bandit.counts.sum()) >= args.episodes:
                break
            if index == max_batches:
                failures.append(f"only {int(bandit.counts.sum())} episodes rewarded after {max_batches} batches")
                break
    finally:
        collector.shutdown()
        sender.close()
    return bandit, failures


def summary(bandit: curriculum.Bandit) -> dict[str, Any]:
    arms = []
    for arm, difficulty in enumerate(a["difficulty"] for a in bandit.arms):
        count = int(bandit.counts[arm])
        mean = bandit.sums[arm].item() / count if count else None
        arms.append({"difficulty": difficulty, "episodes": count, "mean_reward": mean})
    return {"arms": arms, "episodes": int(bandit.counts.sum()), "history": bandit.history()}


def report(result: dict[str, Any], target: float) -> str:
    lines = [
        f"target return {target:g}; reward of an episode = 1 - |return - target| / target",
        "",
        "difficulty  episodes  mean reward",
        "----------  --------  -----------",
    ]
    for arm in result["arms"]:
        mean = "n/a" if arm["mean_reward"] is None else f"{arm['mean_reward']:.3f}"
        lines.append(f"{arm['difficulty']:>10.2f}  {arm['episodes']:>8}  {mean:>11}")
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
    """Run the bandit; exit non-zero if a frame's tag and its observation disagree."""
    args = parse_args(argv)
    bandit, failures = run(args)
    result = summary(bandit)
    print(report(result, args.target_return))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "task_bandit.json").write_text(json.dumps({**result, "failures": failures}, indent=2))
    if not curriculum.plot(bandit, args.out / "task_bandit.png", title="episodes rewarded per arm"):
        print('no plot: matplotlib is missing; pip install "envsync[bench]"')
    if failures:
        sys.exit("FAILED:\n" + "\n".join(failures))
    print(
        f"{result['episodes']} episodes rewarded; every frame showed the difficulty its tags name; JSON in {args.out}"
    )


if __name__ == "__main__":
    main()
