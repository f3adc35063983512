"""Physics domain randomisation: attribute paths into a MuJoCo model (in place), derived
parameters (``finish=``), scales relative to the model as built, per worker and per sub-env,
checked from the simulator: every observation carries the total mass and friction the model
had when it was produced (:class:`PhysicsObservation`), so a frame's tags must name them.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.envs.classic_control import CartPoleEnv
from helpers import start_method
from tensordict import TensorDict
from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector
from torchrl.envs import GymEnv, GymWrapper, ParallelEnv

import envsync
from envsync import EnvStateSender, ValidationError
from envsync.curriculum import ADR, Measure

pytest.importorskip("mujoco")

DOCS = Path(__file__).resolve().parents[1] / "docs" / "domain_randomization.md"
EPISODE = 16  # steps: short episodes, so reset mode switches often


class PhysicsObservation(gym.Wrapper):
    """Adds to every observation the model's total mass and total sliding friction, read from
    the simulator when the observation is produced."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        box = gym.spaces.Box(-np.inf, np.inf, (1,), np.float64)
        self.observation_space = gym.spaces.Dict(
            {"observation": env.observation_space, "total_mass": box, "total_friction": box}
        )

    def _physics(self, obs: np.ndarray) -> dict[str, np.ndarray]:
        model = self.unwrapped.model  # type: ignore[attr-defined]
        return {
            "observation": obs,
            "total_mass": np.array([model.body_mass.sum()]),
            "total_friction": np.array([model.geom_friction[:, 0].sum()]),
        }

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        obs, info = self.env.reset(**kwargs)
        return self._physics(obs), info

    def step(self, action: Any) -> tuple[Any, ...]:
        obs, *rest = self.env.step(action)
        return (self._physics(obs), *rest)


def make_cheetah() -> GymWrapper:
    return GymWrapper(PhysicsObservation(gym.make("HalfCheetah-v5", max_episode_steps=EPISODE)))


def make_pair() -> ParallelEnv:
    import multiprocessing

    return ParallelEnv(2, make_cheetah, mp_start_method=multiprocessing.get_start_method())


BUILT = gym.make("HalfCheetah-v5").unwrapped.model  # type: ignore[attr-defined]
MASS, FRICTION = BUILT.body_mass.copy(), BUILT.geom_friction.copy()


def physics(mass_scale: float, friction_scale: float) -> dict[str, Any]:
    return {
        "model": {
            "body_mass": torch.from_numpy(MASS * mass_scale),
            "geom_friction": torch.from_numpy(FRICTION * friction_scale),
        }
    }


def totals(config: dict[str, Any]) -> tuple[float, float]:
    model = config["model"]
    return float(model["body_mass"].sum()), float(model["geom_friction"][:, 0].sum())


# ---- attribute paths ---------------------------------------------------------------------


def test_from_env_reads_dotted_paths_as_nested_names_and_version_0_is_the_model_as_built() -> None:
    sender = EnvStateSender.from_env(
        make_cheetah, config=["model.body_mass", "model.geom_friction"], apply=envsync.apply.attributes()
    )
    config = sender.desired_config()
    assert config["model", "body_mass"].dtype == torch.float64 and config["model", "body_mass"].shape == (8,)
    assert torch.equal(config["model", "geom_friction"], torch.from_numpy(FRICTION))
    env = make_cheetah()
    array = env.unwrapped.model.body_mass  # the model's own memory (public: GymWrapper forwards)
    envsync.apply.attributes().bind(env)({"model.body_mass": MASS * 2})
    assert np.shares_memory(array, env.unwrapped.model.body_mass) and np.allclose(array, MASS * 2)
    sender.close()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model": {"body_mass": torch.ones(3, dtype=torch.float64)}}, "'model.body_mass' is a float64 array"),
        ({"model": {"geom_contype": torch.ones(9)}}, "'model.geom_contype' is a int32 array of shape (9,), written"),
        ({"model": {"body_masses": torch.ones(8)}}, "'model.body_masses': 'model' (MjModel) has no attribute"),
        ({"modle": {"body_mass": torch.ones(8)}}, "no object along the env's wrapper chain has an attribute 'modle'"),
    ],
)
def test_a_path_or_value_that_does_not_fit_is_refused_at_attach_naming_the_path(
    config: dict[str, Any], message: str
) -> None:
    sender = EnvStateSender(config=config, apply=envsync.apply.attributes())
    with pytest.raises(ValidationError, match=re.escape(message)):
        sender.env_fn(make_cheetah())
    sender.close()


