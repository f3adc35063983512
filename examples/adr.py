"""Automatic domain randomisation (ADR) over the sub-envs of a ParallelEnv.

A ``Collector`` drives one ``ParallelEnv`` of envsync's ``DriftEnv`` (observation ``[x,
difficulty]``). ADR keeps a range ``[low, high]`` for the difficulty. Every round it samples
one config per sub-env and pushes them as one version, with one row per env
(``sender.push(config={"difficulty": rows})``): a few sub-envs are pinned to a boundary of
the range, the others draw uniformly inside it. ``apply_at="reset"`` switches each sub-env at
its *own* next reset, so no episode mixes two configs and no sub-env waits for another.

Each finished episode is attributed through its frames' tags alone: ``env_index`` names the
sub-env and ``("next", "env_version")`` the version, and ``(env, version)`` names the exact
config that produced it. Episodes played at a boundary fill that boundary's buffer; when a
buffer is full, ADR widens the range where the agent succeeds at the boundary (mean return
at least ``success``) and narrows it where it fails (below ``failure``). A fixed
proportional controller stands in for the agent, so the range settles where the controller
stops coping with the drift. The script plots the range over the rounds, and checks that
every frame's observation shows the difficulty of the config its tags name.

    python examples/adr.py            # 4 sub-envs, 30 rounds
    python examples/adr.py --smoke    # 3 sub-envs, 4 rounds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule
from torchrl.collectors import Collector
from torchrl.envs import ParallelEnv, RewardSum, TransformedEnv

from envsync import EnvStateSender
from envsync.envs import make_drift_env

DEFAULT_OUT = Path(__file__).resolve().parent / "out"


@dataclass
class Args:
    """Arguments of the example."""

    envs: int = 4
    rounds: int = 30
    batches_per_round: int = 3
    frames_per_batch: int = 400
    boundary_envs: int = 2
    buffer: int = 3
    success: float = 42.0
    failure: float = 30.0
    step: float = 0.25
    seed: int = 0
    out: Path = DEFAULT_OUT

    @classmethod
    def smoke(cls) -> Args:
        """A tiny budget for CI."""
        return cls(envs=3, rounds=4, batches_per_round=2, frames_per_batch=300, boundary_envs=2, buffer=1)


def make_sub_env() -> TransformedEnv:
    """One sub-env: ``DriftEnv`` with its episode return summed up."""
    return TransformedEnv(make_drift_env(), RewardSum())


def controller() -> TensorDictModule:
    """The stand-in agent: push against the offset, ``action = clip(-5 x, -1, 1)``."""
    return TensorDictModule(
        lambda obs: (-5.0 * obs[..., :1]).clamp(-1.0, 1.0), in_keys=["observation"], out_keys=["action"]
    )


@dataclass
class Range:
    """ADR's range of the difficulty, and its performance buffers at each boundary."""

    low: float = 0.0
    high: float = 0.25
    buffers: dict[str, list[float]] = field(default_factory=lambda: {"low": [], "high": []})


