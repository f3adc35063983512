"""The end of a batched env's own level: a gate over the ends of the envs under it.

A batched env's own transforms (:mod:`envsync.levels`) have a receiver like every level, on
an end of their own: :class:`GateEnd`, made of the (ungated) ends of the worker's envs. Its
target is the newest version every env under it holds (:meth:`GateEnd.target`); it reads
the worker's first slot (every env of the worker carries the batched entries; an env's own
slot is read to tell whether its newer version asks anything of the level); an apply it
acknowledges is every env's *reached* version acknowledged *applied*
(:meth:`GateEnd.ack_applied`; also a newer one that asks nothing of the level), and a
failure is reported for each env that reached the failed version: so "applied" covers
both levels, and the push that published the version raises the level's failure. It
answers only the requests for the batched env's own entries (the envs' receivers hand
those over).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import torch

from envsync.links.base import End, Header, RowsEnd
from envsync.protocol import Kind, Reply, Request


class GateEnd:
    """The batched level's end over ``ends``, the worker's envs' ends (see the module).

    Args:
        ends: the ends of every env under the level (a sequence that may open them when
            indexed: the gate reads their counters as columns and touches one end only to
            acknowledge or fail that env), the first one's slot read.
        rows: the end of the same envs as rows of one natively batched env, if they are:
            they are then acknowledged and failed by one vector write for all of them.
    """

    def __init__(self, ends: Sequence[End], rows: RowsEnd | None = None) -> None:
        self._ends = ends
        self._rows = rows
        self._first = first = ends[0]
        self.worker = first.worker
        self._count = len(ends)
        self._source = 0  # the version of the first slot's header last read
        self._gate = 0  # the gate never moves back (an env's reached version never does)
        self._checked: dict[int, tuple[int, int]] = {}  # env -> (its version, the level's) that asked something

    def target(self) -> int:
        """The newest version the level may hold: every env under it holds everything
        pushed to it up to there (an env still applying, or one that failed its latest
        version and waits for the rollback, holds the level at what it holds)."""
        targets, reached = self._first.read_counters(("target", "reached"), self._count)
        waiting = reached != targets
        gate = min(int(reached[waiting].min()), int(targets.max())) if waiting.any() else int(targets.max())
        self._gate = max(self._gate, gate)
        return self._gate

    def read_header(self) -> Header:
        """The first slot's header, its version the gate's: the receiver loads only the
        entries stamped up to there (a newer push waits until every env holds it)."""
        gate = self.target()
        header = self._first.read_header()
        self._source = header.version
        return replace(header, version=gate, undo=0)

    def load_entries(self, version: int, names: list[str], load: Callable[[str, torch.Tensor], None]) -> bool:
        return self._first.load_entries(self._source, names, load)

    def request(self) -> Request | None:
        """A request for the batched env's own entries (the envs' receivers answer the rest)."""
        request = self._first.request()
        return request if request is not None and request.kind is Kind.BATCHED_STATE else None

    def reply(self, reply: Reply) -> None:
        self._first.reply(reply)

    def ack_received(self, version: int) -> None:
        return None  # each env acknowledges what reached it

    def ack_applied(self, version: int, holds: Callable[[dict[str, int]], bool] | None = None) -> None:
        """The level holds ``version``: every env whose reached version it covers is applied.

        With ``holds`` (the level's receiver's :meth:`~envsync.worker.receiver.EnvStateReceiver.holds`),
        an env that reached a newer version, its latest, is applied too where that version
        asks nothing of the level (no entry of the level pushed since, no re-initialisation
        to run): in ``"reset"`` mode an env that reset into a version is then applied at once,
        not only once every sibling that waits for its own reset has reached it too.
        """
        reached, applied, targets = self._first.read_counters(("reached", "applied", "target"), self._count)
        owed = applied != reached  # one vector read: only these envs are looked at, one by one
        covered = np.flatnonzero(owed & (reached <= version))
        if self._rows is not None and covered.size:  # rows: one vector acknowledgement
            self._rows.ack_applied(covered, reached[covered])
        else:
            for i in covered.tolist():
                self._ends[i].ack_applied(int(reached[i]))
        if holds is None:
            return
        for i in np.flatnonzero(owed & (reached > version) & (reached == targets)).tolist():
            got = int(reached[i])
            if self._asks_nothing(i, got, holds, version):
                self._ends[i].ack_applied(got)

    def _asks_nothing(self, env: int, got: int, holds: Callable[[dict[str, int]], bool], version: int) -> bool:
        """Whether version ``got``, env ``env``'s latest, asks nothing of the level that holds
        ``version``: read from the env's own slot's stamps, once per pair of versions that
        asked something (not at every safe point)."""
        if self._checked.get(env) == (got, version):
            return False
        target, stamps = self._ends[env].read_stamps()
        if target != got:
            return False  # a newer push landed meanwhile: the env has not reached it yet
        if holds(stamps):
            return True
        self._checked[env] = (got, version)
        return False

    def unacknowledged(self) -> bool:
        """Whether some env reached a version not yet acknowledged applied."""
        applied, reached = self._first.read_counters(("applied", "reached"), self._count, copy=False)
        return bool((applied != reached).any())

    def report_failure(self, version: int, text: str) -> None:
        """The level failed ``version``: each env that reached that very version fails it
        (one does: the gate is some env's reached version); an env waiting on an older one
        stays unacknowledged until the level holds a version again (the rollback's)."""
        (reached,) = self._first.read_counters(("reached",), self._count)
        text = f"the batched env's own transforms failed to apply version {version}:\n{text}"
        failed = np.flatnonzero(reached == version)
        if self._rows is not None and failed.size:  # rows: one write, one text
            self._rows.report_failure(failed, np.full(failed.size, version, dtype=np.int64), text)
            return
        for i in failed.tolist():
            self._ends[i].report_failure(version, text)

    def set_busy(self, busy: bool, count: int = 1) -> None:
        # every env under the level, in one write; the rows of one env object only in the
        # first row's slot, the one their readers read (twice a rollout: 65,536 marks at
        # 65,536 worlds were ~90 µs of it)
        self._first.set_busy(busy, 1 if self._rows is not None else self._count)

    def is_busy(self) -> bool:
        (busy,) = self._first.read_counters(("busy",), self._count, copy=False)
        return bool(busy.any())

    def note_versions(self, ran: int | None, obs: int) -> None:
        return None  # the envs under the level note what their steps run
