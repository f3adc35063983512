"""The ``sync_stats`` books: per fleet index, what each worker's statistics are counted up
to (its baseline), the latest merge, and the merge pushed last until every worker tells
whether it applied it. Plain data, no I/O (:mod:`envsync.sender.gather` reads the workers, and
:mod:`envsync.stats` does the maths)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from envsync import stats


@dataclass
class Pending:
    """The latest merge pushed: its version, the statistics, and what each worker held when
    it was gathered (a worker's baseline until it applies the merge). A checkpoint loaded
    into running workers gives each its baseline (``after``, default ``merged``) at a version
    of its own (``at``, default ``version``)."""

    version: int
    merged: dict[str, torch.Tensor]
    gathered: dict[int, dict[str, torch.Tensor]]
    after: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    at: dict[int, int] = field(default_factory=dict)

    def brings(self, worker: int) -> int:
        """The version whose apply makes ``worker``'s baseline :meth:`baseline_after`."""
        return self.at.get(worker, self.version)

    def baseline_after(self, worker: int) -> dict[str, torch.Tensor]:
        return self.after.get(worker, self.merged)


class StatsBook:
    """Per fleet index, the statistics a worker's own are counted up to (its *baseline*); the
    latest merge; and the merge pushed last, until every worker's status tells whether it
    applied it (a push may time out, fail, or wait for each env's reset).

    Args:
        start: the statistics a worker starts with before any sync (the template's).
    """

    def __init__(
        self,
        start: Mapping[str, torch.Tensor],
        *,
        merged: dict[str, torch.Tensor] | None = None,
        given: dict[int, dict[str, torch.Tensor]] | None = None,
    ) -> None:
        self.merged = merged if merged is not None else {k: torch.zeros_like(v) for k, v in start.items()}
        self._given: dict[int, dict[str, torch.Tensor]] = given if given is not None else {}
        self.pending: Pending | None = None
        self._published = False  # whether a merge was ever pushed (a rollback republishes it)

    def unclear(self, before: Mapping[int, int], after: Mapping[int, int]) -> list[int]:
        """The workers that may have applied the pending merge while they answered a gather
        (their applied version crossed it between the two reads): gather them again."""
        p = self.pending
        return [] if p is None else [w for w in p.gathered if before.get(w, 0) < p.brings(w) <= after.get(w, 0)]

    def baselines(self, applied: Mapping[int, int]) -> dict[int, dict[str, torch.Tensor]]:
        """What each worker's statistics are counted up to, given its ``applied`` version: a
        worker that applied the pending merge holds it plus what it saw since; one that did
        not (yet: in "reset" mode it may still, until a newer merge supersedes it) still
        holds its own, as gathered for that merge."""
        given = dict(self._given)
        p = self.pending
        if p is not None:
            for worker, own in p.gathered.items():
                if worker in applied:
                    given[worker] = p.baseline_after(worker) if applied[worker] >= p.brings(worker) else own
        return given

    def round(
        self,
        current: Mapping[int, Mapping[str, torch.Tensor]],
        applied: Mapping[int, int],
        decay: Mapping[str, float],
    ) -> dict[str, torch.Tensor]:
        """Merge the workers' ``current`` statistics of the names in ``current`` (``decay``
        per moments prefix), each counted from its baseline (see :meth:`baselines`)."""
        names = sorted(next(iter(current.values())))
        base = {k: self.merged[k] for k in names}
        baselines = self.baselines(applied)
        given = {w: {k: baselines[w][k] for k in names} for w in current if w in baselines}
        return stats.sync_round(base, given, current, decay)

    def pushed(self, version: int, merged: Mapping[str, torch.Tensor], current: Mapping[int, dict]) -> None:
        """``merged`` went out as ``version`` (applied or not yet; a worker joining later
        starts from it, and it supersedes the merge pending before); ``current`` is what
        each worker held when gathered."""
        self.merged.update(merged)
        self.pending = Pending(version, dict(self.merged), {w: dict(v) for w, v in current.items()})
        self._published = True

    def failed(self, rollback: int, current: Mapping[int, dict]) -> None:
        """A merge failed on some worker and was rolled back by version ``rollback``: it
        gives every worker the previous merge again, or, with none pushed before, each
        worker keeps (or gets back) its own statistics."""
        if self._published:
            self.pending = Pending(rollback, dict(self.merged), {w: dict(v) for w, v in current.items()})
        else:
            self._given.update({w: dict(v) for w, v in current.items()})

    def state_dict(self, workers: Sequence[int], applied: Mapping[int, int], *, held: bool) -> dict[str, Any]:
        """The last merge, and each of ``workers``' baseline (fleet order): with ``held``, of
        what it holds at its ``applied`` version (its statistics were gathered then); else of
        its desired state, what it holds once it applies what it was pushed (a resumed worker
        starts from the checkpointed state)."""
        given = self.baselines(applied)
        p = self.pending
        if not held and p is not None:
            given.update({w: p.baseline_after(w) for w in p.gathered if w in applied})
        return {"merged": dict(self.merged), "given": [dict(given.get(w, self.merged)) for w in workers]}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], own: Sequence[bool] | None = None) -> StatsBook:
        """Restore a book; rows of ``"given"`` become fleet indices 0, 1, ... (resume order).

        ``own[w]``: whether worker ``w`` resumes from its own checkpointed statistics (a
        ``state_dict(gather=True)`` row), which its checkpointed baseline describes; a worker
        that resumes without them starts from the last merge, its baseline from now on."""
        merged = dict(state["merged"])
        given = {
            w: dict(row) if own is not None and w < len(own) and own[w] else dict(merged)
            for w, row in enumerate(state["given"])
        }
        return cls(merged, merged=merged, given=given)

    def loaded_into_running(
        self, at: Mapping[int, int], order: Sequence[int], before: Mapping[int, Mapping[str, torch.Tensor]]
    ) -> None:
        """The book was restored into workers already running (the collector was built
        before the checkpoint was loaded): the checkpoint's row ``i`` is fleet index
        ``order[i]``, which holds that row's baseline once it applies version ``at[index]``;
        until then it holds what it saw since ``before[index]`` (the book the load replaced;
        the template's empty statistics without one). An index missing from ``at`` got nothing."""
        empty = {k: torch.zeros_like(v) for k, v in self.merged.items()}

        def prior(index: int) -> dict[str, torch.Tensor]:
            held = before.get(index)
            return dict(held) if held is not None and held.keys() == empty.keys() else dict(empty)

        rows = dict(zip(order, self._given.values(), strict=False))
        self._given = {}
        self.pending = Pending(
            max(at.values(), default=0),
            dict(self.merged),
            {index: prior(index) for index in order},
            after={index: rows[index] for index in at if index in rows},
            at={index: at.get(index, 1 << 62) for index in order},
        )


class StatsBooks:
    """The ``sync_stats`` books: one for the sub-envs' transforms, one for the batched envs'
    own (``whole``); each made at its first sync or restored from a checkpoint.

    Examples:
        >>> import torch
        >>> books = StatsBooks()
        >>> books.of(whole=False) is None
        True
        >>> book = books.book(False, {"stats.0.x.count": torch.tensor(0.0)})
        >>> books.of(whole=False) is book
        True
    """

    def __init__(self) -> None:
        self._books: dict[bool, StatsBook] = {}

    def of(self, whole: bool) -> StatsBook | None:
        """The book of one level, if any."""
        return self._books.get(whole)

    def book(self, whole: bool, start: Mapping[str, torch.Tensor]) -> StatsBook:
        """The book of one level, made from the template's statistics ``start`` if none yet."""
        if whole not in self._books:
            self._books[whole] = StatsBook(start)
        return self._books[whole]

    def put(self, whole: bool, book: StatsBook) -> None:
        """Replace the book of one level (a checkpoint's)."""
        self._books[whole] = book
