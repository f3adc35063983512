"""ADR over the pole mass and the friction of every world of an mjlab Cartpole, trained with PPO.

One ``MJLabEnv`` (torchrl's wrapper of mjlab, MuJoCo Warp on Warp's CPU device) holds
``worlds`` worlds of ``Mjlab-Cartpole-Balance``, driven by a ``Collector``. Each world is an
env of envsync's fleet: ``envsync.apply.scales`` writes a mass factor (every body's mass and
inertia) and a friction factor (every geom's friction) into the world's row of mjlab's model
(``sim.model.body_mass``, ``body_inertia``, ``geom_friction``, expanded to per-world memory
when envsync binds), and ``recompute_constants()`` has MuJoCo Warp recompute the constants
it derives (the cart's subtree mass, ...) per world. ``envsync.curriculum.ADR`` draws each
world's next factors at that world's own reset (a share of worlds pinned to a boundary of
the range, DeXtreme's rule) and widens a range where the agent's return stays high.
torchrl's PPO pieces (``ProbabilisticActor``, ``ValueOperator``, ``GAE``, ``ClipPPOLoss``)
train between batches.

Attribution is checked from the simulator, not from labels: an mjlab observation term reads
each world's pole mass, cart subtree mass and total sliding friction from the model when the
observation is produced, and every finished episode's readings (their minimum and maximum
over the episode) must be its config's factors times the model as built. At the end each
world's model is read back by its own receiver (``sender.read_attributes``) and compared with
the config of the version it runs. (Cartpole has contacts disabled, so its geoms' friction is
carried and checked per world but does not change its dynamics; on a task with contacts,
such as mjlab's Go1 velocity tasks, the same path is the contact friction.)

Needs the mjlab venv: mjlab pins mujoco 3.11, the project's main venv has 4.0.

    make .venv-mjlab/.installed
    .venv-mjlab/bin/python examples/mjlab_adr.py            # 64 worlds, 100 batches (a few minutes)
    .venv-mjlab/bin/python examples/mjlab_adr.py --smoke    # 16 worlds, 6 batches
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

import envsync
from envsync import EnvStateSender
from envsync.curriculum import ADR, Episode, Measure

DEFAULT_OUT = Path(__file__).resolve().parent / "out"
TASK = "Mjlab-Cartpole-Balance"
MISSING = (
    "mjlab is missing: this example runs in the mjlab venv; build it with `make .venv-mjlab/.installed`, "
    "then run `.venv-mjlab/bin/python examples/mjlab_adr.py`"
)
PHYSICS = ("pole_mass", "subtree_mass", "friction")  # the columns of the "physics" observation


@dataclass
class Args:
    """Arguments of the example."""

    worlds: int = 64
    batches: int = 100
    steps_per_batch: int = 32
    episode_s: float = 5.0
    fall: float = 0.5
    epochs: int = 4
    minibatch: int = 512
    lr: float = 3e-4
    gamma: float = 0.99
    queue: int = 8
    low_return: float = 2.5  # mjlab weighs rewards by the step's 0.05 s: a 5 s episode returns at most 5
    high_return: float = 4.0
    seed: int = 0
    out: Path = DEFAULT_OUT

    @classmethod
    def smoke(cls) -> Args:
        """A tiny budget for CI: short episodes, and thresholds every return passes (the ranges widen)."""
        return cls(
            worlds=16,
            batches=6,
            steps_per_batch=20,
            episode_s=1.0,
            epochs=1,
            minibatch=160,
            queue=1,
            low_return=-1e9,
            high_return=-1e9,
        )


def physics(env: Any) -> torch.Tensor:
    """Per world, read from the model: the pole's mass, the cart's subtree mass (cart + pole,
    which MuJoCo derives) and the geoms' total sliding friction."""
    model, names = env.sim.model, env.sim.mj_model
    pole, cart = names.body("cartpole/pole_1").id, names.body("cartpole/cart").id
    friction = model.geom_friction[...][:, :, 0].sum(-1)
    return torch.stack([model.body_mass[:, pole], model.body_subtreemass[:, cart], friction], dim=-1)


