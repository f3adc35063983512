"""A task-choosing bandit: UCB1 switches each worker's task from the returns it observes.

A teacher picks, for each worker on its own, which task variant to collect next: the arms are
difficulty levels of envsync's ``DriftEnv``. The teacher wants tasks at the edge of the
learner's ability: the score of a pull is ``1 - |mean return - target| / target``, highest
when the episodes' mean return sits at ``target`` (a random policy stands in for the learner,
so the best arm is the difficulty whose return is closest to the target).

Every switch is ``sender.push(config=..., workers=[w])``: a version of its own, for one
worker, so a frame's ``("next", "env_version")`` alone tells which pull (worker and arm) an
episode belongs to. The other workers go on undisturbed. Episodes that end under an older
version after a switch are counted as "late" and not credited to the new arm. Every frame's
observation carries the difficulty it ran under, and the script checks that it is always the
difficulty of the version the frame is tagged with.

    python examples/task_bandit.py            # 4 workers, 60 pulls
    python examples/task_bandit.py --smoke    # 2 workers, 8 pulls
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase
from torchrl.collectors import MultiAsyncCollector
from torchrl.envs import RewardSum, TransformedEnv

from envsync import EnvStateSender
from envsync.envs import make_drift_env

DEFAULT_OUT = Path(__file__).resolve().parent / "out"
ARMS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass
class Args:
    """Arguments of the example."""

    workers: int = 4
    pulls: int = 60
    episodes_per_pull: int = 4
    target_return: float = 25.0
    exploration: float = 0.3
    frames_per_batch: int = 200
    out: Path = DEFAULT_OUT

    @classmethod
    def smoke(cls) -> Args:
        """A tiny budget for CI."""
        return cls(workers=2, pulls=8, episodes_per_pull=2, frames_per_batch=100)


def make_task_env() -> TransformedEnv:
    """``DriftEnv`` (observation ``[x, difficulty]``) with the episode return summed up."""
    return TransformedEnv(make_drift_env(), RewardSum())


@dataclass
class Pull:
    """One worker running one arm under one version until enough episodes ended."""

    worker: int
    arm: int
    returns: list[float] = field(default_factory=list)


class UCB1:
    """UCB1 over the arms; untried arms first."""

    def __init__(self, arms: int, exploration: float) -> None:
        self.counts = [0] * arms
        self.sums = [0.0] * arms
        self.exploration = exploration
        self._next_untried = 0

    def select(self) -> int:
        if self._next_untried < len(self.counts):
            self._next_untried += 1
            return self._next_untried - 1
        total = sum(self.counts)
        bounds = [
            self.sums[a] / max(n, 1) + self.exploration * math.sqrt(math.log(max(total, 1)) / max(n, 1))
            for a, n in enumerate(self.counts)
        ]
        return max(range(len(bounds)), key=bounds.__getitem__)

    def update(self, arm: int, score: float) -> None:
        self.counts[arm] += 1
        self.sums[arm] += score


class Teacher:
    """Runs one pull per worker at a time and switches that worker when its pull ends."""

    def __init__(self, args: Args, sender: EnvStateSender) -> None:
        self.args = args
        self.sender = sender
        self.bandit = UCB1(len(ARMS), args.exploration)
        self.open: dict[int, Pull] = {}
        self.closed: dict[int, Pull] = {}
        self.difficulty_of = {0: 0.0}
        self.late = 0
        self.warm_up = 0
        self.failures: list[str] = []

    def start(self, worker: int) -> None:
        arm = self.bandit.select()
        version = self.sender.push(config={"difficulty": ARMS[arm]}, workers=[worker])
        self.difficulty_of[version] = ARMS[arm]
        self.open[version] = Pull(worker, arm)

    def score(self, returns: list[float]) -> float:
        mean = sum(returns) / len(returns)
        return max(0.0, 1.0 - abs(mean - self.args.target_return) / self.args.target_return)

    def observe(self, index: int, batch: TensorDictBase) -> None:
        self._check_truthful(index, batch)
        done = batch["next", "done"].reshape(-1)
        versions = batch["next", "env_version"].reshape(-1)[done].tolist()
        returns = batch["next", "episode_reward"].reshape(-1)[done].tolist()
        for version, episode_return in zip(versions, returns, strict=True):
            if version in self.open:
                self.open[version].returns.append(episode_return)
            elif version == 0:
                self.warm_up += 1
            else:
                self.late += 1
        for version, pull in list(self.open.items()):
            if len(pull.returns) >= self.args.episodes_per_pull:
                self.bandit.update(pull.arm, self.score(pull.returns))
                self.closed[version] = self.open.pop(version)
                if len(self.closed) + len(self.open) < self.args.pulls:
                    self.start(pull.worker)

    def _check_truthful(self, index: int, batch: TensorDictBase) -> None:
        for tag, obs in (("env_version",), ("observation",)), (("next", "env_version"), ("next", "observation")):
            versions = batch[tag].reshape(-1).tolist()
            expected = torch.tensor([self.difficulty_of[v] for v in versions])
            seen = batch[obs][..., 1].reshape(-1)
            if not torch.allclose(seen, expected):
                self.failures.append(f"batch {index}: {tag} names a difficulty its observation does not show")

    @property
    def finished(self) -> bool:
        return not self.open


def run(args: Args) -> Teacher:
    """Collect until every pull has ended; return the teacher with its statistics."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="reset")
    collector = MultiAsyncCollector(
        [sender.env_fn(make_task_env)] * args.workers,
        None,
        frames_per_batch=args.frames_per_batch,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
    )
    teacher = Teacher(args, sender)
    max_batches = 20 * args.pulls * args.episodes_per_pull
    try:
        for worker in range(min(args.workers, args.pulls)):
            teacher.start(worker)
        for i, batch in enumerate(collector):
            teacher.observe(i, batch)
            if teacher.finished:
                break
            if i == max_batches:
                teacher.failures.append(f"pulls still open after {max_batches} batches: {sorted(teacher.open)}")
                break
    finally:
        collector.shutdown()
        sender.close()
    return teacher


