"""envsync.apply.attributes() and EnvStateSender.from_env on gymnasium's Pendulum-v1, in real
collectors: every frame's dynamics show the gravity its version names (see tests/pendulum.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import build
from helpers import start_method
from pendulum import g_by_version, make_pendulum, measured_g
from torchrl.collectors import Collector
from torchrl.envs import GymEnv, GymWrapper, ParallelEnv, StepCounter, TransformedEnv

import envsync
from envsync import EnvStateSender, ValidationError
from envsync.integrations.torchrl.paths import find_owner

QUICKSTART = Path(__file__).resolve().parents[1] / "docs" / "quickstart.md"
CHAIN = "TransformedEnv -> GymEnv -> TimeLimit -> OrderEnforcing -> PendulumEnv"


def make_counted_pendulum() -> TransformedEnv:
    return TransformedEnv(make_pendulum(), StepCounter())


class Heavier(gym.Wrapper):
    """A gymnasium wrapper that keeps its own ``g`` (the first holder along the chain wins)."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.g = 0.0


def test_a_name_found_nowhere_names_the_chain_it_searched() -> None:
    sender = EnvStateSender(config={"gravity": 9.8}, apply=envsync.apply.attributes())
    with pytest.raises(ValidationError, match=re.escape(f"'gravity' (searched {CHAIN})")):
        sender.env_fn(make_counted_pendulum())
    sender.close()


def test_from_env_refuses_a_name_found_nowhere() -> None:
    with pytest.raises(ValidationError, match="no object along the env's wrapper chain has an attribute 'gravity'"):
        EnvStateSender.from_env(make_pendulum, config=["gravity"], apply=envsync.apply.attributes())


def test_the_first_holder_along_the_chain_takes_the_value() -> None:
    env = GymWrapper(Heavier(gym.make("Pendulum-v1")))
    sender = EnvStateSender(config={"g": 3.0, "max_speed": 6.0}, apply=envsync.apply.attributes())
    sender.env_fn(env)
    heavier = find_owner(env, "g")
    assert isinstance(heavier, Heavier) and heavier.g == 3.0
    assert heavier.unwrapped.g == 10.0 and heavier.unwrapped.max_speed == 6.0
    sender.close()


def test_methods_and_read_only_properties_are_not_attributes() -> None:
    env = make_counted_pendulum()
    with pytest.raises(ValidationError, match="'set_seed'"):
        find_owner(env, "set_seed")  # a method of the torchrl env, not a parameter
    with pytest.raises(ValidationError, match="'unwrapped'"):
        find_owner(env, "unwrapped")  # a property without a setter on every wrapper
    assert find_owner(env, "dt") is env.base_env._env.unwrapped


def test_an_array_attribute_stays_an_array() -> None:
    inner = gym.make("Pendulum-v1")
    inner.unwrapped.gains = np.array([1.0, 2.0], dtype=np.float32)
    env = GymWrapper(inner)
    sender = EnvStateSender.from_env(env, config=["gains"], apply=envsync.apply.attributes())
    assert sender.desired_config()["gains"].dtype == torch.float32
    sender.env_fn(env)
    envsync.apply.attributes().bind(env)({"gains": np.array([3.0, 4.0], dtype=np.float32)})
    assert isinstance(inner.unwrapped.gains, np.ndarray) and inner.unwrapped.gains.tolist() == [3.0, 4.0]
    sender.close()


def test_from_env_reads_values_and_dtypes_so_version_0_is_the_env_as_built() -> None:
    def make() -> GymEnv:
        return GymEnv("Pendulum-v1", g=9.81)

    sender = EnvStateSender.from_env(make, config=["g", "max_speed"], apply=envsync.apply.attributes())
    config = sender.desired_config()
    assert config["g"].dtype == torch.float64 and config["g"].item() == 9.81  # not float32's 9.8100004
    assert config["max_speed"].dtype == torch.int64 and config["max_speed"].item() == 8
    env = sender.env_fn(make)()
    assert envsync.apply.attributes().read(env, ["g"]) == {"g": 9.81}
    with pytest.raises(ValidationError, match="'max_speed' has dtype torch.int64"):
        sender.push(config={"max_speed": 6.5})
    sender.close()


