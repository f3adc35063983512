"""The sender's record of past configs: which config each env ran under each version.

A frame names its env (``env_index``) and the version its env applied (``env_version``);
together they name the config that produced it, but only while the sender remembers what it
published. :class:`ConfigHistory` keeps one *record* per publication: its version, the envs
it reached and their whole config from then on, as columns (a leaf the same for all of
them kept once). Each env's records are chained newest first (per env, the record and row
of its latest entry; per record and row, the one before: two numbers for the whole record
when its rows' previous entries are one record's rows in order, as after a push to every
env), so a record costs a few vector ops whatever the number of envs, and a look-up walks
from the env's newest entry back to the version asked for (frames are read soon after they
are made: a few steps).

It forgets versions no frame can still carry: an env's frames carry its applied version or
newer ones, and frames already collected (a batch in flight, a batch the user holds) carry
older ones, so past the entry in effect at the env's applied version the history keeps only
the ``keep`` newest entries of each env, and of those only as many as fit in ``keep_bytes``
(a large config pushed often would otherwise hold ``keep`` payloads). It prunes once
``keep_bytes`` were recorded, or once both ``SLACK`` records (``keep`` records, if more) and
as many entries as the last prune kept were recorded: records of many rows walked newest
first, each ranked against per-env running columns, records of a few rows in one table
sorted by env (:mod:`envsync.sender.pruning`), and the records no env needs are dropped. A
prune costs a few vector passes over the entries it finds, at most twice those it keeps:
paid once per entry recorded, whatever the number of worlds (the sorted table alone, every
64 records, cost 8 ms a push with 65,536 worlds and a 10% curriculum; the walk alone 150k
instructions a push to 4 workers). Between prunes the history holds at most twice the
entries a prune keeps, plus one record.

Leaves are never written after they are recorded: shared ones are the sender's own (never
changed once published, see :mod:`envsync.sender.desired`), rows are copies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from tensordict import TensorDict

from envsync.errors import ValidationError
from envsync.indexing import Rows, span_of
from envsync.links.base import Flat
from envsync.sender.desired import section
from envsync.sender.pruning import kept_rows
from envsync.state import Leaf, nest

SLACK = 16
"""Records between two prunes at least (``keep`` if larger; a prune reads every env's applied
version once and makes one table of every kept entry), and at least as many entries as the
last prune kept."""

Applied = Callable[[np.ndarray], np.ndarray]
"""The version each of these envs (fleet indices) applied."""


@dataclass
class _Record:
    version: int
    targets: Rows  # the envs it reached (a slice when consecutive: every env of a collector)
    shared: dict[str, Leaf]
    rows: dict[str, torch.Tensor]
    before: np.ndarray | int  # per row, the number of the env's previous record (-1: none); one for all
    before_row: np.ndarray | int  # and its row there; one record's rows in order: the first's
    alive: np.ndarray  # per row, still kept
    row_bytes: int  # the bytes of one row of ``rows``
    shared_bytes: tuple[tuple[int, int], ...]  # per shared leaf, its id and bytes (counted once, see pruning)

    def config(self, row: int) -> dict[str, Leaf]:
        return {**self.shared, **{k: v[row] for k, v in self.rows.items()}}

    def previous(self, row: int) -> tuple[int, int]:
        """The record and row of the env's entry before this one's row ``row``."""
        if isinstance(self.before, int):  # one record's rows in order (:func:`_chain`): both numbers
            return self.before, int(self.before_row) + row if self.before >= 0 else 0
        return int(self.before[row]), int(self.before_row[row])  # type: ignore[index]


class Entry(NamedTuple):
    """One env's config of one version as the history keeps it: a record and its row."""

    record: _Record
    row: int

    def leaves(self) -> dict[str, Leaf]:
        """The config's values by dotted name (read them, do not write into them)."""
        return self.record.config(self.row)

    def config(self) -> TensorDict:
        """The config as a ``TensorDict`` shaped like the template, of copies of its own."""
        return nest(self.leaves(), copy=True)


def _chain(before: np.ndarray, before_row: np.ndarray) -> tuple[np.ndarray | int, np.ndarray | int]:
    """The links to the previous entries, kept as two numbers when they all point into one
    record's rows in order (a push to every env after another one): no 16 bytes an entry."""
    if not len(before) or before[0] != before[-1] or not bool((before == before[0]).all()):
        return before, before_row
    if before[0] < 0:
        return -1, 0
    first = int(before_row[0])
    if bool((before_row == np.arange(first, first + len(before_row))).all()):
        return int(before[0]), first
    return before, before_row


def _nbytes(leaf: Leaf) -> int:
    return int(getattr(leaf, "nbytes", 8))