class ADR:
    """Samples per-env configs, attributes episodes, and moves the range."""

    def __init__(self, args: Args, sender: EnvStateSender) -> None:
        self.args = args
        self.sender = sender
        self.range = Range()
        self.rng = random.Random(args.seed)
        self.config: dict[tuple[int, int], float] = {(e, 0): 0.0 for e in range(args.envs)}
        self.boundary: dict[tuple[int, int], str] = {}
        self.history: list[dict[str, float]] = []
        self.episodes = {"boundary": 0, "inside": 0, "template": 0}
        self.failures: list[str] = []

    def resample(self) -> int:
        """Push one version: ``boundary_envs`` sub-envs at a boundary, the others inside."""
        r = self.range
        pinned = self.rng.sample(range(self.args.envs), self.args.boundary_envs)
        rows, sides = [], {}
        for env in range(self.args.envs):
            if env in pinned:
                side = self.rng.choice(["low", "high"]) if r.low > 0 else "high"
                sides[env] = side
                rows.append(r.low if side == "low" else r.high)
            else:
                rows.append(self.rng.uniform(r.low, r.high))
        config = TensorDict(difficulty=torch.tensor(rows), batch_size=[self.args.envs])
        version = self.sender.push(config=config)
        for env, value in enumerate(rows):
            self.config[env, version] = float(torch.tensor(value, dtype=torch.float32))
            if env in sides:
                self.boundary[env, version] = sides[env]
        self.history.append({"version": version, "low": r.low, "high": r.high})
        return version

    def observe(self, index: int, batch: TensorDictBase) -> None:
        """Check the tags; credit each finished episode to its (env, version)."""
        self._check_truthful(index, batch)
        done = batch["next", "done"].squeeze(-1)
        envs = batch["env_index"][done].tolist()
        versions = batch["next", "env_version"][done].tolist()
        returns = batch["next", "episode_reward"].squeeze(-1)[done].tolist()
        for env, version, episode_return in zip(envs, versions, returns, strict=True):
            side = self.boundary.get((env, version))
            if version == 0:
                self.episodes["template"] += 1
            elif side is None:
                self.episodes["inside"] += 1
            else:
                self.episodes["boundary"] += 1
                self.range.buffers[side].append(episode_return)
        self._update()

    def _update(self) -> None:
        r, a = self.range, self.args
        for side, buffer in r.buffers.items():
            if len(buffer) < a.buffer:
                continue
            mean = sum(buffer) / len(buffer)
            widen = mean >= a.success
            if side == "high" and (widen or mean < a.failure):
                r.high = max(r.low, r.high + (a.step if widen else -a.step))
            if side == "low" and (widen or mean < a.failure):
                r.low = min(r.high, max(0.0, r.low - a.step if widen else r.low + a.step))
            buffer.clear()

    def _check_truthful(self, index: int, batch: TensorDictBase) -> None:
        for tag, obs in (("env_version", "observation"), (("next", "env_version"), ("next", "observation"))):
            pairs = zip(batch["env_index"].flatten().tolist(), batch[tag].flatten().tolist(), strict=True)
            expected = torch.tensor([self.config[pair] for pair in pairs])
            if not torch.allclose(batch[obs][..., 1].flatten(), expected):
                self.failures.append(f"batch {index}: {tag} names a config its observation does not show")


def run(args: Args) -> ADR:
    """Collect ``rounds`` rounds over one ParallelEnv; return the ADR state."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="reset")
    collector = Collector(
        sender.env_fn(lambda: ParallelEnv(args.envs, make_sub_env)),
        controller(),
        frames_per_batch=args.frames_per_batch,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
        auto_register_policy_transforms=False,  # the controller needs no InitTracker
    )
    adr = ADR(args, sender)
    try:
        batches = iter(collector)
        for _ in range(args.rounds):
            adr.resample()
            for _ in range(args.batches_per_round):
                adr.observe(len(adr.history), next(batches))
    finally:
        collector.shutdown()
        sender.close()
    return adr


def plot(adr: ADR, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = list(range(len(adr.history)))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.fill_between(rounds, [h["low"] for h in adr.history], [h["high"] for h in adr.history], alpha=0.3)
    ax.plot(rounds, [h["high"] for h in adr.history], label="high")
    ax.plot(rounds, [h["low"] for h in adr.history], label="low")
    ax.set_xlabel("round")
    ax.set_ylabel("difficulty range")
    ax.set_title("ADR over the sub-envs of a ParallelEnv")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def report(adr: ADR) -> str:
    lines = ["round  version  low    high", "-----  -------  -----  -----"]
    lines += [f"{i:>5}  {h['version']:>7}  {h['low']:5.2f}  {h['high']:5.2f}" for i, h in enumerate(adr.history)]
    e = adr.episodes
    lines += [
        "",
        f"episodes credited to a boundary: {e['boundary']}; inside the range: {e['inside']}; "
        f"under the template (version 0): {e['template']}",
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
    """Run ADR; exit non-zero if a frame's tags and its observation disagree, or if no
    episode was credited to a boundary (the range could not move)."""
    args = parse_args(argv)
    adr = run(args)
    print(report(adr))
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"history": adr.history, "episodes": adr.episodes, "failures": adr.failures}
    (args.out / "adr.json").write_text(json.dumps(result, indent=2))
    plot(adr, args.out / "adr.png")
    if not adr.episodes["boundary"]:
        adr.failures.append("no episode was credited to a boundary")
    if adr.failures:
        sys.exit("FAILED:\n" + "\n".join(adr.failures))
    print(f"every frame showed the config its (env_index, env_version) names; plot and JSON in {args.out}")


if __name__ == "__main__":
    main()
