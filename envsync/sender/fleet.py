"""The fleet: every env of every worker of every collector attached to one sender.

Workers are numbered in attach order (collector 0's workers first), and envs worker by
worker, then in each batched env's order; an unbatched worker drives one env, whose index is
the worker's. A link has one slot per env, so the sender works on env indices and translates
``workers=`` into the envs of those workers. Indices never shift while the sender lives: a
collector that shuts down leaves holes, and only when no collector is left does numbering
start again at 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from envsync.errors import ValidationError
from envsync.indexing import Indices
from envsync.links.base import Flat, SenderLink
from envsync.sender.mirror import Mirror


@dataclass(eq=False)
class Attachment:
    """One collector attached to a sender, made by an integration.

    Args:
        link: the link to the collector's workers.
        detached: tells whether the collector has been shut down.
        on_close: run when the attachment ends (e.g. stop an in-process receiver).
        envs_per_worker: how many envs each worker drives.
        collectors: how many workers each collector behind the link has, in order (a
            ``RayCollector`` is one attachment over several remote collectors); ``None``:
            one collector with every worker of the link.
        outside: an env outside any collector (``attach_env``): it receives every version,
            but ``sync_stats`` does not count its observations and checkpoints keep no row
            for it.
        mirror: the desired state the sender published to each slot, as columns (set by
            :meth:`Fleet.add`).
    """

    link: SenderLink
    detached: Callable[[], bool]
    on_close: Callable[[], None] = lambda: None
    envs_per_worker: int = 1
    collectors: Sequence[int] | None = None
    outside: bool = False
    offset: int = 0
    worker_offset: int = 0
    index: int = 0
    mirror: Mirror = field(default_factory=lambda: Mirror({}, 0))

    @property
    def num_workers(self) -> int:
        """How many workers the attached collector(s) have (the link has a slot per env)."""
        return self.link.num_workers // self.envs_per_worker


@dataclass(frozen=True)
class Part:
    """The targets of a push (or a wait) that one attachment holds.

    Args:
        attachment: the attachment.
        positions: where they sit among the targets (``None``: all of them, in order).
        slots: their slots on the attachment's link.
    """

    attachment: Attachment
    positions: np.ndarray | None
    slots: np.ndarray


@dataclass(frozen=True)
class Member:
    """One worker of the fleet, as :meth:`~envsync.EnvStateSender.fleet` describes it.

    Args:
        index: the worker's fleet index.
        collector: the collector's number, in attach order.
        worker: the worker's index within its collector.
        envs: how many envs the worker drives.
        first_env: the fleet index of its first env (its envs follow in order).
    """

    index: int
    collector: int
    worker: int
    envs: int
    first_env: int = 0


class Fleet:
    """The live attachments of a sender, and the map from fleet index to link and worker."""

    def __init__(self) -> None:
        self.attachments: list[Attachment] = []
        self._next_offset = 0
        self._next_worker = 0
        self._next_collector = 0
        self._index_array: tuple[tuple[tuple[int, int, int], ...], np.ndarray] = ((), np.zeros(0, dtype=np.int64))

    def add(self, attachment: Attachment, start: Flat, first_env: int | None = None) -> None:
        """Number the attachment's workers and envs after every earlier one; mirror ``start``.

        ``first_env`` asks for the index of its first env: an integration whose workers are
        numbered before they attach (a ``RayCollector``'s, from :meth:`next_env`) gets the
        numbers they carry, even if a collector left in between. Envs skipped that way count
        as unbatched workers, so worker indices stay unique too.

        Raises:
            ValidationError: ``first_env`` is below :meth:`next_env` (a collector attached
                in between holds, or held, those indices).
        """
        if not self.attachments:
            self._next_offset = 0
            self._next_worker = 0
            self._next_collector = 0
        if first_env is not None:
            if first_env < self._next_offset:
                raise ValidationError(
                    f"the collector's envs were numbered from {first_env}, but a collector attached since "
                    f"took indices up to {self._next_offset - 1}"
                )
            self._next_worker += first_env - self._next_offset
            self._next_offset = first_env
        attachment.offset = self._next_offset
        attachment.worker_offset = self._next_worker
        attachment.index = self._next_collector
        attachment.mirror = Mirror(start, attachment.link.num_workers)
        self._next_offset += attachment.link.num_workers
        self._next_worker += attachment.num_workers
        self._next_collector += len(attachment.collectors or [attachment.num_workers])
        self.attachments.append(attachment)

    def next_env(self) -> int:
        """The index the next attachment's first env gets (0 once no collector is left)."""
        return self._next_offset if self.attachments else 0

    def prune(self) -> list[Attachment]:
        """Drop the attachments whose collector shut down; return them."""
        gone = [a for a in self.attachments if a.detached()]
        for attachment in gone:
            self.attachments.remove(attachment)
        return gone

    def indices(self) -> list[int]:
        """The fleet indices of every live env, in order."""
        return [a.offset + e for a in self.attachments for e in range(a.link.num_workers)]

    def collected(self) -> list[int]:
        """The fleet indices of the live envs that collectors drive (not those outside any)."""
        return [a.offset + e for a in self.attachments if not a.outside for e in range(a.link.num_workers)]

    def workers(self) -> list[int]:
        """The fleet indices of every live worker, in order."""
        return [a.worker_offset + w for a in self.attachments for w in range(a.num_workers)]

    def index_array(self) -> np.ndarray:
        """:meth:`indices` as an int64 array (made without a Python int per env), read-only:
        made again only when the attachments changed (every fleet-wide push asks for it)."""
        key = tuple((id(a), a.offset, a.link.num_workers) for a in self.attachments)
        if self._index_array[0] != key:
            spans = [np.arange(a.offset, a.offset + a.link.num_workers, dtype=np.int64) for a in self.attachments]
            array = np.concatenate(spans) if spans else np.zeros(0, dtype=np.int64)
            array.setflags(write=False)
            self._index_array = (key, array)
        return self._index_array[1]

    def split(self, targets: np.ndarray) -> list[Part]:
        """``targets`` (fleet env indices) by attachment: a few vector ops per attachment.

        Raises:
            KeyError: an index no live attachment holds.
        """
        if len(self.attachments) == 1 and targets is self.index_array():  # a fleet-wide push to one collector
            attachment = self.attachments[0]
            return [Part(attachment, None, targets - attachment.offset)]
        parts = []
        found = 0
        for attachment in self.attachments:
            inside = (targets >= attachment.offset) & (targets < attachment.offset + attachment.link.num_workers)
            count = int(inside.sum())
            if not count:
                continue
            positions = None if count == len(targets) else np.flatnonzero(inside)
            chosen = targets if positions is None else targets[positions]
            parts.append(Part(attachment, positions, chosen - attachment.offset))
            found += count
        if found != len(targets):
            raise KeyError(sorted(set(targets.tolist()) - set(self.indices())))
        return parts

    def heads(self, targets: np.ndarray) -> np.ndarray:
        """The first env of the worker that drives each of ``targets`` (by vector ops).

        Raises:
            KeyError: an index no live attachment holds.
        """
        out = np.empty(len(targets), dtype=np.int64)
        for part in self.split(targets):
            per = part.attachment.envs_per_worker
            heads = part.attachment.offset + part.slots // per * per
            out[slice(None) if part.positions is None else part.positions] = heads
        return out

    def locate(self, index: int) -> tuple[Attachment, int]:
        """The attachment and local slot of env ``index``."""
        for attachment in self.attachments:
            if attachment.offset <= index < attachment.offset + attachment.link.num_workers:
                return attachment, index - attachment.offset
        raise KeyError(index)

    def worker_of(self, index: int) -> int:
        """The fleet index of the worker that drives env ``index``."""
        attachment, slot = self.locate(index)
        return attachment.worker_offset + slot // attachment.envs_per_worker

    def envs_of(self, worker: int) -> list[int]:
        """The env indices of fleet worker ``worker``."""
        first, count = self._span(worker)
        return list(range(first, first + count))

    def _span(self, worker: int) -> tuple[int, int]:
        """The first env index of fleet worker ``worker`` and how many envs it drives."""
        for a in self.attachments:
            if a.worker_offset <= worker < a.worker_offset + a.num_workers:
                return a.offset + (worker - a.worker_offset) * a.envs_per_worker, a.envs_per_worker
        raise KeyError(worker)

    def members(self) -> list[Member]:
        out = []
        for a in self.attachments:
            index = a.worker_offset
            for collector, count in enumerate(a.collectors or [a.num_workers]):
                for worker in range(count):
                    first = a.offset + (index - a.worker_offset) * a.envs_per_worker
                    out.append(Member(index, a.index + collector, worker, a.envs_per_worker, first))
                    index += 1
        return out

    def targets(self, workers: Sequence[int] | None, envs: Indices | None = None) -> list[int]:
        """The env indices that ``workers`` (every env of each) or ``envs`` name, validated
        against the live fleet (default: every live env)."""
        return self.target_array(workers, envs).tolist()

    def target_array(self, workers: Sequence[int] | None, envs: Indices | None = None) -> np.ndarray:
        """:meth:`targets` as an int64 array, checked by vector ops (a curriculum names
        thousands of envs among tens of thousands at every push)."""
        if workers is not None and envs is not None:
            raise ValidationError("give workers= or envs=, not both")
        if workers is None and envs is None:
            return self.index_array()
        if not self.attachments:
            what = "workers=" if envs is None else "envs="
            raise ValidationError(f"{what} needs an attached collector; none is attached")
        if envs is not None:
            return _chosen(envs, self.index_array(), "env", "envs")
        assert workers is not None
        chosen = _chosen(workers, np.asarray(self.workers(), dtype=np.int64), "worker", "workers")
        spans = [np.arange(first, first + count, dtype=np.int64) for first, count in map(self._span, chosen.tolist())]
        return np.concatenate(spans) if spans else np.zeros(0, dtype=np.int64)


def _chosen(requested: Indices, live: np.ndarray, what: str, plural: str) -> np.ndarray:
    """``requested`` (ints, or a 1-D integer array or tensor) without repeats (first come
    first), each checked against ``live`` (ascending). Vector ops throughout: a curriculum
    names thousands of envs at every push; a live fleet without gaps is checked by its ends,
    ascending indices need no search for repeats."""
    if isinstance(requested, torch.Tensor):
        requested = requested.detach().cpu().numpy()
    values = list(requested) if not isinstance(requested, np.ndarray) else requested
    array = np.asarray(values)
    mixed = array.dtype.kind in "iu" and isinstance(values, list) and bool in set(map(type, values))
    if array.ndim != 1 or mixed or (array.size and array.dtype.kind not in "iu"):
        bad = next((v for v in values if not isinstance(v, int | np.integer) or isinstance(v, bool)), values)
        bad = bad.item() if isinstance(bad, np.generic) else bad
        raise ValidationError(f"{what} {bad!r} does not exist; {plural} are {_ranges(live.tolist())}")
    array = array.astype(np.int64)
    if not len(live):
        known = np.zeros(len(array), dtype=bool)
    elif int(live[-1]) - int(live[0]) == len(live) - 1:  # no gaps: its ends decide
        known = (array >= live[0]) & (array <= live[-1])
    else:
        at = np.searchsorted(live, array).clip(max=len(live) - 1)  # live is ascending
        known = live[at] == array
    if not known.all():
        bad = array[~known][0]
        raise ValidationError(f"{what} {int(bad)!r} does not exist; {plural} are {_ranges(live.tolist())}")
    if len(array) < 2 or bool((array[1:] > array[:-1]).all()):  # ascending: no repeats
        return array
    _, first = np.unique(array, return_index=True)
    return array if len(first) == len(array) else array[np.sort(first)]


def _ranges(indices: list[int]) -> str:
    if indices and indices == list(range(indices[0], indices[-1] + 1)):
        return f"{indices[0]}..{indices[-1]}"
    return str(indices)
