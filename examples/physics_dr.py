"""Physics domain randomisation: ADR over HalfCheetah's masses and friction, trained with PPO.

Workers of a ``MultiSyncCollector`` run gymnasium's ``HalfCheetah-v5`` (MuJoCo) inside the
transforms of torchrl's own PPO MuJoCo set-up (``VecNorm``, ``ClipTransform``,
``RewardSum``, ``StepCounter``, ``DoubleToFloat``). ``envsync.apply.scales`` writes a mass
factor (every body's mass and inertia) and a friction factor (every geom) relative to the
model as built, in place, and ``mj_set_const`` recomputes MuJoCo's derived constants;
``envsync.curriculum.ADR`` widens each factor's range where the agent copes (DeXtreme's rule),
one row per env, at each env's reset. torchrl's PPO pieces (``ProbabilisticActor``,
``ValueOperator``, ``GAE``, ``ClipPPOLoss``) train between batches.

Attribution is checked from the simulator, not from labels: a gymnasium wrapper adds the
model's total mass and friction to every observation, and every finished episode's measured
physics must be its config's factors times the model as built.

    python examples/physics_dr.py            # 4 workers, 100k frames
    python examples/physics_dr.py --smoke    # 2 workers, a few batches
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDictBase
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torch import nn
from torchrl.collectors import MultiSyncCollector
from torchrl.envs import (
    ClipTransform,
    Compose,
    DoubleToFloat,
    GymWrapper,
    RewardSum,
    StepCounter,
    TransformedEnv,
    VecNorm,
)
from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE

import envsync
from envsync import EnvStateSender
from envsync.curriculum import ADR, Episode, Measure

DEFAULT_OUT = Path(__file__).resolve().parent / "out"


@dataclass
class Args:
    """Arguments of the example."""

    workers: int = 4
    total_frames: int = 100_000
    frames_per_batch: int = 2_000
    episode_steps: int = 250
    epochs: int = 4
    minibatch: int = 250
    lr: float = 3e-4
    gamma: float = 0.99
    queue: int = 8
    low_return: float = -100.0
    high_return: float = -20.0
    boundary_fraction: float = 0.4
    seed: int = 0
    out: Path = DEFAULT_OUT

    @classmethod
    def smoke(cls) -> Args:
        """A tiny budget for CI: short episodes, thresholds every return passes, and every env
        at a boundary (its 16 decisions widen every boundary)."""
        return cls(
            workers=2,
            total_frames=2_048,
            frames_per_batch=256,
            episode_steps=32,
            epochs=1,
            minibatch=128,
            queue=1,
            low_return=-1e9,
            high_return=-1e9,
            boundary_fraction=1.0,
        )


class PhysicsObservation(gym.Wrapper):
    """Adds the model's total mass and total sliding friction, read from the simulator when
    the observation is produced, to every observation."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        box = gym.spaces.Box(-np.inf, np.inf, (1,), np.float64)
        self.observation_space = gym.spaces.Dict({"observation": env.observation_space, "mass": box, "friction": box})

    def _with_physics(self, obs: np.ndarray) -> dict[str, np.ndarray]:
        model = self.unwrapped.model  # type: ignore[attr-defined]
        return {
            "observation": obs,
            "mass": model.body_mass.sum(keepdims=True),
            "friction": model.geom_friction[:, :1].sum(0),
        }

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        obs, info = self.env.reset(**kwargs)
        return self._with_physics(obs), info

    def step(self, action: Any) -> tuple[Any, ...]:
        obs, *rest = self.env.step(action)
        return (self._with_physics(obs), *rest)


def make_env(episode_steps: int) -> TransformedEnv:
    """HalfCheetah in the transforms of torchrl's ``sota-implementations/ppo/utils_mujoco.py``."""
    base = GymWrapper(PhysicsObservation(gym.make("HalfCheetah-v5", max_episode_steps=episode_steps)))
    return TransformedEnv(
        base,
        Compose(
            VecNorm(in_keys=["observation"], decay=0.99999, eps=1e-2),
            ClipTransform(in_keys=["observation"], low=-10, high=10),
            RewardSum(),
            StepCounter(),
            DoubleToFloat(in_keys=["observation"]),
        ),
    )


def make_agent(env: Any) -> tuple[ProbabilisticActor, ValueOperator]:
    """A tanh-Gaussian actor and a value network (torchrl's PPO MuJoCo shapes, smaller)."""
    observation, action = env.observation_spec["observation"].shape[-1], env.action_spec.shape[-1]
    actor = ProbabilisticActor(
        TensorDictModule(
            nn.Sequential(
                MLP(in_features=observation, out_features=2 * action, num_cells=[64, 64], activation_class=nn.Tanh),
                NormalParamExtractor(),
            ),
            in_keys=["observation"],
            out_keys=["loc", "scale"],
        ),
        spec=env.action_spec,
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
        distribution_kwargs={"low": env.action_spec.space.low, "high": env.action_spec.space.high},
        return_log_prob=True,
    )
    value = ValueOperator(
        MLP(in_features=observation, out_features=1, num_cells=[64, 64], activation_class=nn.Tanh),
        in_keys=["observation"],
    )
    return actor, value


