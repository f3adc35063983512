"""The slot locks and wake-ups both sides of a slot table take (:mod:`envsync.links.slots`
for the sender, :mod:`envsync.links.slot_reader` and :mod:`envsync.links.rows_reader` for a
worker), and the error text a worker writes.

A slot lock held longer than any write takes means a dead holder: taking it raises, naming
what was being done. Slots of one group (the rows of a natively batched env) share one lock,
one wake-up and one relay (:func:`per_slot`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from envsync.errors import EnvSyncError

_LOCK_TIMEOUT = 10.0


def acquire(lock: Any, what: str, *args: Any) -> None:
    """Take a slot lock; one held longer than any write takes means a dead holder: raise,
    naming ``what % args`` (formatted only then: this is on every push's path)."""
    if not lock.acquire(timeout=_LOCK_TIMEOUT):
        raise EnvSyncError(f"{what % args}: slot lock not released in {_LOCK_TIMEOUT} s (its holder died?)")


@contextmanager
def all_locked(locks: Sequence[Any], what: str, *args: Any) -> Iterator[None]:
    """Hold every lock of ``locks`` (distinct, always taken in the same order: no deadlock
    with a worker, which takes only its own) for a ``with`` block."""
    held = 0
    try:
        for lock in locks:
            acquire(lock, what, *args)
            held += 1
        yield
    finally:
        for lock in locks[:held]:
            lock.release()


def take_back(semaphore: Any) -> None:
    """Take every release made so far of ``semaphore`` (without blocking)."""
    while semaphore.acquire(False):
        pass


class locked:  # noqa: N801 (used as a ``with`` statement, like a function)
    """Hold a slot lock for a ``with`` block: ``with locked(lock, "writing worker %d", w)``.
    A lock held longer than any write takes means a dead holder: raise, naming ``what % args``
    (formatted only then: this is on every push's path)."""

    __slots__ = ("_lock",)

    def __init__(self, lock: Any, what: str, *args: Any) -> None:
        acquire(lock, what, *args)
        self._lock = lock

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def per_slot(locks: Sequence[Any], wakes: Sequence[Any], num_workers: int, group: int) -> tuple[list[Any], list[Any]]:
    """Each slot's lock, and its wake-up then its relay, from those of its group (the same
    objects for every slot of a group): the lists a slot table's writer and readers index by slot.

    Examples:
        >>> per_slot(["l0", "l1"], ["w0", "w1", "r0", "r1"], 3, 2)
        (['l0', 'l0', 'l1'], ['w0', 'w0', 'w1', 'r0', 'r0', 'r1'])
    """
    groups = len(locks)
    slot_locks = [locks[s // group] for s in range(num_workers)]
    slot_wakes = [wakes[s // group] for s in range(num_workers)]
    slot_relays = [wakes[groups + s // group] for s in range(num_workers)]
    return slot_locks, slot_wakes + slot_relays


def distinct(locks: Sequence[Any]) -> list[Any]:
    """``locks`` without repeats, in their order (slots of one group share a lock: a
    broadcast takes it once)."""
    return list({id(lock): lock for lock in locks}.values())


def ascending(numbers: np.ndarray) -> list[int]:
    """The distinct values of ``numbers`` (int64), ascending: a Python set for a few (a push to
    a handful of workers, where ``np.unique``'s dozen calls cost more than the rest of the
    write), :func:`firsts` for many.

    Examples:
        >>> ascending(np.array([3, 1, 3])), ascending(np.arange(100) // 50)
        ([1, 3], [0, 1])
    """
    if len(numbers) <= 64:
        return sorted(set(numbers.tolist()))
    return firsts(numbers)[0].tolist()


def firsts(numbers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(numbers, return_index=True)``: the distinct values, ascending, and where
    each is first; without a sort when they are all one (the rows of one env object).

    Examples:
        >>> [a.tolist() for a in firsts(np.array([4, 4, 4]))], [a.tolist() for a in firsts(np.array([2, 1, 2]))]
        ([[4], [0]], [[1, 2], [1, 0]])
    """
    if len(numbers) and numbers.min() == numbers.max():
        return numbers[:1].copy(), np.zeros(1, dtype=np.int64)
    return np.unique(numbers, return_index=True)


def numbered(objects: Sequence[Any]) -> np.ndarray:
    """Per entry, the index of the first entry holding the same object.

    Examples:
        >>> a, b = object(), object()
        >>> numbered([a, a, b, a]).tolist()
        [0, 0, 2, 0]
    """
    first: dict[int, int] = {}
    return np.array([first.setdefault(id(o), i) for i, o in enumerate(objects)], dtype=np.int64)


class Released:
    """What a released writer holds instead of its locks and semaphores: any use of them is
    a use of a closed link."""

    def __getitem__(self, index: int) -> Any:
        raise RuntimeError("link is closed")

    def __iter__(self) -> Any:
        raise RuntimeError("link is closed")
