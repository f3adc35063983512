"""envsync.apply.rebuild(): constructor parameters through torchrl's GymEnv.rebuild_with_kwargs,
in every collector kind and inside a ParallelEnv, on gymnasium's Pendulum-v1 (the dynamics show
the gravity, see tests/pendulum.py); seeding, the spec check in the main process, the modes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import build
from helpers import start_method
from pendulum import g_by_version, make_parallel_pendulums, make_pendulum, measured_g
from torchrl.collectors import Collector
from torchrl.envs import GymEnv, TransformedEnv, VecNormV2

import envsync
from envsync import EnvStateSender, ValidationError

SIZED = "envsync-test/Sized-v0"


class SizedEnv(gym.Env):
    """A gymnasium env whose constructor sets its observation size (and a harmless ``gain``)."""

    def __init__(self, size: int = 3, gain: float = 1.0) -> None:
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (size,), dtype=np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (1,), dtype=np.float32)
        self.gain = gain

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        return self.observation_space.sample(), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict]:
        return self.observation_space.sample(), float(self.gain), False, False, {}


if SIZED not in gym.registry:
    gym.register(SIZED, entry_point=SizedEnv, max_episode_steps=8)


def make_sized() -> GymEnv:
    return GymEnv(SIZED)


@pytest.fixture(scope="module", params=["single", "sync", "async"])
def pendulums(request: pytest.FixtureRequest) -> Iterator[tuple[EnvStateSender, Iterator[Any]]]:
    sender = EnvStateSender.from_env(make_pendulum, config=["g"], apply=envsync.apply.rebuild())
    with start_method("fork"):
        collector = build(request.param, sender, make_pendulum, frames_per_batch=96)
    try:
        yield sender, iter(collector)
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(90)
def test_frames_show_the_gravity_of_the_rebuilt_env(pendulums: tuple[EnvStateSender, Iterator[Any]]) -> None:
    sender, batches = pendulums
    assert g_by_version(next(batches)) == {0: pytest.approx(10.0, rel=1e-4)}
    version = sender.push(config={"g": 3.0})
    seen: dict[int, float] = {}
    for _ in range(12):
        for v, g in g_by_version(next(batches)).items():
            if g is not None:
                assert g == pytest.approx({0: 10.0, version: 3.0}[v], rel=1e-4), (v, g)
                seen[v] = g
        if version in seen:
            break
    assert version in seen, "no batch showed the rebuilt env's gravity"


@pytest.mark.timeout(60)
def test_each_sub_env_of_a_parallel_env_is_rebuilt_with_its_own_row() -> None:
    sender = EnvStateSender.from_env(make_parallel_pendulums, config=["g"], apply=envsync.apply.rebuild())
    with start_method("fork"):
        collector = Collector(
            sender.env_fn(make_parallel_pendulums),
            None,
            frames_per_batch=64,
            total_frames=-1,
            weight_sync_schemes=sender.schemes(),
        )
    try:
        batches = iter(collector)
        next(batches)
        version = sender.push(config={"g": torch.tensor([2.0, 7.0], dtype=torch.float64)})
        found: dict[int, float] = {}
        for _ in range(10):
            batch = next(batches)
            for env_index in (0, 1):
                rows = batch[env_index]
                g = measured_g(rows[rows["next", "env_version"] == version])
                if g is not None:
                    found[env_index] = g
            if len(found) == 2:
                break
        assert found == {0: pytest.approx(2.0, rel=1e-4), 1: pytest.approx(7.0, rel=1e-4)}
    finally:
        collector.shutdown()
        sender.close()


def _seeded_run(apply: Any) -> torch.Tensor:
    """Observations of a seeded single-process run with two rebuilds in it."""
    torch.manual_seed(0)
    sender = EnvStateSender.from_env(make_pendulum, config=["g"], apply=apply)
    collector = Collector(
        sender.env_fn(make_pendulum), None, frames_per_batch=40, total_frames=-1, weight_sync_schemes=sender.schemes()
    )
    collector.set_seed(7)
    observations = []
    try:
        for i, batch in enumerate(collector):
            observations.append(batch["observation"])
            if i in (0, 2):
                sender.push(config={"g": 4.0 + i})
            if i == 4:
                break
        assert sender.versions() == [2]
    finally:
        collector.shutdown()
        sender.close()
    return torch.cat(observations)


@pytest.mark.timeout(60)
def test_a_seeded_run_replays_exactly_rebuilds_included() -> None:
    # frame 0 is the collector's own first reset, which torchrl runs before set_seed
    first, second = _seeded_run(envsync.apply.rebuild())[1:], _seeded_run(envsync.apply.rebuild())[1:]
    assert torch.equal(first, second)
    # the bare method name rebuilds an unseeded gymnasium env: the episodes after it differ
    bare = _seeded_run("rebuild_with_kwargs")[1:]
    assert not torch.equal(first, bare)
    assert torch.equal(first[:39], bare[:39])  # the batch before any rebuild is the same


def test_a_rebuild_keeps_the_torchrl_env_and_its_running_statistics() -> None:
    env = TransformedEnv(make_pendulum(), VecNormV2(in_keys=["observation"], decay=1.0))
    env.rollout(5)
    before = {k: v.clone() for k, v in env.state_dict().items() if isinstance(v, torch.Tensor)}
    specs = env.output_spec.clone()
    envsync.apply.rebuild().bind(env)({"g": np.array(2.0)})
    after = env.state_dict()
    assert before.keys() and all(torch.equal(v, after[k]) for k, v in before.items())
    assert env.output_spec == specs and envsync.apply.attributes().read(env, ["g"]) == {"g": 2.0}


@pytest.mark.timeout(60)
def test_a_push_that_would_change_the_specs_is_refused_in_the_main_process() -> None:
    sender = EnvStateSender.from_env(make_sized, config=["size", "gain"], apply=envsync.apply.rebuild())
    with start_method("fork"):
        collector = build("sync", sender, make_sized, frames_per_batch=16)
    try:
        batches = iter(collector)
        next(batches)
        changes = r"would change the env's specs \(observation_space Box.*\(3,\).*\(4,\)"
        with pytest.raises(ValidationError, match=changes):
            sender.push(config={"size": 4})
        assert sender.version == 0 and sender.versions() == [0, 0]  # nothing was sent
        version = sender.push(config={"gain": 2.5}, wait="received")  # same spaces: accepted
        for _ in range(6):
            batch = next(batches)
            if bool((batch["next", "env_version"] == version).any()):
                break
        rewards = batch["next", "reward"][batch["next", "env_version"] == version]
        assert rewards.numel() and bool((rewards == 2.5).all())
    finally:
        collector.shutdown()
        sender.close()


def test_a_push_before_any_collector_is_checked_on_the_probe_env() -> None:
    sender = EnvStateSender.from_env(make_sized, config=["size"], apply=envsync.apply.rebuild())
    sender.env_fn(make_sized)
    with pytest.raises(ValidationError, match="observation_space"):
        sender.push(config={"size": 5})
    assert sender.version == 0
    sender.close()


def test_a_name_that_is_no_constructor_parameter_is_refused_when_the_env_is_built() -> None:
    sender = EnvStateSender(config={"gravity": 9.0}, apply=envsync.apply.rebuild())
    with pytest.raises(ValidationError, match=r"\['gravity'\] are not constructor parameters of PendulumEnv"):
        sender.env_fn(make_pendulum())
    sender.close()


def test_step_mode_is_refused_when_the_sender_is_built() -> None:
    with pytest.raises(ValidationError, match="use apply_at='reset' or 'truncate', not 'step'"):
        EnvStateSender(config={"g": 10.0}, apply=envsync.apply.rebuild(), apply_at="step")
    # a re-init policy that steps the env makes "step" truncate: a reset follows the rebuild
    sender = EnvStateSender(
        config={"g": 10.0},
        apply=envsync.apply.rebuild(),
        apply_at="step",
        reinit={"ObservationNorm": envsync.reinit.recompute(num_iter=4)},
    )
    sender.close()


def test_from_env_reads_constructor_arguments() -> None:
    def make() -> GymEnv:
        return GymEnv("Pendulum-v1", g=3.5)

    sender = EnvStateSender.from_env(make, config=["g"], apply=envsync.apply.rebuild())
    assert sender.desired_config()["g"].item() == 3.5
    sender.close()
    with pytest.raises(ValidationError, match="not constructor parameters"):
        EnvStateSender.from_env(make, config=["max_speed"], apply=envsync.apply.rebuild())