def test_a_tensor_attribute_is_written_in_place_and_a_float_into_an_int_tensor_is_refused() -> None:
    env = make_cheetah()
    gains = env.unwrapped.gains = torch.zeros(3)  # an attribute of the unwrapped env, a tensor
    envsync.apply.attributes().bind(env)({"gains": np.array([1.0, 2.0, 3.0], dtype=np.float32)})
    assert env.unwrapped.gains is gains and gains.tolist() == [1.0, 2.0, 3.0]
    env.unwrapped.counts = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValidationError, match=re.escape("'counts' is a int64 array of shape (3,)")):
        envsync.apply.attributes().bind(env)({"counts": np.ones(3)})


def test_scales_are_relative_to_the_model_as_built_per_body_or_for_all() -> None:
    apply = envsync.apply.scales({"mass": ["model.body_mass", "model.body_inertia"], "friction": "model.geom_friction"})
    sender = EnvStateSender(config={"mass": torch.ones(8, dtype=torch.float64), "friction": 1.0}, apply=apply)
    env = sender.env_fn(make_cheetah())
    model = env.unwrapped.model
    assert np.array_equal(model.body_mass, MASS)  # version 0 is the model as built
    scale = np.linspace(0.5, 1.5, 8)
    for _ in range(2):  # applied twice: relative to the model as built, not compounding
        apply.bind(env)({"mass": scale, "friction": np.array(2.0, dtype=np.float32)})
    assert np.allclose(model.body_mass, MASS * scale)
    assert np.allclose(model.body_inertia, BUILT.body_inertia * scale[:, None])
    assert np.allclose(model.geom_friction, FRICTION * 2.0)
    with pytest.raises(ValidationError, match=re.escape("'model.geom_friction' has shape (9, 3)")):
        EnvStateSender(config={"friction": torch.ones(3)}, apply=apply).env_fn(make_cheetah())
    sender.close()


def test_import_envsync_needs_no_mujoco() -> None:
    code = "import sys; sys.modules['mujoco'] = None; import envsync, envsync.apply, envsync.curriculum"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---- derived parameters: CartPole ------------------------------------------------------------


def cartpole_finish(cartpole: CartPoleEnv) -> None:
    """CartPole's constructor derives these from ``masspole``, ``masscart`` and ``length``."""
    cartpole.total_mass = cartpole.masspole + cartpole.masscart
    cartpole.polemass_length = cartpole.masspole * cartpole.length


def consistent_cartpole(length: float, masspole: float) -> CartPoleEnv:
    """A CartPole built with these values, its derived fields computed as its constructor does."""
    cartpole = CartPoleEnv()
    cartpole.length, cartpole.masspole = length, masspole
    cartpole.total_mass = masspole + cartpole.masscart
    cartpole.polemass_length = masspole * length
    return cartpole


def deviation_after_push(apply: Any) -> float:
    """Push ``length`` and ``masspole`` to a CartPole run by its own rollouts; replay the same
    actions from the same state on a consistent CartPole; the largest state difference."""
    sender = EnvStateSender.from_env(lambda: GymEnv("CartPole-v1"), config=["length", "masspole"], apply=apply)
    sender.env_fn(lambda: GymEnv("CartPole-v1"))
    env = GymEnv("CartPole-v1")
    sender.attach_env(env)
    sender.push(config={"length": 1.0, "masspole": 0.3})
    env.set_seed(0)
    actions = torch.tensor([i % 3 == 0 for i in range(20)], dtype=torch.long)
    steps = iter(actions)
    rollout = env.rollout(
        20, lambda td: td.set("action", torch.nn.functional.one_hot(next(steps), 2)), break_when_any_done=False
    )
    sender.close()
    assert (rollout["next", "env_version"] == 1).all()
    reference = consistent_cartpole(1.0, 0.3)
    reference.reset()
    reference.state = rollout["observation"][0].double().numpy()
    expected = [reference.step(int(a))[0] for a in actions]
    return float(np.abs(np.stack(expected) - rollout["next", "observation"].numpy()).max())


