"""Fleet numbering: attach order, holes left by departed collectors, asked-for first envs; and,
with real collectors, one sender reaching several of them, a collector built after a push
starting on the latest version, and a detached collector left free to be collected."""

from __future__ import annotations

import gc
import weakref
from functools import partial

import pytest
import torch
from conftest import build
from helpers import make_counter_env, start_method

from envsync import EnvStateSender, ValidationError
from envsync.links.local import LocalLink
from envsync.sender.fleet import Attachment, Fleet

LEAVES = {("config", "difficulty"): torch.zeros(())}


def attached(fleet: Fleet, workers: int, envs_per_worker: int = 1, first_env: int | None = None) -> Attachment:
    """Add an attachment of ``workers`` workers to ``fleet``; it leaves once its ``on_close`` ran."""
    gone: list[bool] = []
    attachment = Attachment(LocalLink(LEAVES, workers * envs_per_worker), lambda: bool(gone), lambda: gone.append(True))
    attachment.envs_per_worker = envs_per_worker
    fleet.add(attachment, dict(LEAVES), first_env)
    return attachment


def leave(fleet: Fleet, attachment: Attachment) -> None:
    attachment.on_close()
    assert fleet.prune() == [attachment]


def test_a_departed_collector_leaves_a_hole_that_the_next_one_numbers_past() -> None:
    fleet = Fleet()
    attached(fleet, 1)
    leave(fleet, attached(fleet, 2))
    assert fleet.next_env() == 3
    after = attached(fleet, 2)
    assert (after.offset, after.worker_offset) == (3, 3)
    assert fleet.indices() == [0, 3, 4] and fleet.workers() == [0, 3, 4]


def test_numbering_starts_again_once_no_collector_is_left() -> None:
    fleet = Fleet()
    leave(fleet, attached(fleet, 2))
    assert fleet.next_env() == 0
    assert attached(fleet, 1).offset == 0


def test_an_asked_for_first_env_is_kept_and_its_gap_keeps_worker_indices_unique() -> None:
    fleet = Fleet()
    batched = attached(fleet, 1, envs_per_worker=2)  # envs 0, 1 of worker 0
    numbered_at = fleet.next_env()
    leave(fleet, batched)  # numbering would start again at 0
    remote = attached(fleet, 2, first_env=numbered_at)
    assert (remote.offset, remote.worker_offset) == (2, 2)
    assert [(m.index, m.first_env) for m in fleet.members()] == [(2, 2), (3, 3)]
    assert fleet.next_env() == 4


def test_an_asked_for_first_env_that_a_later_collector_took_is_refused() -> None:
    fleet = Fleet()
    attached(fleet, 1)
    numbered_at = fleet.next_env()
    leave(fleet, attached(fleet, 1))  # attached and left between numbering and attaching
    with pytest.raises(ValidationError, match="numbered from 1, but a collector attached since took indices up to 1"):
        attached(fleet, 2, first_env=numbered_at)
    assert fleet.indices() == [0]


@pytest.mark.timeout(60)
def test_a_collector_built_after_a_push_starts_on_the_latest_version() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    version = sender.push(config={"difficulty": 4.0}, wait=None)
    collector = build("single", sender, make_counter_env, frames_per_batch=16)
    try:
        batch = next(iter(collector))
        assert bool((batch["observation"][:, 0] == 4.0).all())
        assert bool((batch["env_version"] == version).all())
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(90)
def test_one_sender_reaches_several_collectors_without_detaching_any() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method("fork"):
        train = build("sync", sender, [partial(make_counter_env, label=i) for i in range(2)])
    evaluation = build("single", sender, partial(make_counter_env, label=7), frames_per_batch=16)
    try:
        assert [(m.index, m.collector, m.worker) for m in sender.fleet()] == [(0, 0, 0), (1, 0, 1), (2, 1, 0)]
        assert sender.num_workers == 3
        version = sender.push(config={"difficulty": 5.0}, wait="applied")
        assert sender.versions() == [version] * 3
        assert set(next(iter(train))["next", "observation"][..., 0].reshape(-1).tolist()) == {5.0}
        assert set(next(iter(evaluation))["next", "observation"][:, 0].tolist()) == {5.0}
        only_eval = sender.push(config={"difficulty": 6.0}, workers=[2], wait="applied")
        assert sender.versions() == [version, version, only_eval]
        assert set(next(iter(evaluation))["env_index"].tolist()) == {2}
        evaluation.shutdown()
        assert [m.index for m in sender.fleet()] == [0, 1]  # indices of the others unchanged
        with pytest.raises(ValidationError, match="worker 2 does not exist"):
            sender.push(config={"difficulty": 1.0}, workers=[2])
    finally:
        train.shutdown()
        evaluation.shutdown()
        sender.close()


@pytest.mark.timeout(60)
def test_shutdown_and_close_leave_no_reference_to_the_collector() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    with start_method("fork"):
        collector = build("sync", sender, [partial(make_counter_env, label=i) for i in range(2)])
    next(iter(collector))
    ref = weakref.ref(collector)
    collector.shutdown()
    sender.close()
    del collector, sender
    gc.collect()
    assert ref() is None