def summary(teacher: Teacher) -> dict[str, Any]:
    arms = []
    for arm, difficulty in enumerate(ARMS):
        returns = [r for pull in teacher.closed.values() if pull.arm == arm for r in pull.returns]
        count = teacher.bandit.counts[arm]
        arms.append(
            {
                "difficulty": difficulty,
                "pulls": count,
                "episodes": len(returns),
                "mean_return": sum(returns) / len(returns) if returns else None,
                "mean_score": teacher.bandit.sums[arm] / count if count else None,
            }
        )
    pulls = {
        version: {"worker": pull.worker, "difficulty": ARMS[pull.arm], "returns": pull.returns}
        for version, pull in teacher.closed.items()
    }
    return {"arms": arms, "pulls": pulls, "late_episodes": teacher.late, "warm_up_episodes": teacher.warm_up}


def report(result: dict[str, Any], target: float) -> str:
    lines = [
        f"target return {target:g}; score of a pull = 1 - |mean return - target| / target",
        "",
        "difficulty  pulls  episodes  mean return  mean score",
        "----------  -----  --------  -----------  ----------",
    ]
    for arm in result["arms"]:
        mean_return = "n/a" if arm["mean_return"] is None else f"{arm['mean_return']:.2f}"
        mean_score = "n/a" if arm["mean_score"] is None else f"{arm['mean_score']:.3f}"
        lines.append(
            f"{arm['difficulty']:>10.2f}  {arm['pulls']:>5}  {arm['episodes']:>8}  {mean_return:>11}  {mean_score:>10}"
        )
    per_worker: dict[int, list[str]] = {}
    for version, pull in sorted(result["pulls"].items()):
        per_worker.setdefault(pull["worker"], []).append(f"v{version}:{pull['difficulty']:g}")
    lines += ["", "tasks per worker (version:difficulty), in order:"]
    lines += [f"  worker {w}: {' '.join(tasks)}" for w, tasks in sorted(per_worker.items())]
    lines += [
        "",
        f"episodes under the template (version 0): {result['warm_up_episodes']}; "
        f"late episodes of an already switched pull: {result['late_episodes']}",
    ]
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
    teacher = run(args)
    result = summary(teacher)
    print(report(result, args.target_return))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "task_bandit.json").write_text(json.dumps(result, indent=2))
    if sum(teacher.bandit.counts) != len(teacher.closed) or len(teacher.closed) != args.pulls:
        teacher.failures.append(f"{len(teacher.closed)} pulls ended, {sum(teacher.bandit.counts)} counted")
    if teacher.failures:
        sys.exit("FAILED:\n" + "\n".join(teacher.failures))
    print(f"all {args.pulls} pulls ended; every frame showed the difficulty its tag names; JSON in {args.out}")


if __name__ == "__main__":
    main()