def test_from_env_reads_one_sub_env_of_a_batched_env() -> None:
    def make() -> ParallelEnv:
        return ParallelEnv(2, make_pendulum)

    sender = EnvStateSender.from_env(make, config=["g"], apply=envsync.apply.attributes())
    assert sender.desired_config()["g"].item() == 10.0
    sender.close()


@pytest.fixture(scope="module", params=["single", "sync", "async"])
def pendulums(request: pytest.FixtureRequest) -> Iterator[tuple[EnvStateSender, Iterator[Any]]]:
    sender = EnvStateSender.from_env(make_counted_pendulum, config=["g"], apply=envsync.apply.attributes())
    with start_method("fork"):
        collector = build(request.param, sender, make_counted_pendulum, frames_per_batch=96)
    try:
        yield sender, iter(collector)
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(90)
def test_frames_show_the_gravity_their_version_names(pendulums: tuple[EnvStateSender, Iterator[Any]]) -> None:
    sender, batches = pendulums
    assert g_by_version(next(batches)) == {0: pytest.approx(10.0, rel=1e-4)}  # the env as built
    version = sender.push(config={"g": 4.0})
    seen: dict[int, float] = {}
    for _ in range(12):
        for v, g in g_by_version(next(batches)).items():
            if g is not None:
                assert g == pytest.approx({0: 10.0, version: 4.0}[v], rel=1e-4), (v, g)
                seen[v] = g
        if version in seen:
            break
    assert version in seen, "no batch showed the pushed gravity"


PPO_BLOCK = re.compile(r"<!-- tested by tests/test_attributes.py -->\s*```python\n(.*?)```", re.S)


@pytest.mark.timeout(90)
def test_the_ppo_set_up_in_the_quickstart_runs_and_changes_g() -> None:
    """The docs' PPO-style block (torchrl's ppo_mujoco env on Pendulum, a Collector given the
    built env, a curriculum on g) runs as written, and its env's gravity follows the pushes."""
    block = PPO_BLOCK.search(QUICKSTART.read_text())
    assert block is not None, "the quickstart lost its tested PPO block"
    code = block.group(1)
    added = [line for line in code.splitlines() if line.rstrip().endswith("# envsync")]
    assert 0 < len(added) <= 10 and "._" not in code.replace("__", "")
    namespace: dict[str, Any] = {"__name__": "ppo_block"}
    exec(compile(code, str(QUICKSTART), "exec"), namespace)
    env, sender, curriculum = namespace["env"], namespace["sender"], namespace["curriculum"]
    batches = namespace["total_frames"] // namespace["frames_per_batch"]
    assert sender.version == batches  # one push per batch
    g = envsync.apply.attributes().read(env, ["g"])["g"]
    assert g != 10.0 and g in {curriculum(i) for i in range(batches)}, g


@pytest.mark.timeout(60)
def test_a_collector_over_a_parallel_env_sets_each_sub_envs_attribute() -> None:
    def make() -> ParallelEnv:
        return ParallelEnv(2, make_pendulum)

    sender = EnvStateSender.from_env(make, config=["g"], apply=envsync.apply.attributes())
    with start_method("fork"):
        collector = Collector(
            sender.env_fn(make), None, frames_per_batch=64, total_frames=-1, weight_sync_schemes=sender.schemes()
        )
    try:
        batches = iter(collector)
        next(batches)
        version = sender.push(config={"g": torch.tensor([3.0, 6.0], dtype=torch.float64)})  # one row per sub-env
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
        assert found == {0: pytest.approx(3.0, rel=1e-4), 1: pytest.approx(6.0, rel=1e-4)}
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(120)
def test_a_natively_batched_env_takes_each_rows_value_into_its_array_attribute() -> None:
    """attributes() on a natively batched env: its rows' configs are stacked and written in
    place into the env's own per-row array (the paths resolved once, not at every push)."""
    from helpers import make_native_counters

    sender = EnvStateSender(config={"difficulty": 0.0}, apply=envsync.apply.attributes(), apply_at="step")
    collector = build("single", sender, make_native_counters, frames_per_batch=6)
    try:
        batches = iter(collector)
        next(batches)
        for rows in ([0.1, 0.2, 0.3], [1.0, 2.0, 3.0]):
            sender.push(config={"difficulty": torch.tensor(rows)}, wait="applied")
            seen = next(batches)["next", "observation"][..., -1, 0]
            assert seen.tolist() == pytest.approx(rows)
    finally:
        collector.shutdown()
        sender.close()
