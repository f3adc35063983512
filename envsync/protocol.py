"""Pure rules of the envsync protocol: versions, acknowledgements, what "done" means.

No I/O and no processes here. The sender writes a *target* version per worker; a worker
acknowledges twice: ``received`` once it has seen the target and armed it for its next safe
point, ``applied`` once the env runs it. A failure is reported as the version that failed.

Call order of one push (sender side)::

    validate -> write desired state of each targeted worker -> set target -> wake worker
    -> wait until every targeted worker is done (see :func:`is_done`)
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np

NO_FAILURE = -1
"""Value of :attr:`WorkerStatus.failed` while a worker has never failed."""


class ApplyAt(enum.StrEnum):
    """Where a worker applies a new version (see the apply-mode table in the docs).

    Examples:
        >>> ApplyAt("truncate") is ApplyAt.TRUNCATE
        True
    """

    RESET = "reset"
    STEP = "step"
    TRUNCATE = "truncate"


class Until(enum.StrEnum):
    """What a push or a wait blocks for.

    Examples:
        >>> Until("applied").value
        'applied'
    """

    RECEIVED = "received"
    APPLIED = "applied"


class Kind(enum.IntEnum):
    """What a request asks of an env; each kind has one handler on the worker side (the
    receiver's, or for :attr:`BATCHED_STATE` the batched env's level) and one sender
    function (:mod:`envsync.sender.gather`). The links move requests without looking at the kind.

    Examples:
        >>> Kind(2) is Kind.BATCHED_STATE
        True
    """

    ENV_STATE = 1
    """The current values of env-state entries of one env (``payload["names"]``)."""
    BATCHED_STATE = 2
    """The current values of a batched env's own entries (``batched.*``), answered once per
    worker by the batched env's level on its first env's slot (``payload["names"]``)."""
    ATTRIBUTES = 3
    """What an env holds at attribute paths (``payload["paths"]``, resolved along the env's
    wrapper chain as :func:`envsync.apply.attributes` resolves them; one world's row of a
    natively batched env's per-world array)."""


class Request(NamedTuple):
    """A request to one env's worker: an id (increasing per sender), a kind and its payload
    (plain values: names, paths).

    Examples:
        >>> Request(3, Kind.ENV_STATE, {"names": ["norm.loc"]}).kind.name
        'ENV_STATE'
    """

    id: int
    kind: Kind
    payload: dict[str, Any]


class Reply(NamedTuple):
    """A worker's reply to request ``id``: its result (tensors by name), or, when handling
    the request raised, the worker's traceback (``error``; the result is then empty). A
    failure to answer is typed, so it can never read as a failure to apply a version.

    Examples:
        >>> Reply(3, {}, "Traceback ...").failed, Reply(4, {}).failed
        (True, False)
    """

    id: int
    result: dict[str, Any]
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None


class WorkerStatus(NamedTuple):
    """A snapshot of one worker's acknowledgements (a tuple: read on every push's path).

    Args:
        worker: the worker index.
        target: the latest version published to this worker.
        received: the latest version the worker has seen and armed.
        applied: the version its env runs now (every level of it: an env under a batched
            level counts a version once that level holds it too).
        failed: the latest version it failed to apply, or :data:`NO_FAILURE`.
        reached: the version the env's own level holds (its entries, and the statistics they
            carry): ``applied``, or ahead of it while a batched level above waits or failed.

    Examples:
        >>> s = WorkerStatus(worker=0, target=3, received=3, applied=2, failed=NO_FAILURE, reached=2)
        >>> is_done(s, 3, Until.RECEIVED), is_done(s, 3, Until.APPLIED)
        (True, False)
    """

    worker: int
    target: int
    received: int
    applied: int
    failed: int
    reached: int


def is_done(status: WorkerStatus, version: int, until: Until) -> bool:
    """Tell whether a worker has reached ``version`` (or everything it was asked up to it).

    A worker that was not targeted by ``version`` owes only the versions it was sent, so it
    is done once it has acknowledged ``min(version, target)``.

    Args:
        status: the worker's acknowledgements.
        version: the version waited for.
        until: ``RECEIVED`` or ``APPLIED``.

    Returns:
        ``True`` when nothing up to ``version`` is outstanding for this worker.

    Examples:
        >>> s = WorkerStatus(worker=1, target=2, received=2, applied=2, failed=NO_FAILURE, reached=2)
        >>> is_done(s, 5, Until.APPLIED)  # worker 1 was not targeted by 3..5
        True
    """
    owed = min(version, status.target)
    acked = status.received if until is Until.RECEIVED else status.applied
    return acked >= owed


def owes(status: WorkerStatus, version: int, until: Until) -> bool:
    """Tell whether a sender waiting for ``version`` must still wait for this worker: it is
    not done (see :func:`is_done`) and has not failed the version it owes (a failure ends
    the wait, with the failure raised).

    Examples:
        >>> s = WorkerStatus(worker=0, target=3, received=3, applied=2, failed=NO_FAILURE, reached=2)
        >>> owes(s, 3, Until.APPLIED), owes(s._replace(failed=3), 3, Until.APPLIED)
        (True, False)
    """
    return any_owing(counts_of([status], until), version)


Counts = tuple[np.ndarray, np.ndarray, np.ndarray]
"""Per worker, as int64 columns: its target, its acknowledgement (received or applied,
whichever is waited for) and its latest failed version (how a link reads its counters: one
vector read, whatever the number of envs)."""


def columns(rows: Iterable[tuple[int, int, int]]) -> Counts:
    """:data:`Counts` from ``(target, acknowledgement, failed)`` triples.

    Examples:
        >>> [c.tolist() for c in columns([(3, 2, -1), (4, 4, -1)])]
        [[3, 4], [2, 4], [-1, -1]]
    """
    table = np.array(list(rows), dtype=np.int64).reshape(-1, 3)
    return table[:, 0], table[:, 1], table[:, 2]


def any_owing(counts: Counts, version: int) -> bool:
    """Tell whether a sender waiting for ``version`` must still wait for any of these
    workers' ``counts`` (the rule of :func:`owes`, on columns: the links' ``wait_acks``).

    Examples:
        >>> any_owing(columns([(3, 2, NO_FAILURE)]), 3), any_owing(columns([(3, 2, 3)]), 3)
        (True, False)
        >>> any_owing(columns([(2, 2, NO_FAILURE)]), 5)
        False
    """
    target, acked, failed = counts
    owed = np.minimum(target, version)
    return bool(((acked < owed) & (failed < owed)).any())


def all_settled(counts: Counts, version: int) -> bool:
    """Tell whether every one of these workers is done with ``version`` (:func:`is_done`)
    and none has ever failed a version: the common end of a wait, with nothing to raise.

    Examples:
        >>> all_settled(columns([(3, 3, NO_FAILURE), (2, 2, NO_FAILURE)]), 3), all_settled(columns([(3, 3, 1)]), 3)
        (True, False)
    """
    target, acked, failed = counts
    return bool(((acked >= np.minimum(target, version)) & (failed == NO_FAILURE)).all())


def counts_of(statuses: Iterable[WorkerStatus], until: Until) -> Counts:
    """The :data:`Counts` of status snapshots, acknowledged as ``until`` asks."""
    received = until is Until.RECEIVED
    return columns((s.target, s.received if received else s.applied, s.failed) for s in statuses)


def failure_to_raise(status: WorkerStatus, reported: int, waited: int | None = None) -> int | None:
    """Return the failed version the main process has to raise, if any: one not raised yet,
    or, for a caller waiting for version ``waited``, that version's failure even if another
    caller raised it already (each waiter learns of its own version's failure).

    Args:
        status: the worker's acknowledgements.
        reported: the latest failed version already raised for this worker.
        waited: the version a ``wait`` is waiting for, if any.

    Examples:
        >>> s = WorkerStatus(worker=0, target=4, received=4, applied=3, failed=4, reached=4)
        >>> failure_to_raise(s, reported=NO_FAILURE), failure_to_raise(s, reported=4)
        (4, None)
        >>> failure_to_raise(s, reported=4, waited=4)
        4
    """
    if status.failed != NO_FAILURE and (status.failed > reported or status.failed == waited):
        return status.failed
    return None
