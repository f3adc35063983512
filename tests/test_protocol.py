"""envsync.protocol: what "done" means for a worker."""

from __future__ import annotations

from envsync.protocol import NO_FAILURE, ApplyAt, Until, WorkerStatus, failure_to_raise, is_done


def status(target: int, received: int, applied: int, failed: int = NO_FAILURE) -> WorkerStatus:
    return WorkerStatus(worker=0, target=target, received=received, applied=applied, failed=failed, reached=applied)


def test_a_targeted_worker_is_done_once_it_acknowledged_the_version() -> None:
    assert not is_done(status(3, 2, 2), 3, Until.RECEIVED)
    assert is_done(status(3, 3, 2), 3, Until.RECEIVED)
    assert not is_done(status(3, 3, 2), 3, Until.APPLIED)
    assert is_done(status(4, 4, 4), 3, Until.APPLIED)  # went straight past it


def test_a_worker_not_targeted_owes_only_what_it_was_sent() -> None:
    assert is_done(status(2, 2, 2), 5, Until.APPLIED)
    assert not is_done(status(2, 2, 1), 5, Until.APPLIED)


def test_each_failure_is_raised_once() -> None:
    assert failure_to_raise(status(4, 4, 3, failed=4), NO_FAILURE) == 4
    assert failure_to_raise(status(4, 4, 3, failed=4), 4) is None
    assert failure_to_raise(status(4, 4, 4), NO_FAILURE) is None


def test_modes_parse_from_strings() -> None:
    assert [ApplyAt(m) for m in ("reset", "step", "truncate")] == list(ApplyAt)
