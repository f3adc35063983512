"""ADR over the mass and the friction of the box of every world of a Genesis scene, trained with PPO.

One ``GenesisWorlds`` (envsync's torchrl env for a Genesis scene built with ``n_envs``, here on
Genesis's CPU backend) holds ``worlds`` worlds of a box on a plane, pushed by a horizontal force
(the action) and rewarded for staying near the origin; a ``Collector`` drives it. Each world is
an env of envsync's fleet. Its physics changes through Genesis's own per-world setters, the
kind of API Isaac Lab's ``*_index`` setters also have: ``apply="set_physics"`` calls
``set_mass(..., envs_idx=)`` and ``set_friction_ratio(..., envs_idx=)`` with the rows of the
worlds being changed, once per safe point. ``envsync.curriculum.ADR`` draws each world's next
mass and friction factors at that world's own reset (a share of worlds pinned to a boundary of
the range, DeXtreme's rule) and widens a range where the agent's return stays high. torchrl's
PPO pieces (``ProbabilisticActor``, ``ValueOperator``, ``GAE``, ``ClipPPOLoss``) train between
batches.

Attribution is checked from the simulator, not from labels: the env's observation carries,
computed by Genesis from the model that world holds, the translational diagonal of the box's
joint-space mass matrix (its mass) and its geom's friction ratio; every finished episode's
readings (their minimum and maximum over the episode) must be its config's factors times the
box as built. At the end each world's physics is read back by its own receiver
(``sender.read_attributes``) and compared with the config of the version it runs.

Needs the genesis venv (genesis-world):

    make .venv-genesis/.installed
    .venv-genesis/bin/python examples/genesis_adr.py            # 64 worlds, 100 batches
    .venv-genesis/bin/python examples/genesis_adr.py --smoke    # 16 worlds, 6 batches
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torch import nn
from torchrl.collectors import Collector
from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE

from envsync import EnvStateSender
from envsync.curriculum import ADR, Episode, Measure

DEFAULT_OUT = Path(__file__).resolve().parent / "out"
MISSING = (
    "Genesis is missing: this example runs in the genesis venv; build it with "
    "`make .venv-genesis/.installed`, then run `.venv-genesis/bin/python examples/genesis_adr.py`"
)
PHYSICS = ("mass", "inertia", "friction")  # the columns of the "physics" observation
FORCE = 20.0  # newtons: the largest force the policy pushes with


@dataclass
class Args:
    """Arguments of the example."""

    worlds: int = 64
    batches: int = 100
    steps_per_batch: int = 50
    episode_steps: int = 100
    epochs: int = 4
    minibatch: int = 512
    lr: float = 3e-4
    gamma: float = 0.99
    queue: int = 8
    low_return: float = -20.0  # the box rewards -(its distance to the origin) a step
    high_return: float = -5.0
    seed: int = 0
    out: Path = DEFAULT_OUT

    @classmethod
    def smoke(cls) -> Args:
        """A tiny budget for CI: short episodes, and thresholds every return passes (the ranges widen)."""
        return cls(
            worlds=16,
            batches=6,
            steps_per_batch=40,
            episode_steps=20,
            epochs=1,
            minibatch=160,
            queue=1,
            low_return=-1e9,
            high_return=-1e9,
        )


def make_env(args: Args) -> Any:
    """``args.worlds`` sliding boxes as one ``GenesisWorlds`` (Genesis's CPU backend)."""
    from envsync.integrations.torchrl.genesis import GenesisWorlds

    return GenesisWorlds.sliding_box(args.worlds, episode_steps=args.episode_steps)


def make_agent(env: Any) -> tuple[ProbabilisticActor, ValueOperator]:
    """A tanh-Gaussian actor (a force of up to ``FORCE`` newtons along each axis) and a value
    network on the box's planar position and velocity (``"observation"``)."""
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
        distribution_kwargs={"low": -FORCE, "high": FORCE},
        return_log_prob=True,
    )
    value = ValueOperator(
        MLP(in_features=observation, out_features=1, num_cells=[64, 64], activation_class=nn.Tanh),
        in_keys=["observation"],
    )
    return actor, value


def with_physics(batch: TensorDictBase) -> TensorDictBase:
    """The batch with each ``"physics"`` column as one number per frame (what ADR's measures read)."""
    for i, name in enumerate(PHYSICS):
        batch.set(("next", name), batch["next", "physics"][..., i])
    return batch


MEASURES = {f"{name}_{end}": Measure(("next", name), end) for name in PHYSICS for end in ("min", "max")}


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
    """The ADR ranges over time and what the physics checks found."""

    built: dict[str, float] = field(default_factory=dict)
    ranges: list[dict[str, Any]] = field(default_factory=list)
    mean_return: list[float | None] = field(default_factory=list)
    episodes_checked: int = 0
    worlds_read_back: int = 0
    boundary_results: int = 0
    pushes: int = 0
    failures: list[str] = field(default_factory=list)