class ConfigHistory:
    """Per env, the config of every version published to it that a frame may still carry.

    Args:
        keep: how many entries older than the one in effect at an env's applied version are
            kept for frames already collected (batches in flight or held by the user).
        keep_bytes: the most bytes those older entries of an env may hold together (a leaf
            that a newer entry holds too is counted with that one); the newest of them is
            kept whatever its size.

    Examples:
        >>> import numpy as np
        >>> history = ConfigHistory(keep=1)
        >>> history.record(0, {0: {("config", "difficulty"): np.float32(0.0)}})
        >>> history.record(3, {0: {("config", "difficulty"): np.float32(0.5)}})
        >>> history.config(0, 2)["difficulty"].item()  # version 2 never reached env 0: it ran 0
        0.0
        >>> history.config(0, 7)["difficulty"].item()
        0.5
    """

    def __init__(self, keep: int = 64, keep_bytes: int = 64 << 20) -> None:
        if not isinstance(keep, int) or keep < 0:
            raise ValidationError(f"keep must be a non-negative int, got {keep!r}")
        if not isinstance(keep_bytes, int) or keep_bytes < 0:
            raise ValidationError(f"keep_bytes must be a non-negative int, got {keep_bytes!r}")
        self.keep = keep
        self.keep_bytes = keep_bytes
        self._records: dict[int, _Record] = {}  # by number, oldest first
        self._next = 0
        self._latest = np.full(0, -1, dtype=np.int64)  # per env: the number of its latest record
        self._latest_row = np.zeros(0, dtype=np.int64)
        self._latest_version = np.zeros(0, dtype=np.int64)
        self._newest = -1  # the newest version recorded (for any env)
        self._since_prune = 0
        self._bytes_since = 0  # bytes recorded since the last prune
        self._entries_since = 0  # entries (rows) recorded since the last prune
        self._kept = 0  # entries the last prune kept

    def record(self, version: int, configs: Mapping[int, Flat], applied: Applied | None = None) -> None:
        """Note that each env in ``configs`` (fleet index to its desired leaves, of which the
        ``"config"`` section is kept) runs that config from ``version`` on (one
        :meth:`record_rows` of them)."""
        envs = list(configs)
        flats = [section(configs[e], "config") for e in envs]
        shared: dict[str, Leaf] = {}
        rows: dict[str, torch.Tensor] = {}
        for name in dict.fromkeys(n for flat in flats for n in flat):
            first = flats[0].get(name)
            if all(flat.get(name) is first for flat in flats):
                shared[name] = first  # type: ignore[assignment]
            else:
                rows[name] = torch.stack([torch.as_tensor(np.asarray(flat[name])) for flat in flats])
        self.record_rows(version, np.asarray(envs, dtype=np.int64), shared, rows, applied)

    def record_rows(
        self,
        version: int,
        envs: np.ndarray,
        shared: Mapping[str, Leaf],
        rows: Mapping[str, torch.Tensor],
        applied: Applied | None = None,
    ) -> None:
        """Note that the envs ``envs`` (distinct fleet indices) run from ``version`` on the
        config ``shared`` (the same for all) plus one row each of ``rows`` (copies: the
        history keeps them).

        An env's entries at ``version`` or later are dropped (an env index numbered again
        after every collector left starts over). With ``applied``, which tells the version
        each env applied, the history is pruned when due (see the module docstring).
        """
        if not len(envs):
            return
        self._grow(int(envs.max()) + 1)
        at = span_of(envs)  # every env of a collector: slices
        chain, in_order = self._before(at, version)
        self._newest = max(self._newest, version)
        number = self._next
        self._next += 1
        alive = np.ones(len(envs), dtype=bool)
        row_bytes = sum(_nbytes(v) // len(envs) for v in rows.values())  # a row of each column
        shared_bytes = tuple((id(v), _nbytes(v)) for v in shared.values())
        record = _Record(version, at, dict(shared), dict(rows), *chain, alive, row_bytes, shared_bytes)
        self._records[number] = record
        self._latest[at] = number
        if not in_order:
            self._latest_row[at] = np.arange(len(envs))
        self._latest_version[at] = version
        self._since_prune += 1
        self._entries_since += len(envs)
        self._bytes_since += row_bytes * len(envs) + sum(nbytes for _, nbytes in shared_bytes)
        # a prune reads every entry: due once as many were recorded as it kept last time
        due = self._since_prune >= max(SLACK, self.keep) and self._entries_since >= self._kept
        if applied is not None and (due or self._bytes_since > self.keep_bytes):
            self.prune(applied)

    def _before(self, at: Rows, version: int) -> tuple[tuple[np.ndarray | int, np.ndarray | int], bool]:
        """The links of a new record of envs ``at`` to their previous entries (:func:`_chain`),
        and whether each env's latest entry is already its row of the latest record, in order.
        That is so when the latest record was this very run of envs and ``version`` is newer
        than every recorded one (a push to every env after another): two numbers, no pass over
        the envs (at 65,536 worlds three copies and compares of every env's links a push)."""
        last = self._records.get(self._next - 1)
        previous_run = last.targets if last is not None and isinstance(last.targets, slice) else None
        if isinstance(at, slice) and previous_run == at and version > self._newest:
            return (self._next - 1, 0), True
        before, before_row = self._latest[at].copy(), self._latest_row[at].copy()  # kept by the record
        if version <= self._newest:  # only envs numbered again can hold an entry at or after it
            again = (before >= 0) & (self._latest_version[at] >= version)
            for position in np.flatnonzero(again).tolist():
                before[position], before_row[position] = self._first_before(
                    int(before[position]), int(before_row[position]), version
                )
        return _chain(before, before_row), False

    def _first_before(self, number: int, row: int, version: int) -> tuple[int, int]:
        """The newest entry of a chain, from ``(number, row)`` on, older than ``version``."""
        while number >= 0:
            record = self._records.get(number)
            if record is None or not record.alive[row]:
                return -1, 0
            if record.version < version:
                return number, row
            record.alive[row] = False  # replaced: the env starts over
            number, row = record.previous(row)
        return -1, 0

    def _grow(self, size: int) -> None:
        if size > len(self._latest):
            more = max(size, 2 * len(self._latest)) - len(self._latest)
            self._latest = np.concatenate([self._latest, np.full(more, -1, dtype=np.int64)])
            self._latest_row = np.concatenate([self._latest_row, np.zeros(more, dtype=np.int64)])
            self._latest_version = np.concatenate([self._latest_version, np.zeros(more, dtype=np.int64)])

    def prune(self, applied: Applied) -> None:
        """Drop the entries no frame can still carry (see the module docstring), those
        :func:`~envsync.sender.pruning.kept_rows` does not keep."""
        self._since_prune = self._bytes_since = self._entries_since = self._kept = 0
        numbers = list(self._records)[::-1]
        records = [self._records[number] for number in numbers]
        if not records:
            return
        reached_version = applied(np.arange(len(self._latest), dtype=np.int64))
        # an index with no entry (the columns grow by doubling) counts as done from the start
        keeps, kept = kept_rows(records, reached_version, self.keep, self.keep_bytes, unused=self._latest < 0)
        for number, keep, count in zip(numbers, keeps, kept, strict=True):
            if count:
                self._records[number].alive = keep
                self._kept += count
            else:
                del self._records[number]

    def config(self, env: int, version: int) -> TensorDict:
        """The config env ``env`` ran under ``version`` (a ``TensorDict`` shaped like the
        template: the latest version published to that env at or before ``version``).

        Raises:
            ValidationError: the env never ran that version, or the entry was pruned.
        """
        return self.entry(env, version).config()

    def entry(self, env: int, version: int) -> Entry:
        """Where the history holds :meth:`config` (its values by dotted name: ``.leaves()``),
        found without reading it (a record is never written again once made: the entry
        stays right after the history forgot it).

        Raises:
            ValidationError: the env never ran that version, or the entry was pruned.
        """
        number = int(self._latest[env]) if 0 <= env < len(self._latest) else -1
        if number < 0 or number not in self._records:
            known = sorted(np.flatnonzero(self._latest >= 0).tolist())
            raise ValidationError(f"env {env} has no recorded config; envs with one are {known}")
        row = int(self._latest_row[env])
        oldest = None
        while number >= 0:
            record = self._records.get(number)
            if record is None or not record.alive[row]:
                break
            if record.version <= version:
                return Entry(record, row)
            oldest = record.version
            number, row = record.previous(row)
        raise ValidationError(
            f"env {env} has no config at version {version}: its oldest kept version is {oldest} "
            f"(older ones were never published to it, or were pruned: raise the sender's config_history.keep)"
        )

    def versions(self, env: int) -> list[int]:
        """The versions kept for env ``env``, oldest first (each starts a config)."""
        out = []
        number = int(self._latest[env]) if 0 <= env < len(self._latest) else -1
        row = int(self._latest_row[env]) if number >= 0 else 0
        while number >= 0:
            record = self._records.get(number)
            if record is None or not record.alive[row]:
                break
            out.append(record.version)
            number, row = record.previous(row)
        return out[::-1]
