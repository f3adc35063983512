"""Which entries of the config history a prune keeps (:mod:`envsync.sender.history` records
and looks them up; this decides, from the records alone, what a prune drops).

Per env, a prune keeps its entry in effect (the newest at or before the version the env
applied), every newer one, and of the older ones the ``keep`` newest that fit in
``keep_bytes`` together (the newest of them whatever its size). Records of many rows
(:data:`WALK` on average or more: a curriculum over thousands of worlds) are walked newest
first against per-env running columns, a few vector operations a record, and the walk stops
once every env is past its entry in effect and ``keep`` older ones (what is left is dropped
whole); records of a few rows (a push to a few workers) go into one table sorted by env, a
few dozen vector operations in all (the walk would make a few per record: 150k instructions a
push at 4 workers). Both give the same answer (``tests/test_history.py`` checks it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from envsync.indexing import Rows

WALK = 256
"""Rows a record holds on average from which a prune walks the records one by one rather than
sorting every entry by env."""


class Record(Protocol):
    """What a prune reads of a history record."""

    version: int
    targets: Rows  # the envs it reached (a slice when consecutive)
    alive: np.ndarray  # per row, still kept
    row_bytes: int  # the bytes of one row of its own values
    shared_bytes: tuple[tuple[int, int], ...]  # per shared leaf, its id and bytes


def kept_rows(
    records: Sequence[Record], reached_version: np.ndarray, keep: int, keep_bytes: int, *, unused: np.ndarray
) -> tuple[list[np.ndarray], list[int]]:
    """Per record (newest first), a mask of the rows a prune keeps and how many.

    Args:
        records: every record of the history, newest first.
        reached_version: per env index, the version the env applied.
        keep: the older entries kept per env (see :class:`~envsync.sender.history.ConfigHistory`).
        keep_bytes: the bytes those older entries may hold together.
        unused: per env index, whether no entry was ever recorded for it.
    """
    sizes = _sizes(records)
    lengths = np.array([len(record.alive) for record in records])
    if int(lengths.sum()) >= WALK * len(records):
        keeps = _walk(records, sizes, reached_version, keep, keep_bytes, unused)
        return keeps, [int(np.count_nonzero(mask)) for mask in keeps]
    return _sorted(records, lengths, sizes, reached_version, keep, keep_bytes)


def _sizes(records: Sequence[Record]) -> list[int]:
    """The bytes an entry of each record (newest first) counts: its row, and its shared
    leaves no newer record holds (a shared leaf counts with the newest record that holds it)."""
    counted: set[int] = set()
    sizes = []
    for record in records:
        size = record.row_bytes
        for identity, nbytes in record.shared_bytes:
            if identity not in counted:
                counted.add(identity)
                size += nbytes
        sizes.append(size)
    return sizes


def _walk(
    records: Sequence[Record],
    sizes: list[int],
    reached_version: np.ndarray,
    keep: int,
    keep_bytes: int,
    unused: np.ndarray,
) -> list[np.ndarray]:
    """Per record (newest first), its rows kept: each record against per-env running
    columns (the entry in effect found yet, the older entries and their bytes so far)."""
    size = len(reached_version)
    found = unused.copy()  # per env: its entry in effect is behind us (an unused index: done)
    older = np.where(unused, keep, 0).astype(np.int64)  # the entries older than it so far
    held = np.zeros(size, dtype=np.int64)  # and their bytes
    keeps = []
    done = False  # every env past its entry in effect and `keep` older ones: the rest goes
    for record, nbytes in zip(records, sizes, strict=True):
        envs, live = record.targets, record.alive
        if done:
            keeps.append(np.zeros(len(live), dtype=bool))
            continue
        past = live & found[envs]
        if past.any():
            older[envs] += past
            held[envs] += past * nbytes
            rank, bytes_ = older[envs], held[envs]
            live = live & (~past | ((rank <= keep) & ((rank == 1) | (bytes_ <= keep_bytes))))
        found[envs] |= live & (record.version <= reached_version[envs])
        keeps.append(live)
        # after a record over a run of envs (a push to every env gives each an older entry),
        # two reads tell whether every older record left is dropped whole: pushes to every
        # world walk half the records a prune finds (20 -> 11.7 ms a prune at 65,536 worlds)
        if isinstance(envs, slice) and found.all() and older.min() >= keep:
            done = True
    return keeps


def _sorted(
    records: Sequence[Record],
    lengths: np.ndarray,
    sizes: list[int],
    reached_version: np.ndarray,
    keep: int,
    keep_bytes: int,
) -> tuple[list[np.ndarray], list[int]]:
    """:func:`_walk`'s answer from one table of every entry (newest record first) grouped
    by env by one stable sort: the entry in effect, the rank and the bytes of the older
    ones by cumulative sums within each env's group; and how many each record keeps (one
    sum per record, made at once)."""
    envs = np.concatenate([_indices(record.targets) for record in records])
    alive = np.concatenate([record.alive for record in records])
    versions = np.repeat(np.array([record.version for record in records], dtype=np.int64), lengths)
    size = np.repeat(np.array(sizes, dtype=np.int64), lengths)
    reached = versions <= reached_version[envs]
    order = np.argsort(envs, kind="stable")  # each env's entries together, newest first
    e, live = envs[order], alive[order]
    starts = np.flatnonzero(np.r_[True, e[1:] != e[:-1]])
    group = np.cumsum(np.r_[False, e[1:] != e[:-1]])
    at = np.arange(len(e))
    # the entry in effect: the env's newest live entry at or before its applied version
    in_effect = np.minimum.reduceat(np.where(reached[order] & live, at, len(e)), starts)[group]
    past = (at > in_effect) & live  # older than it
    rank = _within(np.cumsum(past), starts, group)  # 1 for the newest of the older entries
    held = _within(np.cumsum(np.where(past, size[order], 0)), starts, group)
    kept_past = past & (rank <= keep) & ((rank == 1) | (held <= keep_bytes))
    kept = np.empty(len(e), dtype=bool)
    kept[order] = live & (~past | kept_past)
    ends = np.cumsum(lengths)
    counts = np.add.reduceat(kept, ends - lengths).tolist()  # every record holds a row at least
    return [kept[end - length : end] for end, length in zip(ends.tolist(), lengths.tolist(), strict=True)], counts


def _indices(targets: Rows) -> np.ndarray:
    """A record's envs as indices (its slice's, when it names a run of them)."""
    return np.arange(targets.start, targets.stop, dtype=np.int64) if isinstance(targets, slice) else targets


def _within(running: np.ndarray, starts: np.ndarray, group: np.ndarray) -> np.ndarray:
    """A cumulative sum restarted at each group's start (``running``: the sum over all rows)."""
    before = np.r_[0, running][starts]  # the sum before each group
    return running - before[group]
