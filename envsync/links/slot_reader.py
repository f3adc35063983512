"""One worker's side of the slot table (:mod:`envsync.links.table`): it reads its slot under
the slot lock (:mod:`envsync.links.slots`), acknowledges with single aligned integers (one
writer each: no lock), answers requests through its reply area, and waits for notices on
its semaphore (or the one its notices are routed to, :meth:`SlotReader.route_to`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from envsync.buffers import ArrayBuffers
from envsync.errors import EnvSyncError
from envsync.links.base import Header, Key, Notices
from envsync.links.inline import InlineWake
from envsync.links.locks import locked, take_back
from envsync.links.records import request_of, sealed_reply, unseal
from envsync.links.table import Table, pid_alive
from envsync.protocol import Reply, Request
from envsync.state import Leaf


def read_request(table: Table, slot: int, lock: Any, held: Request | None) -> Request | None:
    """The request ``slot`` has not answered yet, or ``None``; ``held``, the request last
    read (of this slot, or of another slot the same request went to), is not decoded again."""
    c = table.counters
    ask = int(c["ask"][slot])
    if ask == 0 or ask == int(c["answered"][slot]):
        return None
    if held is not None and held.id == ask:
        return held
    with locked(lock, "worker %d reading a request", slot):
        source = int(c["ask_at"][slot]) - 1  # the slot whose area holds it (a group's first asked)
        source = slot if source < 0 else source
        length = int(c["ask_len"][source])
        data = bytes(table.area("request", source)[:length])
    request = request_of(unseal(data))
    return request if request.id == ask else None  # overwritten by a newer request: not this one


def write_reply(table: Table, slot: int, lock: Any, acks: Any, reply: Reply) -> None:
    """Answer ``slot``'s request with ``reply`` and wake the sender; a reply larger than the
    slot's reply area is sent as a failure that says so."""
    area = table.area("reply", slot)
    data = sealed_reply(reply, len(area), "a slot's reply area")
    with locked(lock, "worker %d replying", slot):
        area[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        table.counters["reply_len"][slot] = len(data)
        table.counters["reply_at"][slot] = 0  # in its own area
        table.counters["answered"][slot] = reply.id
    acks[1].release()


class SlotReader:
    """One worker's operations on a table (both links use it).

    Notices: ``wakes`` holds every slot's two semaphores, its wake-up (released by the
    sender's notify) then its *relay* (released by a receiver in a ``ParallelEnv``'s
    sub-process, to wake its batched env's group in the worker). An end waits on one of its
    slot's (``relayed``: the relay), unless it was routed to another end's
    (:meth:`route_to`): then every notice for it releases that one, so one worker loop
    waits on one semaphore for every env it holds (:mod:`envsync.worker.loop`).
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
        # read through a memoryview: an index gives a Python int (numpy's scalar costs ~1k
        # instructions, and a safe point reads the target at every step)
        self._target_cell = self.targets[worker : worker + 1].data
        self._c = table.counters
        self._slot = table.slot(worker)
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

    def route_to(self, home: Notices) -> None:
        """From now on, every notice for this end (the sender's, or a relay's when this end
        is :meth:`relayed`) releases the semaphore ``home`` waits on (an end of the same link
        in this process), so that one thread waits for both."""
        if not isinstance(home, SlotReader) or home.table.name != self.table.name:
            raise EnvSyncError("a link end can only be routed to an end of the same link")
        self._route[self.worker] = 0 if home.semaphore == self._own else home.semaphore + 1

    def _routed(self, index: int, column: np.ndarray) -> Any:
        route = int(column[self.worker])
        return self._wakes[route - 1 if route else index]

    def turns_here(self, turn: Callable[[], bool]) -> None:
        """Let the sender's notices for this end (and those routed to it) run ``turn``, the
        loop's turn, in the sender's thread (an in-process link, :mod:`envsync.links.inline`);
        across processes a notice wakes the loop's thread, and this does nothing."""
        wake = self._wakes[self._own]
        if isinstance(wake, InlineWake):
            wake.turn = turn

    def poke_relay(self) -> None:
        """Wake the loop that waits on this slot's relay (the group beside the batched env)."""
        self._routed(self.table.num_workers + self.worker, self._c["relay_to"]).release()

    def target(self) -> int:
        target: int = self._target_cell[0]
        return target

    def read_counters(self, names: Sequence[str], count: int, *, copy: bool = True) -> tuple[np.ndarray, ...]:
        """Copies of the counters ``names`` of ``count`` slots from this end's, read one after
        the other (each is a single aligned integer per slot, written by one side only);
        ``copy=False``: read-only views of the live columns, for a reader that compares them
        at once and keeps nothing (no copy of every world's counters at every wake)."""
        first, c = self.worker, self._c
        if copy:
            return tuple(c[name][first : first + count].copy() for name in names)
        views = tuple(c[name][first : first + count] for name in names)
        for view in views:
            view.flags.writeable = False
        return views

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
                stamps=self._stamps_now(),
                undo=int(self._c["undo"][self.worker]),
            )

    def pushed(self) -> int:
        """The latest version written to any slot of the link (one integer read)."""
        return int(self.table.pushed[0])

    def read_stamps(self) -> tuple[int, dict[str, int]]:
        """The slot's target and, per env-state name, the version that last pushed it (what
        :meth:`read_header` reads, without copying the config out)."""
        with locked(self._lock, "worker %d reading stamps", self.worker):
            return int(self.targets[self.worker]), self._stamps_now()

    def _stamps_now(self) -> dict[str, int]:
        """Per env-state name, the version that last pushed it (the caller holds the slot lock)."""
        return {name: int(view) for name, view in self._stamp_views}

    def _copy(self, key: Key) -> Leaf:
        table = self.table
        if int(table.array(self.worker, table.source(key))) > 0:
            view, tensor = table.broadcast_arrays[key], table.broadcast[key]
        else:
            view, tensor = table.numpy_row(self.worker, key), self._slot[key]
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
        self._request = read_request(self.table, self.worker, self._lock, self._request)
        return self._request

    def reply(self, reply: Reply) -> None:
        """Answer with ``reply`` and wake the sender (see :func:`write_reply`)."""
        write_reply(self.table, self.worker, self._lock, self._acks, reply)

    def ack_received(self, version: int) -> None:
        received = self._c["received"]
        if version > received[self.worker]:
            received[self.worker] = version  # the counter first: a sender woken reads it
            self._acks[0].release()

    def ack_applied(self, version: int) -> None:
        reached = self._c["reached"]
        if version > reached[self.worker]:  # never back: a batched level's gate acknowledges a
            reached[self.worker] = version  # version it read, and the env may have gone on since
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
        once it holds the version too, see :mod:`envsync.worker.gate`): an
        apply here is recorded as *reached*; ``wake_group``: wake the group through the
        slot's relay after each (a sub-env in another process than its group)."""
        return self._copy_end(relayed=self._relayed, gate=(True, wake_group))

    def report_failure(self, version: int, text: str) -> None:
        self.table.write_error(self.worker, text)
        self._c["failed"][self.worker] = version
        self._acks[0].release()
        self._acks[1].release()

    def set_busy(self, busy: bool, count: int = 1) -> None:
        self._c["busy"][self.worker : self.worker + count] = int(busy)

    def is_busy(self) -> bool:
        return bool(self._c["busy"][self.worker])

    def poke(self) -> None:
        self._routed(self._own, self._route).release()

    def note_versions(self, ran: int | None, obs: int) -> None:
        """Record the version the env's next step runs under (``None``: unchanged) and the
        one its observation comes from (read by a batched env's tags after the step)."""
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
        take_back(semaphore)
        return True

    def owner_alive(self) -> bool:
        """Whether the process that owns the link (the sender's) still runs."""
        if self._parent:
            return os.getppid() == self._parent
        return not self._owner or self._owner == os.getpid() or pid_alive(self._owner)