def pole_fallen(env: Any, limit: float) -> torch.Tensor:
    return env.scene["cartpole"].data.joint_pos[:, 1].abs() > limit


def own_done_flags(env_class: type) -> type:
    """``env_class`` (torchrl's ``MJLabEnv``) with ``terminated`` and ``truncated`` copied out
    of mjlab's buffers: torchrl 0.14.1's ``MJLabWrapper`` returns mjlab's own termination
    buffers, which the next step overwrites, so the collected batch (and GAE) would see later
    steps' flags. (A subclass, not a transform: the copy belongs to the env itself, and a
    ``TransformedEnv`` around the worlds would add a batched level the example has no use
    for; it would work too: a version that asks nothing of that level is applied as each
    world resets, see docs/domain_randomization.md, "Batched simulators".)"""

    class OwnDoneFlags(env_class):  # type: ignore[misc, valid-type]
        def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
            out = super()._step(tensordict)
            for key in ("terminated", "truncated"):
                out.set(key, out.get(key).clone())
            return out

    return OwnDoneFlags


def make_env(args: Args) -> Any:
    """``Mjlab-Cartpole-Balance`` with ``args.worlds`` worlds on the CPU, the ``"physics"``
    observation, and episodes that end when the pole tilts past ``args.fall`` radians."""
    import mjlab.tasks  # noqa: F401  (registers the tasks)
    import warp as wp
    from mjlab.managers.observation_manager import ObservationGroupCfg, ObservationTermCfg
    from mjlab.managers.termination_manager import TerminationTermCfg
    from mjlab.tasks.registry import load_env_cfg
    from torchrl.envs import MJLabEnv

    wp.config.log_level = wp.LOG_WARNING  # no line per Warp module loaded (warp 1.19 ignores config.quiet)
    cfg = load_env_cfg(TASK)
    cfg.observations["physics"] = ObservationGroupCfg(
        {"physics": ObservationTermCfg(func=physics)}, enable_corruption=False
    )
    cfg.terminations["fallen"] = TerminationTermCfg(func=pole_fallen, params={"limit": args.fall})
    cfg.episode_length_s = args.episode_s
    return own_done_flags(MJLabEnv)(TASK, cfg=cfg, num_envs=args.worlds, device="cpu")


