"""ADR over the pole mass and the friction of every world of a MuJoCo Playground Cartpole, trained with PPO.

One ``PlaygroundWorlds`` (envsync's torchrl env for MuJoCo Playground: MJX on JAX, here on the
CPU) holds ``worlds`` worlds of Playground's ``CartpoleBalance``, driven by a ``Collector``.
Each world is an env of envsync's fleet. Its physics is data: the per-world fields
(``body_mass``, ``body_inertia``, ``geom_friction``, and the constants MuJoCo derives from the
masses) are arrays with a leading world axis that the jitted, vmapped step takes as an
argument, so ``apply="set_physics"`` changes some worlds' rows with one masked write and no
recompilation. ``envsync.curriculum.ADR`` draws each world's next mass and friction factors at
that world's own reset (a share of worlds pinned to a boundary of the range, DeXtreme's rule)
and widens a range where the agent's return stays high. torchrl's PPO pieces
(``ProbabilisticActor``, ``ValueOperator``, ``GAE``, ``ClipPPOLoss``) train between batches.

Attribution is checked from the simulator, not from labels: the env's observation carries,
computed by the step that produced it from the model that world ran, the slider's entry of
the joint-space inertia matrix (cart + pole mass, which MJX's step computes from
``body_mass``), the cart's subtree mass (a constant MuJoCo derives from the masses, recomputed
per world) and the geoms' total sliding friction; every finished
episode's readings (their minimum and maximum over the episode) must be its config's factors
times the model as built. At the end each world's model is read back by its own receiver
(``sender.read_attributes``) and compared with the config of the version it runs, and the
number of JAX traces is printed: one step, one reset and one write, whatever the pushes.
(Cartpole has contacts disabled, so its friction is carried and checked per world but does not
change its dynamics; on a task with contacts the same field is the contact friction.)

Needs the playground venv (jax, mujoco-mjx, playground):

    make .venv-playground/.installed
    .venv-playground/bin/python examples/playground_adr.py            # 64 worlds, 100 batches
    .venv-playground/bin/python examples/playground_adr.py --smoke    # 16 worlds, 6 batches
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
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
    "MuJoCo Playground is missing: this example runs in the playground venv; build it with "
    "`make .venv-playground/.installed`, then run `.venv-playground/bin/python examples/playground_adr.py`"
)
PHYSICS = ("slider_inertia", "subtree_mass", "friction")  # the columns of the "physics" observation
CART, POLE = 1, 2  # Cartpole's bodies: world, cart, pole_1


@dataclass
class Args:
    """Arguments of the example."""

    worlds: int = 64
    batches: int = 100
    steps_per_batch: int = 50
    episode_steps: int = 500
    fall: float = 0.5
    epochs: int = 4
    minibatch: int = 512
    lr: float = 3e-4
    gamma: float = 0.99
    queue: int = 8
    low_return: float = 250.0  # Playground's Cartpole rewards up to 1 a step
    high_return: float = 400.0
    seed: int = 0
    out: Path = DEFAULT_OUT
    jax_cache: Path = Path(tempfile.gettempdir()) / "envsync-jax-cache"  # JAX's persistent compilation cache

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


def cartpole_class(args: Args) -> type:
    """Playground's ``CartpoleBalance`` with a ``"physics"`` observation beside its own
    (``"state"``), and episodes that end when the pole tilts past ``args.fall`` radians or
    after ``args.episode_steps`` steps (Playground's own ends only on a NaN)."""
    import jax.numpy as jp
    from mujoco import mjx
    from mujoco_playground import dm_control_suite

    class Cartpole(dm_control_suite.cartpole.Balance):  # type: ignore[misc, name-defined]
        def _get_obs(self, data: Any, info: Any) -> Any:
            model = self.mjx_model  # this world's model, inside PlaygroundWorlds' step and reset
            slider = mjx.full_m(model, data)[0, 0]
            physics = jp.stack([slider, model.body_subtreemass[CART], model.geom_friction[:, 0].sum()])
            return {"state": super()._get_obs(data, info), "physics": physics}

        def reset(self, rng: Any) -> Any:
            state = super().reset(rng)
            return state.replace(info={**state.info, "steps": jp.zeros((), jp.int32)})

        def step(self, state: Any, action: Any) -> Any:
            out = super().step(state, action)
            steps = state.info["steps"] + 1
            done = (out.done > 0) | (jp.abs(out.data.qpos[1]) > args.fall) | (steps >= args.episode_steps)
            return out.replace(done=done.astype(jp.float32), info={**out.info, "steps": steps})

    return Cartpole


def make_env(args: Args) -> Any:
    """``args.worlds`` Cartpole worlds as one ``PlaygroundWorlds`` (MJX's JAX backend, on the CPU)."""
    import jax

    from envsync.integrations.torchrl.playground import PlaygroundWorlds

    jax.config.update("jax_compilation_cache_dir", str(args.jax_cache))  # a second run loads the step, reset
    env = cartpole_class(args)(swing_up=False, sparse=False, config_overrides={"impl": "jax"})
    return PlaygroundWorlds(env, batch_size=[args.worlds], device="cpu")


def make_agent(env: Any) -> tuple[ProbabilisticActor, ValueOperator]:
    """A tanh-Gaussian actor and a value network on Playground's own observation (``"state"``)."""
    observation, action = env.observation_spec["state"].shape[-1], env.action_spec.shape[-1]
    actor = ProbabilisticActor(
        TensorDictModule(
            nn.Sequential(
                MLP(in_features=observation, out_features=2 * action, num_cells=[64, 64], activation_class=nn.Tanh),
                NormalParamExtractor(),
            ),
            in_keys=["state"],
            out_keys=["loc", "scale"],
        ),
        spec=env.action_spec,
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
        distribution_kwargs={"low": -1.0, "high": 1.0},
        return_log_prob=True,
    )
    value = ValueOperator(
        MLP(in_features=observation, out_features=1, num_cells=[64, 64], activation_class=nn.Tanh), in_keys=["state"]
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
    """The ADR ranges over time, what the physics checks found, and the JAX traces."""

    built: dict[str, float] = field(default_factory=dict)
    ranges: list[dict[str, Any]] = field(default_factory=list)
    mean_return: list[float | None] = field(default_factory=list)
    episodes_checked: int = 0
    worlds_read_back: int = 0
    boundary_results: int = 0
    pushes: int = 0
    traces: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def check_episode(episode: Episode, log: Log) -> None:
    """Over every step of the episode the simulator held its config's factors times the model as built."""
    factors = {"mass": episode.config["mass"].item(), "friction": episode.config["friction"].item()}
    for name, factor in (
        ("slider_inertia", factors["mass"]),
        ("subtree_mass", factors["mass"]),
        ("friction", factors["friction"]),
    ):
        want = log.built[name] * factor
        for end in ("min", "max"):
            got = episode.measures[f"{name}_{end}"]
            if abs(got - want) > 1e-5 * want:
                log.failures.append(f"world {episode.env} version {episode.version}: {name} {end} {got}, config {want}")
    log.episodes_checked += 1


def check_held(sender: EnvStateSender, log: Log) -> None:
    """Each world's model, read back by its own receiver, holds the config of the version it runs."""
    held = sender.read_attributes(["model.body_mass", "model.geom_friction"])
    mass, friction = held["model", "body_mass"][:, POLE], held["model", "geom_friction"][..., 0].sum(-1)
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
    model = probe.model  # the per-world fields as built (world 0 of 1), read without running a step
    built = {
        "slider_inertia": model.body_mass[0].sum().item(),
        "subtree_mass": model.body_subtreemass[0, CART].item(),
        "friction": model.geom_friction[0, :, 0].sum().item(),
        "pole_mass": model.body_mass[0, POLE].item(),
    }
    actor, value = make_agent(probe)
    probe.close()
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
        log.traces = dict(collector.env.traces)
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
    """Train; exit non-zero if Playground is missing, if an episode's or a world's physics is not
    the one its config names, if a push recompiled anything, or if no episode finished."""
    args = parse_args(argv)
    try:
        import mujoco_playground  # noqa: F401
    except ImportError:
        sys.exit(MISSING)
    log = train(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "playground_adr.json").write_text(json.dumps(dataclasses.asdict(log), indent=2, default=str))
    shown = [{n: "[{:.2f}, {:.2f}]".format(*record[n]) for n in ("mass", "friction")} for record in log.ranges]
    for record, ranges, mean in zip(log.ranges, shown, log.mean_return, strict=True):
        ret = "   n/a" if mean is None else f"{mean:7.2f}"
        print(f"frames {record['frames']:>7}  mean return {ret}  mass {ranges['mass']}  friction {ranges['friction']}")
    print(
        f"{log.episodes_checked} episodes checked against the simulator's physics; {log.worlds_read_back} worlds "
        f"read back hold the config of the version they run; final ranges: mass {shown[-1]['mass']}, "
        f"friction {shown[-1]['friction']}; {log.pushes} pushes, JAX traces {log.traces}"
    )
    if log.episodes_checked == 0:
        log.failures.append("no episode finished")
    if log.traces != {"reset": 1, "step": 1, "write": 1}:
        log.failures.append(f"the pushes recompiled: traces {log.traces}")
    if log.failures:
        sys.exit("FAILED:\n" + "\n".join(log.failures))


if __name__ == "__main__":
    main()