def check_episode(episode: Episode, log: Log) -> None:
    """Over every step of the episode the simulator held its config's factors times the model as built."""
    factors = {"mass": episode.config["mass"].item(), "friction": episode.config["friction"].item()}
    for name, factor in (("mass", factors["mass"]), ("inertia", factors["mass"]), ("friction", factors["friction"])):
        want = log.built[name] * factor
        for end in ("min", "max"):
            got = episode.measures[f"{name}_{end}"]
            if abs(got - want) > 1e-5 * want:
                log.failures.append(f"world {episode.env} version {episode.version}: {name} {end} {got}, config {want}")
    log.episodes_checked += 1


def check_held(sender: EnvStateSender, log: Log) -> None:
    """Each world's physics, read back by its own receiver, is the config of the version it runs."""
    held = sender.read_attributes(["model.mass", "model.friction"])
    mass, friction = held["model", "mass"], held["model", "friction"]
    for world, version in enumerate(sender.env_versions()):
        config = sender.config_at(world, version)
        want = (log.built["mass"] * config["mass"].item(), log.built["friction"] * config["friction"].item())
        got = (mass[world].item(), friction[world].item())
        if any(abs(g - w) > 1e-5 * w for g, w in zip(got, want, strict=True)):
            log.failures.append(f"world {world} holds (mass, friction) {got}; its version {version} says {want}")
    log.worlds_read_back = len(sender.env_versions())


def train(args: Args) -> Log:
    torch.manual_seed(args.seed)
    probe = make_env(dataclasses.replace(args, worlds=1))
    physics = probe.reset()["physics"][0]  # the box as built, as Genesis computes it
    built = {name: physics[i].item() for i, name in enumerate(PHYSICS)}
    actor, value = make_agent(probe)
    sender = EnvStateSender(config={"mass": 1.0, "friction": 1.0}, apply="set_physics", apply_at="reset")
    adr = ADR(
        sender,
        ranges={"mass": (1.0, 1.0), "friction": (1.0, 1.0)},
        bounds={"mass": (0.5, 2.0), "friction": (0.3, 2.0)},
        delta=0.1,
        boundary_fraction=0.4,
        queue=args.queue,
        thresholds=(args.low_return, args.high_return),
        seed=args.seed,
        measures=MEASURES,
    )
    loss = ClipPPOLoss(actor, value, clip_epsilon=0.2, entropy_coeff=1e-3)
    gae = GAE(gamma=args.gamma, lmbda=0.95, value_network=value, average_gae=True)
    optim = torch.optim.Adam(loss.parameters(), lr=args.lr)
    frames = args.worlds * args.steps_per_batch
    collector = Collector(
        sender.env_fn(lambda: make_env(args)),
        actor,
        frames_per_batch=frames,
        total_frames=frames * args.batches,
        weight_sync_schemes=sender.schemes(),
        auto_register_policy_transforms=False,
    )  # the actor needs no InitTracker
    log = Log(built=built)
    try:
        for batch in collector:
            episodes = adr.observe(with_physics(batch))
            for episode in episodes:
                check_episode(episode, log)
            returns = [e.episode_return for e in episodes]
            log.mean_return.append(sum(returns) / len(returns) if returns else None)
            train_step(batch, loss, gae, optim, args)
            log.ranges.append({"frames": adr.ledger.frames, **{n: list(r) for n, r in adr.range.items()}})
        check_held(sender, log)
        log.pushes = sender.version
    finally:
        collector.shutdown()
        sender.close()
    log.boundary_results = sum(adr.results.values())
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
    """Train; exit non-zero if Genesis is missing, if an episode's or a world's physics is not
    the one its config names, or if no episode finished."""
    args = parse_args(argv)
    try:
        import genesis  # noqa: F401
    except ImportError:
        sys.exit(MISSING)
    log = train(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "genesis_adr.json").write_text(json.dumps(dataclasses.asdict(log), indent=2, default=str))
    shown = [{n: "[{:.2f}, {:.2f}]".format(*record[n]) for n in ("mass", "friction")} for record in log.ranges]
    for record, ranges, mean in zip(log.ranges, shown, log.mean_return, strict=True):
        ret = "   n/a" if mean is None else f"{mean:7.2f}"
        print(f"frames {record['frames']:>7}  mean return {ret}  mass {ranges['mass']}  friction {ranges['friction']}")
    print(
        f"{log.episodes_checked} episodes checked against the simulator's physics; {log.worlds_read_back} worlds "
        f"read back hold the config of the version they run; final ranges: mass {shown[-1]['mass']}, "
        f"friction {shown[-1]['friction']}; {log.pushes} pushes"
    )
    if log.episodes_checked == 0:
        log.failures.append("no episode finished")
    if log.failures:
        sys.exit("FAILED:\n" + "\n".join(log.failures))


if __name__ == "__main__":
    main()