def train_step(batch: TensorDictBase, loss: ClipPPOLoss, gae: GAE, optim: torch.optim.Optimizer, args: Args) -> None:
    with torch.no_grad():
        gae(batch)
    data = batch.reshape(-1)
    for _ in range(args.epochs):
        for index in torch.randperm(data.numel()).split(args.minibatch):
            losses = loss(data[index])
            total = losses["loss_objective"] + losses["loss_critic"] + losses["loss_entropy"]
            optim.zero_grad()
            total.backward()
            nn.utils.clip_grad_norm_(loss.parameters(), 1.0)
            optim.step()


@dataclass
class Log:
    """The ADR ranges over time, and what the physics check found."""

    ranges: list[dict[str, Any]] = field(default_factory=list)
    episodes_checked: int = 0
    physics_seen: list[list[float]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    held_mass: list[float] = field(default_factory=list)


def check_episode(episode: Episode, built: tuple[float, float], log: Log) -> None:
    """The episode's physics, read from the simulator, is its config's factors times the model as built."""
    want = (built[0] * episode.config["mass"].item(), built[1] * episode.config["friction"].item())
    got = (episode.measures["mass"], episode.measures["friction"])
    if not np.allclose(got, want, rtol=1e-6):
        log.failures.append(f"env {episode.env} version {episode.version}: physics {got}, config says {want}")
    log.episodes_checked += 1
    log.physics_seen.append([episode.config["mass"].item(), episode.config["friction"].item()])


def check_held(sender: EnvStateSender, built: tuple[float, float], log: Log) -> None:
    """What each env's simulator holds now, read back by its own worker (not the config
    pushed): its total mass is the mass factor of the version it runs times the model as built."""
    held = sender.read_attributes(["model.body_mass"])["model", "body_mass"].sum(-1)
    for env, version in enumerate(sender.env_versions()):
        want = built[0] * sender.config_at(env, version)["mass"].item()
        if not np.isclose(held[env].item(), want, rtol=1e-6):
            log.failures.append(f"env {env} holds a total mass of {held[env].item()}; version {version} says {want}")
    log.held_mass = held.tolist()


def train(args: Args) -> Log:
    torch.manual_seed(args.seed)
    factory = partial(make_env, args.episode_steps)
    model = gym.make("HalfCheetah-v5").unwrapped.model  # type: ignore[attr-defined]
    built = (float(model.body_mass.sum()), float(model.geom_friction[:, 0].sum()))
    physics = envsync.apply.scales(
        {"mass": ["model.body_mass", "model.body_inertia"], "friction": "model.geom_friction"},
        finish=envsync.apply.mj_set_const,
    )
    sender = EnvStateSender(config={"mass": 1.0, "friction": 1.0}, apply=physics)
    adr = ADR(
        sender,
        ranges={"mass": (1.0, 1.0), "friction": (1.0, 1.0)},
        bounds={"mass": (0.5, 2.0), "friction": (0.3, 2.0)},
        delta=0.1,
        boundary_fraction=args.boundary_fraction,
        queue=args.queue,
        thresholds=(args.low_return, args.high_return),
        seed=args.seed,
        measures={"mass": Measure(("next", "mass"), "mean"), "friction": Measure(("next", "friction"), "mean")},
    )
    actor, value = make_agent(factory())
    loss = ClipPPOLoss(actor, value, clip_epsilon=0.2, entropy_coeff=0.0)
    gae = GAE(gamma=args.gamma, lmbda=0.95, value_network=value, average_gae=True)
    optim = torch.optim.Adam(loss.parameters(), lr=args.lr)
    collector = MultiSyncCollector(
        [sender.env_fn(factory)] * args.workers,
        actor,
        frames_per_batch=args.frames_per_batch,
        total_frames=args.total_frames,
        weight_sync_schemes=sender.schemes(),
    )
    log = Log()
    try:
        for batch in collector:
            for episode in adr.observe(batch):
                check_episode(episode, built, log)
            train_step(batch, loss, gae, optim, args)
            collector.update_policy_weights_()
            log.ranges.append({"frames": adr.ledger.frames, **{n: list(r) for n, r in adr.range.items()}})
        check_held(sender, built, log)
    finally:
        collector.shutdown()
        sender.close()
    return log


def parse_args(argv: Sequence[str] | None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny budget (CI)")
    for arg in dataclasses.fields(Args):
        parser.add_argument(f"--{arg.name.replace('_', '-')}", type=type(arg.default), default=None)
    given = vars(parser.parse_args(argv))
    args = Args.smoke() if given.pop("smoke") else Args()
    return dataclasses.replace(args, **{k: v for k, v in given.items() if v is not None})


def main(argv: Sequence[str] | None = None) -> None:
    """Train; exit non-zero if an episode's physics is not the one its config names."""
    args = parse_args(argv)
    log = train(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "physics_dr.json").write_text(json.dumps(dataclasses.asdict(log), indent=2))
    last = log.ranges[-1] if log.ranges else {}
    print(
        f"{log.episodes_checked} episodes checked against the simulator's physics; "
        f"final ranges: mass {last.get('mass')}, friction {last.get('friction')}; "
        f"each env's total mass, read back: {[round(m, 3) for m in log.held_mass]}"
    )
    if log.episodes_checked == 0:
        log.failures.append("no episode finished")
    if log.failures:
        sys.exit("FAILED:\n" + "\n".join(log.failures))


if __name__ == "__main__":
    main()
