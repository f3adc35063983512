"""``sender.read_attributes``: what each env holds at attribute paths, read by its own worker
at a safe point and sent back as a reply to a request of its own kind (``Kind.ATTRIBUTES``)
through the same links as ``gather``: the shared-memory link (``MultiSyncCollector``,
``MultiAsyncCollector``), the in-process one (``Collector``), a ``ParallelEnv``'s sub-processes,
the rows of a natively batched env, the scripted link (a refusal) and Ray (tests/test_ray_state.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import build
from helpers import make_native_counters, start_method
from pendulum import make_pendulum
from torchrl.envs import ParallelEnv, SerialEnv

import envsync
from envsync import EnvStateSender, GatherError, ValidationError
from envsync.links.scripted import ScriptedLink
from envsync.sender.sender import Sender


def pendulum_sender() -> EnvStateSender:
    return EnvStateSender.from_env(make_pendulum, config=["g"], apply=envsync.apply.attributes(), apply_at="step")


@pytest.fixture(scope="module", params=["single", "sync", "async"])
def pendulums(request: pytest.FixtureRequest) -> Iterator[tuple[EnvStateSender, Iterator[Any]]]:
    sender = pendulum_sender()
    with start_method("fork"):
        collector = build(request.param, sender, make_pendulum, frames_per_batch=32)
    try:
        batches = iter(collector)
        next(batches)
        yield sender, batches
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(90)
def test_each_env_reads_back_the_gravity_its_simulator_holds(pendulums: tuple[EnvStateSender, Any]) -> None:
    sender, batches = pendulums
    n = sender.num_envs
    assert sender.read_attributes(["g"])["g"].tolist() == [10.0] * n  # the env as built
    rows = torch.arange(1, n + 1, dtype=torch.float64) * 2.0
    sender.push(config={"g": rows}, wait="applied")
    held = sender.read_attributes(["g", "unwrapped.max_speed"])
    assert held.batch_size == torch.Size([n])
    assert held["g"].tolist() == rows.tolist()
    assert held["unwrapped", "max_speed"].tolist() == [8.0] * n  # a nested path, nested keys
    next(batches)  # while collecting: answered at the rollout's end
    assert sender.read_attributes(["g"], envs=[n - 1])["g"].tolist() == [rows[-1].item()]


@pytest.mark.timeout(90)
def test_a_path_that_does_not_resolve_is_refused_in_the_main_process_before_anything_is_sent(
    pendulums: tuple[EnvStateSender, Any],
) -> None:
    sender, _ = pendulums
    with pytest.raises(ValidationError, match="no_such_thing"):
        sender.read_attributes(["g", "no_such_thing"])
    with pytest.raises(ValidationError, match="not a number or an array"):
        sender.read_attributes(["np_random"])  # an attribute that holds a generator
    for bad in ([], "g", [3]):
        with pytest.raises(ValidationError, match="list of attribute paths"):
            sender.read_attributes(bad)  # type: ignore[arg-type]
    assert sender.read_attributes(["g"]).batch_size == torch.Size([sender.num_envs])  # nothing left pending


@pytest.mark.parametrize("kind", ["parallel", "serial"])
@pytest.mark.timeout(120)
def test_the_sub_envs_of_a_batched_env_each_read_their_own(kind: str) -> None:
    batched = {"parallel": ParallelEnv, "serial": SerialEnv}[kind]

    def make() -> Any:
        return batched(2, make_pendulum)

    sender = EnvStateSender.from_env(make, config=["g"], apply=envsync.apply.attributes(), apply_at="step")
    with start_method("fork"):
        collector = build("sync", sender, make, workers=2, frames_per_batch=32)
    try:
        next(iter(collector))
        rows = torch.tensor([3.0, 4.0, 5.0, 6.0], dtype=torch.float64)
        sender.push(config={"g": rows}, wait="applied")
        assert sender.read_attributes(["g"])["g"].tolist() == rows.tolist()
        assert sender.read_attributes(["g"], workers=[1])["g"].tolist() == [5.0, 6.0]
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(120)
def test_a_row_of_a_natively_batched_env_reads_its_row_of_a_per_row_array() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply=envsync.apply.attributes(), apply_at="step")
    collector = build("single", sender, make_native_counters, frames_per_batch=6)
    try:
        next(iter(collector))
        sender.push(config={"difficulty": torch.tensor([0.5, 1.5, 2.5])}, wait="applied")
        held = sender.read_attributes(["difficulty", "count"])
        assert held["difficulty"].tolist() == [0.5, 1.5, 2.5]
        assert held["count"].shape == torch.Size([3])  # each row's own step count
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(30)
def test_a_worker_that_fails_to_read_raises_gather_error_and_fails_no_version() -> None:
    """Over the scripted link (workers as functions: one that holds no env refuses every
    request but env-state ones), the new kind needs nothing of the link."""
    sender = Sender(config={"x": 0.0})
    sender.port.attach(2, lambda leaves: ScriptedLink(leaves, 2), detached=lambda: False)
    try:
        version = sender.push(config={"x": 1.0}, wait="applied")
        with pytest.raises(GatherError, match="holds no env to answer ATTRIBUTES"):
            sender.read_attributes(["x"])
        assert sender.versions() == [version, version]
        assert sender.push(config={"x": 2.0}, wait="applied") == version + 1
    finally:
        sender.close()
