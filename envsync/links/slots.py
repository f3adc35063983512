"""How the sender writes the slot table (:mod:`envsync.links.table`) and reads its replies
(each worker's side is :mod:`envsync.links.slot_reader`; the locks both take,
:mod:`envsync.links.locks`).

A slot is written by the sender and read by its worker under the worker's *slot lock* (a
process-shared lock for the shared-memory link), so a reader never sees a half-written
slot on any CPU (a lock is a full memory barrier), and a write that fails half-way is
undone before the lock is released. Acknowledgements have one writer each (the worker) and
are single aligned integers: they need no lock.

A waiting sender blocks on an acknowledgement semaphore that every acknowledgement releases
(no lock is shared between workers: on an oversubscribed machine a worker preempted while
holding one would stall every other). Before it blocks, it takes back the releases made so
far and reads the counters, which already show those acknowledgements (a worker writes its
counter before it releases): it blocks only while a slot still owes the version.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from envsync.errors import ValidationError
from envsync.indexing import put_rows, take_rows
from envsync.links.base import BROADCAST, Key
from envsync.links.locks import Released, all_locked, ascending, firsts, locked, numbered, take_back
from envsync.links.records import ROWS, as_rows, plain, reply_of, seal, unseal
from envsync.links.table import Table
from envsync.protocol import NO_FAILURE, Counts, Reply, Request, WorkerStatus
from envsync.state import Leaf, tensor_of

DRAIN_EVERY = 1024
"""Pushes between two takes-back of unwaited acknowledgement releases (:meth:`SlotWriter.flush`)."""


class SlotWriter(ABC):
    """The sender's operations on a table (both links use it).

    Args:
        table: the views.
        locks: one slot lock per worker.
        wakes: one wake-up semaphore per worker.
        acks: the semaphores workers release after acknowledging: ``(received, applied)``;
            "applied" (and failures) release the second, so a sender waiting for "applied"
            is not woken by "received" acknowledgements.
    """

    def __init__(self, table: Table, locks: list[Any], wakes: list[Any], acks: Any) -> None:
        self.table = table
        self.num_workers = table.num_workers
        self._locks: list[Any] | Released = locks
        self._wakes: list[Any] | Released = wakes
        # per slot (and per relay), the number of its lock (wake-up) among the distinct ones:
        # a write to thousands of rows of a group takes and wakes each once, by vector ops
        self._lock_of = numbered(locks)
        self._wake_of = numbered(wakes)
        self._wake_to = table.counters["wake_to"]
        self._acks = acks
        self._waiters = 0
        self._waiters_lock = threading.Lock()
        self._flushes = 0
        self._sealed: tuple[int, np.ndarray] = (0, np.zeros(0, dtype=np.uint8))  # the latest request, sealed

    def release(self) -> None:
        """Drop this writer's references to the locks and semaphores (each is freed with its
        last reference); whatever needs one after raises ``RuntimeError("link is closed")``."""
        self._locks = self._wakes = self._acks = Released()

    def initialise(self, leaves: Mapping[Key, Leaf]) -> None:
        """Give every worker the same starting leaves at version 0 (before any worker reads)."""
        self.table.counters["failed"][:] = NO_FAILURE
        for key, value in leaves.items():
            self.table.leaf_columns[key][:] = tensor_of(value)  # every slot at once

    def write(self, worker: int, version: int, entries: Mapping[Key, Leaf], *, undo: int = 0) -> None:
        """Publish ``entries`` to one slot (:meth:`write_rows` of one row)."""
        self.write_rows(np.array([worker], dtype=np.int64), version, entries, {}, undo=undo)

    def write_rows(
        self,
        slots: np.ndarray,
        version: int,
        shared: Mapping[Key, Leaf],
        rows: Mapping[Key, Leaf],
        *,
        undo: int = 0,
    ) -> None:
        """Publish ``version`` to ``slots`` (distinct, int64): the ``shared`` values to all of
        them, one row each of ``rows``. When every slot of the link is written (and it is not
        a rollback, whose values are per slot), the config and env-state values of ``shared``
        are written once, to the broadcast region, and each slot's source mark points there.

        Every leaf is checked before any byte moves (a write never stops half-way); the
        slots' locks are held meanwhile, each once, in order (no deadlock with a worker,
        which only ever takes its own): no worker reads a slot or the region while it changes."""
        self._check(len(slots), shared, rows)
        whole = len(slots) == self.num_workers
        region = [k for k in shared if k[0] in BROADCAST] if whole and self.num_workers > 1 and not undo else []
        at: Any = slice(None) if whole else slots
        with all_locked(self._locks_of(at), "writing worker %d", int(slots[0])):
            for key in region:
                self._put_region(key, shared[key])
                self._written(at, key, version)
            for key, value in shared.items():
                if key not in region:
                    self._put(key, at, value)
            for key, value in rows.items():
                self._put(key, at, value)
            counters = self.table.counters
            counters["undo"][at] = undo
            counters["target"][at] = version
            self.table.pushed[0] = version  # after the targets: a reader that sees it sees them

    def _locks_of(self, slots: np.ndarray | slice) -> list[Any]:
        """The distinct locks of ``slots`` (or every slot, a slice), in lock order (slots of a
        group share one)."""
        if not isinstance(slots, slice) and len(slots) == 1:
            return [self._locks[int(slots[0])]]
        return [self._locks[number] for number in ascending(self._lock_of[slots])]

    def _check(self, count: int, shared: Mapping[Key, Leaf], rows: Mapping[Key, Leaf]) -> None:
        """Every leaf is checked before any byte moves: a write never stops half-way."""
        columns = self.table.leaf_columns
        for key, value in [*shared.items(), *rows.items()]:
            column = columns.get(key)
            shape = tuple(value.shape) if key in shared else tuple(value.shape[1:])
            if column is None or tuple(column.shape[1:]) != shape or (key in rows and len(value) != count):
                held = None if column is None else tuple(column.shape[1:])
                raise ValueError(f"leaf {key} of shape {tuple(value.shape)} does not fit the slot's {held}")

    def _put(self, key: Key, at: Any, value: Leaf) -> None:
        """Write ``value`` (one for all, or one row each) into the slots ``at`` of a leaf's column."""
        column = self.table.numpy_columns[key]
        if column is not None and (isinstance(value, np.ndarray) or value.device.type == "cpu"):
            # small leaves: a numpy copy costs a fraction of torch's
            column[at] = value if isinstance(value, np.ndarray) else value.detach().numpy()
        elif isinstance(at, slice):
            self.table.leaf_columns[key][at] = tensor_of(value).to(self.table.leaf_columns[key].device)
        else:
            put_rows(self.table.leaf_columns[key], at, tensor_of(value))
        if key[0] in BROADCAST:
            self._written(at, key, 0)  # each slot's own value, not the broadcast

    def _put_region(self, key: Key, value: Leaf) -> None:
        region = self.table.broadcast_arrays[key]
        if isinstance(value, np.ndarray) and region is not None:
            region[...] = value  # a numpy leaf: no torch call
        else:
            self.table.broadcast[key].copy_(tensor_of(value))

    def _written(self, rows: Any, key: Key, source: int) -> None:
        """Mark ``key`` written for the slots ``rows`` indexes (all, or distinct ones): read
        from their slots (``source`` 0) or from the broadcast region; a config name's write
        count moves on."""
        table = self.table
        table.columns[table.source(key)][rows] = source
        if key[0] == "config":
            table.columns[("writes", key[1])][rows] += 1

    def read_back(self, worker: int) -> dict[Key, torch.Tensor]:
        """A copy of every leaf currently published to ``worker``."""
        slot = self.table.slot(worker)
        with locked(self._locks[worker], "reading back worker %d", worker):
            out = {key: view.clone() for key, view in slot.items()}
            for key, region in self.table.broadcast.items():
                if int(self.table.array(worker, self.table.source(key))) > 0:
                    out[key] = region.clone()
            return out

    def flush(self, version: int) -> None:
        """End a push. Every :data:`DRAIN_EVERY` pushes, while no thread waits on the link,
        take back the acknowledgement releases nobody waited for: a program that never waits,
        or waits only for "applied", would otherwise pile "received" releases up to a POSIX
        semaphore's limit (2**31 - 1: some 5e8 pushes at 4 workers), and the workers' next
        release would fail. The counters, not the releases, say who acknowledged: a waiter
        that comes later reads them first."""
        self._flushes += 1
        if self._flushes % DRAIN_EVERY:
            return
        with self._waiters_lock:
            if self._waiters:
                return
            for semaphore in self._acks:
                take_back(semaphore)

    def send_request(self, workers: Sequence[int] | np.ndarray, request: Request) -> None:
        """Put ``request`` in the request area of ``workers`` (handled at each one's next safe
        point, or at once while idle; :meth:`notify` wakes them): written once per group of
        slots sharing a lock, each slot's ``ask_at`` naming where, under each lock once."""
        sealed = self._sealed
        if sealed[0] != request.id:  # a request goes to many slots (every env of a gather): sealed once
            sealed = self._sealed = (request.id, np.frombuffer(seal(plain(request)), dtype=np.uint8))
        data = sealed[1]
        table = self.table
        area = table.areas["request"]
        if len(data) > area.shape[1]:
            raise ValidationError(
                f"a {request.kind.name} request of {len(data)} bytes does not fit a slot's request area "
                f"({area.shape[1]} bytes): ask for fewer names or paths at a time"
            )
        slots = np.asarray(workers, dtype=np.int64)
        # once per group of slots that share a lock and a mailbox (the rows of a natively
        # batched env), in its mailbox, each slot's ``ask_at`` naming its first asked slot: a
        # request to 65,536 rows touches one page, not 65,536
        groups = self._lock_of[slots]
        numbers, first = firsts(groups)
        heads = slots[first]
        counters = table.counters
        with all_locked([self._locks[number] for number in numbers.tolist()], "asking worker %d", int(slots[0])):
            area[table.box(heads), : len(data)] = data
            counters["ask_len"][heads] = len(data)
            counters["ask_at"][slots] = heads[np.searchsorted(numbers, groups)] + 1
            counters["ask"][slots] = request.id
            table.asked[0] += 1  # after the asks: a reader that sees it moved sees them (requests come one at a time)

    def replies(self, workers: np.ndarray, request: int) -> list[tuple[np.ndarray, Reply]]:
        """The replies to ``request`` from ``workers`` that came (see the protocol): a slot's
        own reply is read from its area, a rows reply once for every row it answers."""
        c = self.table.counters
        slots = np.asarray(workers, dtype=np.int64)
        came = slots[c["answered"][slots] == request]
        at = c["reply_at"][came]
        out = []
        for slot in came[at == 0].tolist():
            reply = self.reply(slot, request)
            if reply is not None:
                out.append(as_rows(slot, reply))
        rows_at = at[at > 0] - 1
        for head in ascending(rows_at):
            bulk = self._rows_reply(head, request)
            if bulk is None:
                continue
            if bulk.failed:
                out.append((came[at == head + 1], bulk))
            else:
                values = dict(bulk.result)
                rows = values.pop(ROWS).numpy()
                asked = np.ones(len(rows), dtype=bool) if np.array_equal(rows, slots) else np.isin(rows, slots)
                if not asked.all():  # only the rows of the reply that were asked for here
                    chosen = np.flatnonzero(asked)
                    rows, values = rows[asked], {k: take_rows(v, chosen) for k, v in values.items()}
                out.append((rows, Reply(bulk.id, values)))
        return out

    def reply(self, worker: int, request: int) -> Reply | None:
        """``worker``'s reply to ``request`` once it answered it, else ``None`` (its row of a
        rows reply, for a row of a natively batched env)."""
        c = self.table.counters
        if int(c["answered"][worker]) != request:
            return None
        head = int(c["reply_at"][worker]) - 1
        if head >= 0:
            bulk = self._rows_reply(head, request)
            if bulk is None or bulk.failed:
                return bulk
            rows = bulk.result[ROWS].numpy()
            at = int(np.flatnonzero(rows == worker)[0])
            return Reply(bulk.id, {k: v[at] for k, v in bulk.result.items() if k != ROWS})
        with locked(self._locks[worker], "reading worker %d's reply", worker):
            length = int(c["reply_len"][worker])
            data = bytes(self.table.area("reply", worker)[:length])
        return reply_of(unseal(data)) if length else None  # none: a request its rows dropped

    def _rows_reply(self, head: int, request: int) -> Reply | None:
        """The rows reply written from slot ``head``'s mailbox on, if it answers ``request``."""
        with locked(self._locks[head], "reading the rows reply at worker %d", head):
            length = int(self.table.counters["reply_len"][head])
            data = bytes(self.table.reply_span(head, self.num_workers - 1)[:length])
        reply = reply_of(unseal(data))
        return reply if reply.id == request else None

    def notify(self, workers: Sequence[int] | np.ndarray, *, here: bool = False) -> None:
        # the semaphore of the loop that serves each worker's slot (see SlotReader.route_to),
        # released once however many of the workers it serves (a native env's rows share one)
        slots = np.asarray(workers, dtype=np.int64)
        # every slot (distinct): their routes in slot order, as a view, not gathered (65,536
        # rows are 512 KB a column)
        whole = len(slots) == self.num_workers
        routes = self._wake_to[slice(None) if whole else slots]
        if len(routes) and routes[0] > 0 and routes.min() == routes.max():  # all to one loop (an env's rows)
            self._wake(int(self._wake_of[int(routes[0]) - 1]), here)
            return
        chosen = np.where(routes > 0, routes - 1, np.arange(len(routes)) if whole else slots)
        for number in ascending(self._wake_of[chosen]):
            self._wake(number, here)

    def _wake(self, number: int, here: bool) -> None:
        """Wake the loop that waits on the wake-up numbered ``number`` (its semaphore: a loop
        in another process runs nowhere else, ``here`` or not)."""
        self._wakes[number].release()

    def status(self, worker: int) -> WorkerStatus:
        return self.table.status(worker)

    def failed(self) -> np.ndarray:
        return _read_only(self.table.counters["failed"])  # compared at once by its readers: no copy of 65,536 rows

    def error_text(self, worker: int) -> str:
        return self.table.error_text(worker)

    def error_texts(self, slots: np.ndarray) -> list[tuple[np.ndarray, str]]:
        """The error texts of ``slots`` (int64), each read once for all the slots that hold it
        (the rows of a natively batched env that failed one apply share one record)."""
        _, first, inverse = np.unique(self.table.counters["error_at"][slots], return_index=True, return_inverse=True)
        inverse = inverse.ravel()
        return [(slots[inverse == i], self.table.error_text(int(slots[at]))) for i, at in enumerate(first.tolist())]

    @abstractmethod
    def alive(self, worker: int) -> bool:
        """Whether the worker can still answer (each kind of link knows how to tell)."""

    def acks_columns(self) -> tuple[np.ndarray, ...]:
        """Copies of every slot's received, applied, failed and reached versions (what a Ray
        relay reports of its workers, at once)."""
        c = self.table.counters
        return tuple(c[name][: self.num_workers].copy() for name in ("received", "applied", "failed", "reached"))

    def alive_slots(self, slots: np.ndarray) -> np.ndarray:
        """Per slot of ``slots`` (int64), whether :meth:`alive` holds: asked once per process
        that opened any of them (the rows of a natively batched env share one), and for each
        slot none opened yet."""
        pids = self.table.counters["pid"][slots]
        out = np.zeros(len(slots), dtype=bool)
        distinct, first = firsts(pids)
        for pid, at in zip(distinct.tolist(), first.tolist(), strict=True):
            if pid:
                out[pids == pid] = self.alive(int(slots[at]))
        for at in np.flatnonzero(pids == 0).tolist():
            out[at] = self.alive(int(slots[at]))
        return out

    def counts(self, slots: Sequence[int] | np.ndarray, *, applied: bool) -> Counts:
        """The :data:`~envsync.protocol.Counts` of ``slots`` (distinct), as columns. Of every
        slot: read-only views of the live columns (compared at once by the callers, which
        keep none: no copy of 65,536 counters three times a wake)."""
        c = self.table.counters
        acked = c["applied" if applied else "received"]
        if len(slots) == self.num_workers:
            return _read_only(c["target"]), _read_only(acked), _read_only(c["failed"])
        rows = np.asarray(slots, dtype=np.int64)
        return c["target"][rows], acked[rows], c["failed"][rows]  # an index array copies

    def wait_acks(self, timeout: float, *, applied: bool, done: Callable[[], bool] | None = None) -> bool:
        """Block until an acknowledgement wakes the sender, or ``timeout`` passes; with
        ``done`` (the waiter's rule, read from :meth:`counts`), return at once when it holds.
        A thread waiting alone on the link with a rule first takes back the releases made so
        far (the counters show them), so that they do not wake it for nothing; threads
        waiting together leave them to each other.

        It returns at the first acknowledgement rather than sleeping on while other slots
        still owe: the caller's reading of the counters takes about as long as the next
        acknowledgement, and a sleep (a futex wait and wake) costs more than either."""
        semaphore = self._acks[1 if applied else 0]
        with self._waiters_lock:
            self._waiters += 1
            alone = self._waiters == 1
        try:
            if alone and done is not None:
                take_back(semaphore)
            if done is not None and done():
                return True
            return bool(semaphore.acquire(timeout=max(timeout, 0.0)))
        finally:
            with self._waiters_lock:
                self._waiters -= 1


def _read_only(column: np.ndarray) -> np.ndarray:
    view = column[:]
    view.flags.writeable = False
    return view
