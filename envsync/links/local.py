"""The in-process link: the same slot table in ordinary memory, with thread locks. Used by
the single-process ``Collector`` (its env lives in the main process) and by unit tests of
the sender and receiver logic, which then run in milliseconds."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from envsync.links.base import Key
from envsync.links.inline import InlineWake, semaphore
from envsync.links.locks import per_slot
from envsync.links.rows_reader import RowsReader
from envsync.links.slot_reader import SlotReader
from envsync.links.slots import SlotWriter
from envsync.links.table import Field, Table, plan
from envsync.state import Leaf


class LocalLink(SlotWriter):
    """The sender end over memory in this process.

    Args:
        leaves: one worker's starting leaves (they fix the layout).
        num_workers: how many receivers read this link.
        alive: tells whether a worker can still answer.
        group: consecutive slots that share one lock, wake-up and relay (the rows of a
            natively batched env, served by one worker loop).

    Examples:
        >>> link = LocalLink({("config", "x"): torch.zeros(2)}, 2)
        >>> link.write(1, 3, {("config", "x"): torch.ones(2)})
        >>> link.handle().open(1).read_header().config["x"].tolist()
        [1.0, 1.0]
        >>> link.handle().open(0).read_header().version
        0
    """

    def __init__(
        self,
        leaves: Mapping[Key, Leaf],
        num_workers: int,
        *,
        alive: Callable[[int], bool] = lambda w: True,
        group: int = 1,
    ) -> None:
        fields, size = plan(leaves, num_workers, group)
        table = Table(_zeroed(size, fields), fields, num_workers, group=group)
        groups = -(-num_workers // group)  # one lock, wake-up and relay per group of slots (a native env's rows)
        group_locks = [threading.Lock() for _ in range(groups)]
        group_wakes = [InlineWake() for _ in range(2 * groups)]  # a notice runs the loop's turn here
        locks, wakes = per_slot(group_locks, group_wakes, num_workers, group)
        super().__init__(table, locks, wakes, (semaphore(), semaphore()))
        self.initialise(leaves)
        self._alive = alive
        self._ends = LocalHandle(table, locks, wakes, self._acks)

    def alive(self, worker: int) -> bool:
        return self._alive(worker)

    def handle(self) -> LocalHandle:
        return self._ends

    def close(self) -> None:
        return None

    def _wake(self, number: int, here: bool) -> None:
        wake = self._wakes[number]
        if here:
            wake.deliver()  # the loop's turn in this thread, when it can run here
        else:
            wake.release()


def _zeroed(size: int, fields: list[Field]) -> torch.Tensor:
    """The block, zeroed except the error, request and reply areas (read only up to the
    lengths their counters give): left unwritten, their pages cost no memory until a failure,
    a request or a reply lands in them (they are most of a slot's bytes)."""
    raw = torch.empty(size, dtype=torch.uint8)
    for field in fields:
        if field.key not in (("error",), ("request",), ("reply",)):
            raw[field.offset : field.offset + field.nbytes].zero_()
    return raw


class LocalHandle:
    """Opens receiver ends on the same table (not picklable: in-process only)."""

    def __init__(self, table: Table, locks: list[Any], wakes: list[Any], acks: Any) -> None:
        self._table = table
        self._locks = locks
        self._wakes = wakes
        self._acks = acks

    def open(self, worker: int, *, claim: bool = True) -> SlotReader:
        if not 0 <= worker < self._table.num_workers:
            raise IndexError(f"worker {worker} out of range for {self._table.num_workers} workers")
        reader = SlotReader(self._table, worker, self._locks[worker], self._wakes, self._acks)
        return reader.claim() if claim else reader

    def open_rows(self, first: int, count: int, *, gated: bool = False, claim: bool = True) -> RowsReader:
        if not (first >= 0 and first + count <= self._table.num_workers):
            raise IndexError(f"rows {first}..{first + count} out of range for {self._table.num_workers} slots")
        locks = self._locks[first : first + count]
        return RowsReader(self._table, first, count, locks, self._wakes, self._acks, gated=gated, claim=claim)
