"""The rows of a natively batched env on the slot table (:mod:`envsync.links.table`): one
end for the ``count`` consecutive slots of one env object, read and acknowledged as columns.

A row is a slot like any other for the sender (its fleet index, its config, its counters);
the rows of one env share the slot lock and the wake-up (:func:`~envsync.links.slots.per_slot`),
so reading every pending row is one lock taken (on a link made without ``group=``, each row's
lock in turn), and an acknowledgement of k rows is one vector write and one release.
A request (a gather) is read once for every row it went to, and the rows asked answer it
with one reply (:meth:`RowsReader.reply`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from envsync.indexing import Rows, put_rows, span_of, take_rows
from envsync.links.base import RowsHeader
from envsync.links.locks import all_locked, distinct
from envsync.links.records import ROWS, sealed_reply
from envsync.links.slot_reader import read_request
from envsync.links.table import Table
from envsync.protocol import Reply, Request

_NONE = np.zeros(0, dtype=np.int64)
_NONE.flags.writeable = False


class RowsReader:
    """The end of the ``count`` rows of one env, from slot ``first`` on.

    Args:
        table: the slot table.
        first: the slot of row 0.
        count: the rows.
        locks: the rows' slot locks (one object for all of them on a link made with
            ``group=count``; else each is taken, in order, for a read).
        wakes: every slot's wake-up, then every slot's relay (as a slot reader's).
        acks: the acknowledgement semaphores ``(received, applied)``.
        gated: the rows are under a batched level: an apply is recorded as *reached*, and
            the level acknowledges it *applied* (:mod:`envsync.worker.gate`).
        claim: this process serves the rows (not only looks at them).

    Examples:
        >>> from envsync.links.local import LocalLink
        >>> link = LocalLink({("config", "x"): torch.zeros(())}, 3, group=3)
        >>> rows = link.handle().open_rows(0, 3)
        >>> link.write(1, 4, {("config", "x"): torch.tensor(2.0)})
        >>> rows.targets().tolist()
        [0, 4, 0]
        >>> header = rows.read(np.array([1]), np.array([0]), [])
        >>> header.versions.tolist(), header.config["x"].tolist()
        ([4], [2.0])
        >>> rows.ack_applied(np.array([1]), header.versions)
        >>> link.status(1).applied
        4
    """

    def __init__(
        self,
        table: Table,
        first: int,
        count: int,
        locks: Sequence[Any],
        wakes: Sequence[Any],
        acks: Any,
        *,
        gated: bool = False,
        claim: bool = True,
    ) -> None:
        self.table = table
        self.first = first
        self.count = count
        self._locks = locks
        self._distinct = distinct(locks)
        self._wakes = wakes
        self.one_wake = len(distinct(wakes[first : first + count])) == 1
        """Whether one wake-up serves every row (a link made with ``group=count``)."""
        self._acks = acks
        self._gated = gated
        self._span = slice(first, first + count)
        c = table.counters
        self._c = c
        self._target = c["target"][self._span]  # a view: one vector read per safe point
        columns = table.leaf_columns
        self._config = [
            (key[1], columns[key], table.columns[table.source(key)]) for key in columns if key[0] == "config"
        ]
        self._state = {
            key[1]: (columns[key], table.columns[table.source(key)]) for key in columns if key[0] == "env_state"
        }
        self._stamps = [(key[1], table.columns_of(key)) for key in columns if key[0] == "stamp"]
        self._request: Request | None = None  # the latest request read, decoded once
        self._none_asked = -1  # the link's request count when the rows last had none unanswered
        if claim:  # this process serves the rows (what the sender's liveness check reads)
            c["pid"][self._span] = os.getpid()

    def targets(self) -> np.ndarray:
        """Every row's latest target: a read-only view of the live column, to compare or
        index at once (no copy of every world's target at every safe point)."""
        view = self._target[:]
        view.flags.writeable = False
        return view

    @property
    def state_names(self) -> list[str]:
        """The env-state names a push may carry."""
        return list(self._state)

    def read(self, rows: np.ndarray, since: np.ndarray, names: Sequence[str]) -> RowsHeader:
        """The versions, config, stamps and undo marks of ``rows`` (indices of rows), and of
        each env-state name of ``names`` the values of the rows that a push after their
        version ``since`` (and up to their target) stamped, all under the rows' slot lock:
        one consistent copy."""
        slots = rows + self.first
        at = span_of(slots, ascending=True)  # every row of the env, or a run of them: slices
        with all_locked(self._distinct, "rows %d.. reading", self.first):
            versions = self._c["target"][at].copy()
            config = {
                name: _rows_of(column, source, at, self.table.broadcast[("config", name)])
                for name, column, source in self._config
            }
            stamps = {name: column[at].copy() for name, column in self._stamps}
            undo = self._c["undo"][at].copy()
            entries, masks = {}, {}
            for name in names:
                stamp = stamps.get(name)
                if stamp is None:
                    continue
                mask = (since < stamp) & (stamp <= versions)
                if mask.any():
                    column, source = self._state[name]
                    masks[name] = mask
                    entries[name] = _rows_of(column, source, slots[mask], self.table.broadcast[("env_state", name)])
        return RowsHeader(versions, config, stamps, undo, entries, masks)

    def ack_received(self, rows: np.ndarray, versions: np.ndarray) -> None:
        """Tell the sender these rows saw these versions (armed for their next safe point)."""
        slots = rows + self.first
        self._received(slots, span_of(slots, ascending=True), versions)

    def _received(self, slots: np.ndarray, at: Rows, versions: np.ndarray) -> None:
        """:meth:`ack_received` of the slots ``slots`` (``at``: them, or their slice)."""
        received = self._c["received"]
        newer = versions > received[at]
        if not newer.any():
            return
        # the counters first: a sender woken reads them
        if newer.all():
            received[at] = versions
        else:
            received[slots[newer]] = versions[newer]
        self._acks[0].release()

    def ack_applied(self, rows: np.ndarray, versions: np.ndarray) -> None:
        """Tell the sender these rows run these versions (gated: they reached them; their
        batched level acknowledges them applied once it holds them too)."""
        slots = rows + self.first
        at = span_of(slots, ascending=True)
        reached = self._c["reached"]
        reached[at] = np.maximum(reached[at], versions)  # never back, as a slot reader's
        if not self._gated:
            self._c["applied"][at] = versions
            self._acks[1].release()
        self._received(slots, at, versions)

    def report_failure(self, rows: np.ndarray, versions: np.ndarray, text: str) -> None:
        """Tell the sender these rows failed these versions, with the traceback text."""
        slots = rows + self.first
        self.table.write_error(slots, text)  # once, for every row
        self._c["failed"][slots] = versions
        self._acks[0].release()
        self._acks[1].release()

    def note_versions(self, rows: np.ndarray, ran: np.ndarray | None, obs: np.ndarray) -> None:
        """Record the version each row's next step runs under (``None``: unchanged) and the
        one its observation comes from (the batched env's tags read them)."""
        at = span_of(rows + self.first, ascending=True)
        if ran is not None:
            self._c["ran"][at] = ran
        self._c["obs"][at] = obs

    def is_busy(self) -> bool:
        """Whether the collector drives the env now (its group marks the first row for all)."""
        return bool(self._c["busy"][self.first])

    def asked(self) -> tuple[np.ndarray, np.ndarray]:
        """The rows with a request not answered yet, and each one's request id: one integer
        read while no request came since the rows last had none; else one vector read, and
        where any row is asked, one more under the rows' lock (the sender writes every asked
        row's id under it: a request's rows are seen all or none, and answered in one reply in
        their one mailbox)."""
        count = int(self.table.asked[0])  # before the asks: a request written meanwhile moves it
        if count == self._none_asked:  # no request since the rows had none: one integer read
            return _NONE, _NONE
        ask, answered = self._c["ask"][self._span], self._c["answered"][self._span]
        if not ((ask != 0) & (ask != answered)).any():
            self._none_asked = count
            return _NONE, _NONE
        with all_locked(self._distinct, "rows %d.. reading their asks", self.first):
            rows = np.flatnonzero((ask != 0) & (ask != answered))
            return rows, ask[rows]

    def request(self, row: int) -> Request | None:
        """Row ``row``'s request not answered yet, or ``None`` (the request a gather sends to
        every row is decoded once, not once per row). A request a newer one overwrote in the
        rows' mailbox before they answered it (sent to other rows of theirs) is dropped: its
        rows are marked answered, with no reply (its sender had stopped waiting for it, or
        waits until its timeout), so that no safe point reads it again."""
        slot = self.first + row
        ask = int(self._c["ask"][slot])
        self._request = read_request(self.table, slot, self._locks[row], self._request)
        if self._request is None and ask != 0 and ask != int(self._c["answered"][slot]):
            with all_locked(self._distinct, "rows %d.. dropping a request", self.first):
                dropped = self.first + np.flatnonzero(self._c["ask"][self._span] == ask)
                self._c["reply_at"][dropped] = 0
                self._c["reply_len"][dropped] = 0  # answered with nothing: the sender reads no reply
                self._c["answered"][dropped] = ask
        return self._request

    def reply(self, rows: np.ndarray, reply: Reply) -> None:
        """Answer the request of ``rows`` (sorted) with one reply whose values hold one row per
        row of ``rows``: written once, in the rows' mailbox (across the reply areas from the
        first row's on, on a link with a mailbox per slot), and read back by the sender once
        (:meth:`~envsync.links.slots.SlotWriter.replies`). A reply larger than that room is
        sent as a failure that says so."""
        slots = self.first + rows
        head = int(slots[0])
        span = self.table.reply_span(head, self.first + self.count - 1)
        if reply.error is None:
            reply = Reply(reply.id, {ROWS: torch.from_numpy(slots), **reply.result})
        data = sealed_reply(reply, len(span), "the rows' reply room (read fewer paths, or fewer envs, at a time)")
        with all_locked(self._distinct, "rows %d.. replying", self.first):
            span[: len(data)] = np.frombuffer(data, dtype=np.uint8)
            self._c["reply_len"][head] = len(data)
            self._c["reply_at"][slots] = head + 1
            self._c["answered"][slots] = reply.id
        self._acks[1].release()


def _rows_of(column: torch.Tensor, source: np.ndarray, slots: Rows, broadcast: torch.Tensor) -> torch.Tensor:
    """The values of a leaf for ``slots`` (indices, or a slice): each from its slot, or from
    the broadcast region where its source mark says a push to every worker wrote it there."""
    values = take_rows(column, slots)
    shared = np.flatnonzero(source[slots] > 0)
    if shared.size:
        put_rows(values, shared, broadcast)
    return values
