"""Fleet numbering: attach order, holes left by departed collectors, asked-for first envs."""

from __future__ import annotations

import pytest
import torch

from envsync import ValidationError
from envsync.fleet import Attachment, Fleet
from envsync.links.local import LocalLink

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
