"""How the sender and each worker read and write the slot table (:mod:`envsync.links.table`).

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

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from envsync.buffers import ArrayBuffers
from envsync.errors import EnvSyncError, ValidationError
from envsync.links.base import BROADCAST, Header, Key, ReceiverLink
from envsync.links.records import plain, reply_of, request_of, seal, unseal
from envsync.links.table import ERROR_BYTES, Table, pid_alive
from envsync.protocol import NO_FAILURE, Counts, Reply, Request, WorkerStatus
from envsync.state import Leaf, tensor_of

_LOCK_TIMEOUT = 10.0
DRAIN_EVERY = 1024
"""Pushes between two takes-back of unwaited acknowledgement releases (:meth:`SlotWriter.flush`)."""


def _write_text(buffer: np.ndarray, lengths: np.ndarray, worker: int, text: str) -> None:
    data = text.encode("utf-8", errors="replace")[-ERROR_BYTES:]
    buffer[worker, : len(data)] = np.frombuffer(data, dtype=np.uint8)
    lengths[worker] = len(data)


def _acquire(lock: Any, what: str, *args: Any) -> None:
    """Take a slot lock; one held longer than any write takes means a dead holder: raise,
    naming ``what % args`` (formatted only then: this is on every push's path)."""
    if not lock.acquire(timeout=_LOCK_TIMEOUT):
        raise EnvSyncError(f"{what % args}: slot lock not released in {_LOCK_TIMEOUT} s (its holder died?)")


def _take_back(semaphore: Any) -> None:
    """Take every release made so far of ``semaphore`` (without blocking)."""
    while semaphore.acquire(False):
        pass


class locked:  # noqa: N801 (used as a ``with`` statement, like a function)
    """Hold a slot lock for a ``with`` block: ``with locked(lock, "writing worker %d", w)``.
    A lock held longer than any write takes means a dead holder: raise, naming ``what % args``
    (formatted only then: this is on every push's path)."""

    __slots__ = ("_lock",)

    def __init__(self, lock: Any, what: str, *args: Any) -> None:
        _acquire(lock, what, *args)
        self._lock = lock

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class SlotWriter:
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
        self._locks = locks
        self._wakes = wakes
        self._wake_to = table.counters["wake_to"]
        self._acks = acks
        self._waiters = 0
        self._waiters_lock = threading.Lock()
        self._flushes = 0

    def initialise(self, leaves: Mapping[Key, Leaf]) -> None:
        """Give every worker the same starting leaves at version 0 (before any worker reads)."""
        self.table.counters["failed"][:] = NO_FAILURE
        for slot in self.table.slots:
            for key, value in leaves.items():
                slot[key].copy_(tensor_of(value))

    def write(self, worker: int, version: int, entries: Mapping[Key, Leaf], *, undo: int = 0) -> None:
        self._check(worker, entries)
        with locked(self._locks[worker], "writing worker %d", worker):
            self._write(worker, version, entries, undo)

    def _check(self, worker: int, entries: Mapping[Key, Leaf]) -> None:
        """Every leaf is checked before any byte moves: a write never stops half-way."""
        slot = self.table.slots[worker]
        for key, value in entries.items():
            view = slot.get(key)
            if view is None or view.shape != value.shape:
                held = None if view is None else tuple(view.shape)
                raise ValueError(f"leaf {key} of shape {tuple(value.shape)} does not fit the slot's {held}")

    def _write(self, worker: int, version: int, entries: Mapping[Key, Leaf], undo: int) -> None:
        self._write_leaves(worker, entries)
        self.table.counters["undo"][worker] = undo
        self.table.counters["target"][worker] = version

    def _write_leaves(self, worker: int, entries: Mapping[Key, Leaf]) -> None:
        table, slot = self.table, self.table.slots[worker]
        for key, value in entries.items():
            if isinstance(value, np.ndarray):
                table.array(worker, key)[...] = value
            else:
                slot[key].copy_(value)
            if key[0] in BROADCAST:
                self._written(worker, key, 0)  # this worker's own value, not the broadcast

    def _written(self, rows: Any, key: Key, source: int) -> None:
        """Mark ``key`` written for the workers ``rows`` indexes (one, a list, or all): read
        from their slots (``source`` 0) or from the broadcast region; a config name's write
        count moves on."""
        table = self.table
        table.columns[table.source(key)][rows] = source
        if key[0] == "config":
            table.columns[("writes", key[1])][rows] += 1

    def broadcast(self, version: int, shared: Mapping[Key, Leaf], entries: Mapping[int, Mapping[Key, Leaf]]) -> None:
        """Publish ``version`` to the workers of ``entries`` (their own leaves: stamps, rows)
        with the config and env-state values ``shared`` written once, to the broadcast
        region, for all.

        Every targeted worker's slot lock is held meanwhile (in worker order: no deadlock with
        a worker, which only ever takes its own): no worker reads the region while it changes,
        and the workers still copy from it in parallel afterwards."""
        workers = sorted(entries)
        for worker in workers:
            self._check(worker, entries[worker])
        for key, value in shared.items():
            region = self.table.broadcast.get(key)
            if region is None or region.shape != value.shape:
                raise ValueError(f"broadcast entry {key} does not fit the region")
        locks = [self._locks[worker] for worker in workers]
        held = 0
        try:
            for worker in workers:
                _acquire(locks[held], "broadcasting to worker %d", worker)
                held += 1
            for key, value in shared.items():
                array = self.table.broadcast_arrays[key]
                if isinstance(value, np.ndarray) and array is not None:
                    array[...] = value  # a numpy leaf: no torch call
                else:
                    self.table.broadcast[key].copy_(tensor_of(value))
            for worker in workers:
                if entries[worker]:
                    self._write_leaves(worker, entries[worker])
            # the marks and counters of every worker at once (workers are sorted and distinct)
            rows: Any = slice(None) if len(workers) == self.num_workers else workers
            for key in shared:
                self._written(rows, key, version)
            self.table.counters["undo"][rows] = 0
            self.table.counters["target"][rows] = version
        finally:
            for lock in locks[:held]:
                lock.release()

    def read_back(self, worker: int) -> dict[Key, torch.Tensor]:
        """A copy of every leaf currently published to ``worker``."""
        slot = self.table.slots[worker]
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
                _take_back(semaphore)

    def send_request(self, worker: int, request: Request) -> None:
        """Put ``request`` in ``worker``'s request area (handled at the worker's next safe
        point, or at once while idle; :meth:`notify` wakes it)."""
        data = seal(plain(request))
        area = self.table.areas["request"]
        if len(data) > area.shape[1]:
            raise ValidationError(
                f"a {request.kind.name} request of {len(data)} bytes does not fit a slot's request area "
                f"({area.shape[1]} bytes): ask for fewer names or paths at a time"
            )
        with locked(self._locks[worker], "asking worker %d", worker):
            area[worker, : len(data)] = np.frombuffer(data, dtype=np.uint8)
            self.table.counters["ask_len"][worker] = len(data)
            self.table.counters["ask"][worker] = request.id

    def reply(self, worker: int, request: int) -> Reply | None:
        """``worker``'s reply to ``request`` once it answered it, else ``None``."""
        answered = self.table.counters["answered"]
        if int(answered[worker]) != request:
            return None
        with locked(self._locks[worker], "reading worker %d's reply", worker):
            length = int(self.table.counters["reply_len"][worker])
            data = bytes(self.table.areas["reply"][worker, :length])
        return reply_of(unseal(data))

    def notify(self, worker: int) -> None:
        # the semaphore of the loop that serves the worker's slot (see SlotReader.route_to)
        route = int(self._wake_to[worker])
        self._wakes[route - 1 if route else worker].release()

    def status(self, worker: int) -> WorkerStatus:
        return self.table.status(worker)

    def failed(self) -> list[int]:
        return list(self.table.counters["failed"].tolist())

    def error_text(self, worker: int) -> str:
        return self.table.error_text(worker)

    def counts(self, slots: Sequence[int], *, applied: bool) -> Counts:
        """The :data:`~envsync.protocol.Counts` of ``slots`` (distinct), read as Python ints
        (a few slots: a list read costs less than numpy's ufuncs)."""
        c = self.table.counters
        acked = c["applied" if applied else "received"]
        if len(slots) == self.num_workers:
            return zip(c["target"].tolist(), acked.tolist(), c["failed"].tolist(), strict=True)
        target, failed = c["target"], c["failed"]
        return ((int(target[s]), int(acked[s]), int(failed[s])) for s in slots)

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
                _take_back(semaphore)
            if done is not None and done():
                return True
            return bool(semaphore.acquire(timeout=max(timeout, 0.0)))
        finally:
            with self._waiters_lock:
                self._waiters -= 1


class SlotReader:
    """One worker's operations on a table (both links use it).

    Notices: ``wakes`` holds every slot's two semaphores, its wake-up (released by the
    sender's notify) then its *relay* (released by a receiver in a ``ParallelEnv``'s
    sub-process, to wake its batched env's group in the worker). An end waits on one of its
    slot's (``relayed``: the relay), unless it was routed to another end's
    (:meth:`route_to`): then every notice for it releases that one, so one worker loop
    waits on one semaphore for every env it holds (:mod:`envsync.worker_loop`).
    """

    def __init__(
        self,
        table: Table,
        worker: int,
        lock: Any,
        wakes: Sequence[Any],
        acks: Any,
        *,
        owner: int = 0,
        relayed: bool = False,
        gate: tuple[bool, bool] = (False, False),
    ) -> None:
        self.worker = worker
        self._owner = owner
        # the sender is this process's parent (a collector's worker): its death re-parents
        # this process at once, so a parent that changed is all the liveness check reads
        self._parent = owner if owner and owner == os.getppid() else 0
        self.table = table
        self.targets = table.counters["target"]
        self._c = table.counters
        self._slot = table.slots[worker]
        self._config = [k for k in self._slot if k[0] == "config"]
        self._stamps = [k for k in self._slot if k[0] == "stamp"]
        # what a header reads, looked up once: per config name its write count's view, per
        # env-state name its stamp's
        self._writes = [(key, key[1], table.array(worker, ("writes", key[1]))) for key in self._config]
        self._stamp_views = [(key[1], table.array(worker, key)) for key in self._stamps]
        self._request: Request | None = None  # the latest request read, decoded once
        self._lock = lock
        self._wakes = wakes
        self._relayed = relayed
        # this end's own semaphore, and the column that routes its notices elsewhere
        self._own = table.num_workers + worker if relayed else worker
        self._route = self._c["relay_to" if relayed else "wake_to"]
        self._acks = acks
        # the config as last copied out, with each name's write count then
        self._held: dict[str, Leaf] = {}
        self._held_writes: dict[str, int] = {}
        self._arrays = ArrayBuffers()  # large config values are copied into arrays let go of
        self._gated, self._gated_wake = gate  # see gated()

    def _copy_end(self, *, relayed: bool, gate: tuple[bool, bool]) -> SlotReader:
        return SlotReader(
            self.table, self.worker, self._lock, self._wakes, self._acks, owner=self._owner, relayed=relayed, gate=gate
        )

    def claim(self) -> SlotReader:
        """Mark the slot as served by this process (what the sender's liveness check reads); return self."""
        self._c["pid"][self.worker] = os.getpid()
        return self

    @property
    def link_name(self) -> str:
        """The link's name, the same in every process (ends of one link share a worker loop)."""
        return self.table.name

    @property
    def semaphore(self) -> int:
        """The index of the semaphore this end's notices release when not routed."""
        return self._own

    def relayed(self) -> SlotReader:
        """This end, waiting on the slot's relay instead of its wake-up (for a group's loop)."""
        return self._copy_end(relayed=True, gate=(False, False))

    def route_to(self, home: ReceiverLink) -> None:
        """From now on, every notice for this end (the sender's, or a relay's when this end
        is :meth:`relayed`) releases the semaphore ``home`` waits on (an end of the same link
        in this process), so that one thread waits for both."""
        if not isinstance(home, SlotReader) or home.table.name != self.table.name:
            raise EnvSyncError("a link end can only be routed to an end of the same link")
        self._route[self.worker] = 0 if home.semaphore == self._own else home.semaphore + 1

    def _routed(self, index: int, column: np.ndarray) -> Any:
        route = int(column[self.worker])
        return self._wakes[route - 1 if route else index]

    def poke_relay(self) -> None:
        """Wake the loop that waits on this slot's relay (the group beside the batched env)."""
        self._routed(self.table.num_workers + self.worker, self._c["relay_to"]).release()

    def target(self) -> int:
        return int(self.targets[self.worker])

    def counters(self, name: str, count: int) -> np.ndarray:
        return self._c[name][self.worker : self.worker + count]

    def read_header(self) -> Header:
        """The slot's header; a config name not written since the last read is the copy made
        then (a large config pushed once is copied out once, not at every later version)."""
        with locked(self._lock, "worker %d reading", self.worker):
            held, held_writes = self._held, self._held_writes
            for key, name, view in self._writes:
                writes = int(view)
                if held_writes.get(name) != writes:
                    held[name] = self._copy(key)
                    held_writes[name] = writes
            return Header(
                version=int(self.targets[self.worker]),
                config=dict(held),
                stamps={name: int(view) for name, view in self._stamp_views},
                undo=int(self._c["undo"][self.worker]),
            )

    def _copy(self, key: Key) -> Leaf:
        table = self.table
        if int(table.array(self.worker, table.source(key))) > 0:
            view, tensor = table.broadcast_arrays[key], table.broadcast[key]
        else:
            view, tensor = table.arrays[self.worker][key], self._slot[key]
        return self._arrays.copy(view) if view is not None else tensor.clone()

    def load_entries(self, version: int, names: list[str], load: Callable[[str, torch.Tensor], None]) -> bool:
        with locked(self._lock, "worker %d loading", self.worker):
            if int(self.targets[self.worker]) != version:
                return False
            for name in names:
                key = ("env_state", name)
                shared = int(self.table.array(self.worker, ("source", name))) > 0
                load(name, self.table.broadcast[key] if shared else self._slot[key])
            return True

    def request(self) -> Request | None:
        """The request this slot has not answered yet, or ``None`` (two integer reads while
        none is pending: this is read at every safe point)."""
        c, worker = self._c, self.worker
        ask = int(c["ask"][worker])
        if ask == 0 or ask == int(c["answered"][worker]):
            return None
        held = self._request
        if held is not None and held.id == ask:
            return held
        with locked(self._lock, "worker %d reading a request", worker):
            length = int(c["ask_len"][worker])
            data = bytes(self.table.areas["request"][worker, :length])
        self._request = request_of(unseal(data))
        return self._request

    def reply(self, reply: Reply) -> None:
        """Answer with ``reply`` and wake the sender; a reply larger than the slot's reply
        area is sent as a failure that says so."""
        area = self.table.areas["reply"]
        if reply.error is not None:  # a traceback's end, as a failure's
            tail = reply.error.encode("utf-8", "replace")[-ERROR_BYTES:]
            reply = reply._replace(error=tail.decode("utf-8", "replace"))
        data = seal(plain(reply))
        if len(data) > area.shape[1]:
            text = f"the reply to request {reply.id} is {len(data)} bytes; a slot's reply area holds {area.shape[1]}"
            data = seal(plain(Reply(reply.id, {}, text)))
        with locked(self._lock, "worker %d replying", self.worker):
            area[self.worker, : len(data)] = np.frombuffer(data, dtype=np.uint8)
            self._c["reply_len"][self.worker] = len(data)
            self._c["answered"][self.worker] = reply.id
        self._acks[1].release()

    def ack_received(self, version: int) -> None:
        received = self._c["received"]
        if version > received[self.worker]:
            received[self.worker] = version  # the counter first: a sender woken reads it
            self._acks[0].release()

    def ack_applied(self, version: int) -> None:
        self._c["reached"][self.worker] = version
        if self._gated:
            # the env holds it; its batched level acknowledges "applied" once it holds it too
            self.ack_received(version)
            if self._gated_wake:
                self.poke_relay()  # the group, in another process, catches its level up
            return
        self._c["applied"][self.worker] = version
        self._acks[1].release()
        self.ack_received(version)

    def gated(self, *, wake_group: bool) -> SlotReader:
        """This end, its "applied" left to the batched level above its env (which writes it
        once it holds the version too, see :mod:`envsync.integrations.torchrl.outer`): an
        apply here is recorded as *reached*; ``wake_group``: wake the group through the
        slot's relay after each (a sub-env in another process than its group)."""
        return self._copy_end(relayed=self._relayed, gate=(True, wake_group))

    def report_failure(self, version: int, text: str) -> None:
        _write_text(self.table.error, self._c["error_len"], self.worker, text)
        self._c["failed"][self.worker] = version
        self._acks[0].release()
        self._acks[1].release()

    def set_busy(self, busy: bool) -> None:
        self._c["busy"][self.worker] = int(busy)

    def is_busy(self) -> bool:
        return bool(self._c["busy"][self.worker])

    def poke(self) -> None:
        self._routed(self._own, self._route).release()

    def note_versions(self, ran: int | None, obs: int) -> None:
        """Record the version the env's latest step ran under (``None``: unchanged) and the
        one its current observation comes from (read by a batched env's tags)."""
        if ran is not None:
            self._c["ran"][self.worker] = ran
        self._c["obs"][self.worker] = obs

    def wait_notice(self, timeout: float) -> bool:
        """Block until a notice for this end (or one routed to it) comes, or ``timeout``
        passes; then take back the notices that came meanwhile (the counters say what
        each was for: a push to many envs routed here wakes its loop once)."""
        semaphore = self._wakes[self._own]
        if not semaphore.acquire(timeout=timeout):
            return False
        _take_back(semaphore)
        return True

    def owner_alive(self) -> bool:
        """Whether the process that owns the link (the sender's) still runs."""
        if self._parent:
            return os.getppid() == self._parent
        return not self._owner or self._owner == os.getpid() or pid_alive(self._owner)

    def close(self) -> None:
        return None