def make_agent(env: Any) -> tuple[ProbabilisticActor, ValueOperator]:
    """A tanh-Gaussian actor on mjlab's ``"actor"`` observation, a value network on its ``"critic"``."""
    observation, action = env.observation_spec["actor"].shape[-1], env.action_spec.shape[-1]
    actor = ProbabilisticActor(
        TensorDictModule(
            nn.Sequential(
                MLP(in_features=observation, out_features=2 * action, num_cells=[64, 64], activation_class=nn.Tanh),
                NormalParamExtractor(),
            ),
            in_keys=["actor"],
            out_keys=["loc", "scale"],
        ),
        spec=env.action_spec,
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
        distribution_kwargs={"low": -1.0, "high": 1.0},
        return_log_prob=True,
    )
    value = ValueOperator(
        MLP(
            in_features=env.observation_spec["critic"].shape[-1],
            out_features=1,
            num_cells=[64, 64],
            activation_class=nn.Tanh,
        ),
        in_keys=["critic"],
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
    """The ADR ranges over time, and what the physics checks found."""

    built: dict[str, float] = field(default_factory=dict)
    ranges: list[dict[str, Any]] = field(default_factory=list)
    mean_return: list[float | None] = field(default_factory=list)
    episodes_checked: int = 0
    worlds_read_back: int = 0
    boundary_results: int = 0
    failures: list[str] = field(default_factory=list)


def check_episode(episode: Episode, log: Log) -> None:
    """Over every step of the episode the simulator held its config's factors times the model as built."""
    factors = {"mass": episode.config["mass"].item(), "friction": episode.config["friction"].item()}
    for name, factor in (
        ("pole_mass", factors["mass"]),
        ("subtree_mass", factors["mass"]),
        ("friction", factors["friction"]),
    ):
        want = log.built[name] * factor
        for end in ("min", "max"):
            got = episode.measures[f"{name}_{end}"]
            if abs(got - want) > 1e-5 * want:
                log.failures.append(f"world {episode.env} version {episode.version}: {name} {end} {got}, config {want}")
    log.episodes_checked += 1


def check_held(sender: EnvStateSender, env: Any, log: Log) -> None:
    """Each world's model, read back by its own receiver, holds the config of the version it runs."""
    held = sender.read_attributes(["sim.model.body_mass", "sim.model.geom_friction"])
    pole = env.sim.mj_model.body("cartpole/pole_1").id
    mass, friction = held["sim", "model", "body_mass"][:, pole], held["sim", "model", "geom_friction"][..., 0].sum(-1)
    for world, version in enumerate(sender.env_versions()):
        config = sender.config_at(world, version)
        want = (log.built["pole_mass"] * config["mass"].item(), log.built["friction"] * config["friction"].item())
        got = (mass[world].item(), friction[world].item())
        if any(abs(g - w) > 1e-5 * w for g, w in zip(got, want, strict=True)):
            log.failures.append(f"world {world} holds (pole mass, friction) {got}; its version {version} says {want}")
    log.worlds_read_back = len(sender.env_versions())


def train(args: Args) -> Log:
    torch.manual_seed(args.seed)
    probe = make_env(dataclasses.replace(args, worlds=1))
    built = physics(probe)[0].tolist()  # (torchrl forwards `sim` to the mjlab env)
    actor, value = make_agent(probe)
    probe.close()
    apply = envsync.apply.scales(
        {"mass": ["sim.model.body_mass", "sim.model.body_inertia"], "friction": "sim.model.geom_friction"},
        finish=envsync.apply.recompute_constants(),
    )
    sender = EnvStateSender(config={"mass": 1.0, "friction": 1.0}, apply=apply, apply_at="reset")
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
    log = Log(built=dict(zip(PHYSICS, built, strict=True)))
    try:
        for batch in collector:
            episodes = adr.observe(with_physics(batch))
            for episode in episodes:
                check_episode(episode, log)
            returns = [e.episode_return for e in episodes]
            log.mean_return.append(sum(returns) / len(returns) if returns else None)
            train_step(batch, loss, gae, optim, args)
            log.ranges.append({"frames": adr.ledger.frames, **{n: list(r) for n, r in adr.range.items()}})
        check_held(sender, collector.env, log)
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
    """Train; exit non-zero if mjlab is missing, if an episode's or a world's physics is not the
    one its config names, or if no episode finished."""
    args = parse_args(argv)
    try:
        import mjlab  # noqa: F401
    except ImportError:
        sys.exit(MISSING)
    log = train(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mjlab_adr.json").write_text(json.dumps(dataclasses.asdict(log), indent=2, default=str))
    shown = [{n: "[{:.2f}, {:.2f}]".format(*record[n]) for n in ("mass", "friction")} for record in log.ranges]
    for record, ranges, mean in zip(log.ranges, shown, log.mean_return, strict=True):
        ret = "   n/a" if mean is None else f"{mean:6.2f}"
        print(f"frames {record['frames']:>7}  mean return {ret}  mass {ranges['mass']}  friction {ranges['friction']}")
    print(
        f"{log.episodes_checked} episodes checked against the simulator's physics; {log.worlds_read_back} worlds "
        f"read back hold the config of the version they run; final ranges: mass {shown[-1]['mass']}, "
        f"friction {shown[-1]['friction']}"
    )
    if log.episodes_checked == 0:
        log.failures.append("no episode finished")
    if log.failures:
        sys.exit("FAILED:\n" + "\n".join(log.failures))


if __name__ == "__main__":
    main()