def test_cartpole_after_a_push_of_length_and_masspole_runs_as_one_built_with_them() -> None:
    assert deviation_after_push(envsync.apply.attributes(finish=cartpole_finish)) < 1e-5
    assert deviation_after_push(envsync.apply.attributes()) > 1e-2  # without finish: stale derived fields


# ---- every frame names the physics that produced it, from the simulator ---------------------

KINDS = {
    "sync": lambda s, **kw: MultiSyncCollector([s.env_fn(make_cheetah)] * 2, None, **kw),
    "async": lambda s, **kw: MultiAsyncCollector([s.env_fn(make_cheetah)] * 2, None, **kw),
    "parallel": lambda s, **kw: Collector(s.env_fn(make_pair), None, **kw),
}


MODES = ("reset", "step", "truncate")
SPAWNED = {("sync", "reset"), ("async", "step"), ("parallel", "truncate")}
"""Each collector kind and each mode once with spawn workers (a spawn start costs ~15 s here,
start and shutdown), the other cells with fork."""


@pytest.fixture(scope="module", params=[(k, m) for k in KINDS for m in MODES], ids=lambda p: "-".join(p))
def cheetahs(request: pytest.FixtureRequest) -> Iterator[tuple[str, EnvStateSender, Iterator[Any]]]:
    kind, mode = request.param
    sender = EnvStateSender.from_env(
        make_cheetah, config=["model.body_mass", "model.geom_friction"], apply=envsync.apply.attributes(), apply_at=mode
    )
    with start_method("spawn" if (kind, mode) in SPAWNED else "fork"):
        collector = KINDS[kind](sender, frames_per_batch=64, total_frames=-1, weight_sync_schemes=sender.schemes())
    try:
        yield kind, sender, iter(collector)
    finally:
        collector.shutdown()
        sender.close()


def check_frames(batch: TensorDict, expected: dict[tuple[int, int], tuple[float, float]]) -> set[tuple[int, int]]:
    """Every frame's physics (root and next) is the physics its (env_index, env_version) names."""
    flat = batch.reshape(-1)
    seen = set()
    for prefix in ((), ("next",)):
        index, version = flat[(*prefix, "env_index")].flatten(), flat[(*prefix, "env_version")].flatten()
        mass, friction = flat[(*prefix, "total_mass")].flatten(), flat[(*prefix, "total_friction")].flatten()
        for key in set(zip(index.tolist(), version.tolist(), strict=True)):
            rows = (index == key[0]) & (version == key[1])
            want = expected[key]
            assert torch.allclose(mass[rows], torch.tensor(want[0], dtype=mass.dtype)), (prefix, key, mass[rows])
            assert torch.allclose(friction[rows], torch.tensor(want[1], dtype=friction.dtype)), (prefix, key)
            seen.add(key)
    return seen


@pytest.mark.timeout(240)
def test_each_frame_names_the_physics_its_simulator_ran(cheetahs: tuple[str, EnvStateSender, Iterator[Any]]) -> None:
    kind, sender, batches = cheetahs
    built = totals(physics(1.0, 1.0))
    expected = dict.fromkeys([(0, 0), (1, 0)], built)
    check_frames(next(batches), expected)
    rows = {0: physics(1.5, 0.5), 1: physics(2.0, 1.5)}
    if kind == "parallel":  # one worker holding two sub-envs: one row per sub-env
        config = TensorDict(
            {
                "model": {
                    k: torch.stack([torch.as_tensor(rows[i]["model"][k]) for i in (0, 1)])
                    for k in ("body_mass", "geom_friction")
                }
            },
            batch_size=[2],
        )
        first = sender.push(config=config, envs=[0, 1])
        second = sender.push(config=physics(3.0, 0.25), envs=[1])
    else:
        first = sender.push_each(rows)
        second = sender.push(config=physics(3.0, 0.25), workers=[1])
    expected.update({(0, first): totals(rows[0]), (1, first): totals(rows[1]), (1, second): totals(physics(3.0, 0.25))})
    seen: set[tuple[int, int]] = set()
    for _ in range(40):
        seen |= check_frames(next(batches), expected)
        if {(0, first), (1, second)} <= seen:
            break
    assert {(0, first), (1, second)} <= seen, seen  # env 0 kept the first push; only env 1 took the second
    assert (0, second) not in seen


# ---- torchrl's PPO MuJoCo set-up ---------------------------------------------------------------

PPO_BLOCK = re.compile(r"<!-- tested by tests/test_physics_dr.py -->\s*```python\n(.*?)```", re.S)


@pytest.mark.timeout(120)
def test_the_ppo_mujoco_set_up_in_the_docs_adopts_physics_dr_in_ten_lines() -> None:
    block = PPO_BLOCK.search(DOCS.read_text())
    assert block is not None, "docs/domain_randomization.md lost its tested PPO block"
    code = block.group(1)
    added = [line for line in code.splitlines() if line.rstrip().endswith("# envsync")]
    assert 0 < len(added) <= 10 and "._" not in code.replace("__", "")
    namespace: dict[str, Any] = {"__name__": "ppo_mujoco_block"}
    with start_method("fork"):
        exec(compile(code, str(DOCS), "exec"), namespace)
    sender, data = namespace["sender"], namespace["data"]
    assert sender.version >= 1  # ADR drew each env's physics at its first decision
    assert data["next", "env_version"].max() >= 1  # and the episode after the first (1000 steps) ran it


# ---- ADR over physics: episodes attributed to the physics they ran -----------------------------

MEASURES = {
    "mass_min": Measure(("next", "total_mass"), "min"),
    "mass_max": Measure(("next", "total_mass"), "max"),
    "friction": Measure(("next", "total_friction"), "mean"),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["sync", "parallel"])
def test_adr_over_mass_and_friction_credits_each_episode_with_the_physics_it_ran(kind: str) -> None:
    apply = envsync.apply.scales({"mass": "model.body_mass", "friction": "model.geom_friction"})
    sender = EnvStateSender(config={"mass": 1.0, "friction": 1.0}, apply=apply)
    adr = ADR(
        sender,
        ranges={"mass": (0.5, 1.5), "friction": (0.5, 1.5)},
        delta=0.1,
        boundary_fraction=0.5,
        queue=2,
        thresholds=(-2e9, -1e9),
        measures=MEASURES,
    )
    with start_method("fork"):
        collector = KINDS[kind](sender, frames_per_batch=64, total_frames=-1, weight_sync_schemes=sender.schemes())
    credited: dict[int, set[float]] = {0: set(), 1: set()}
    try:
        for batch, _ in zip(collector, range(12), strict=False):
            for episode in adr.observe(batch):
                mass = MASS.sum() * episode.config["mass"].item()
                friction = FRICTION[:, 0].sum() * episode.config["friction"].item()
                assert episode.measures["mass_min"] == pytest.approx(mass, rel=1e-6)
                assert episode.measures["mass_max"] == pytest.approx(mass, rel=1e-6)
                assert episode.measures["friction"] == pytest.approx(friction, rel=1e-6)
                credited[episode.env].add(round(episode.config["mass"].item(), 6))
    finally:
        collector.shutdown()
        sender.close()
    assert all(len(masses) >= 3 for masses in credited.values()), credited  # each env ran several draws
    assert adr.range["mass"] != [0.5, 1.5]  # the boundaries moved (every result is above -1e9: widen)


def test_adr_draws_a_per_body_mass_factor_element_by_element() -> None:
    apply = envsync.apply.scales({"mass": ["model.body_mass", "model.body_inertia"]})
    sender = EnvStateSender(config={"mass": torch.ones(8, dtype=torch.float64), "friction": 1.0}, apply=apply)
    adr = ADR(sender, ranges={"mass": (0.5, 1.5), "friction": (0.8, 1.2)}, boundary_fraction=0.5, seed=3)
    draws = [adr.draw() for _ in range(20)]
    for row, boundary in draws:
        assert row["mass"].shape == (8,) and ((row["mass"] >= 0.5) & (row["mass"] <= 1.5)).all()
        if boundary is not None and boundary[0] == "mass":
            assert (row["mass"] == adr.boundary_value(boundary)).all()
        sender.push(config=row)  # fits the template
    assert any(b is None and row["mass"].unique().numel() == 8 for row, b in draws)  # each body its own factor
    sender.close()
