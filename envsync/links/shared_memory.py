"""The shared-memory link: one file ``/dev/shm/envsync-<owner pid>-<token>`` (mode 0600)
per attachment, holding the slot table (:mod:`envsync.links.slots`); locks and semaphores
come from a spawn multiprocessing context, whose semaphores are *named*: a handle pickles
them by name, so it can also reach a process started after the link (the sub-processes of a
``ParallelEnv`` get their ends through its pipes).

The owner holds a shared ``flock`` on the file for as long as the link is open, so a file
whose owner is gone is recognised by its lock, not by a pid (pids are reused, and other
PID namespaces may share /dev/shm): the next link created removes it. A forked child closes
its copy of the owner's descriptor, so a worker that outlives a killed owner does not keep
the lock. The file ends with the names of the link's semaphores (after the table), so that
a sweep removes them too: multiprocessing unlinks them only when their creator exits
cleanly, and a Ray actor is killed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from envsync.links.base import Key
from envsync.links.locks import per_slot
from envsync.links.rows_reader import RowsReader
from envsync.links.slot_reader import SlotReader
from envsync.links.slots import SlotWriter
from envsync.links.table import Field, Table, pid_alive, plan
from envsync.state import Leaf

SHM_DIR = "/dev/shm"
PREFIX = "envsync-"
_TRAILER = 8
"""Bytes of the length that ends a link file (its semaphore names come before it)."""

_OWNED: set[int] = set()
"""The descriptors (each holding a link file's lock) of the links this process owns."""
_MAPPED: weakref.WeakValueDictionary[str, Table] = weakref.WeakValueDictionary()
"""This process's mapping of each link's table, by path (see :meth:`SharedMemoryHandle.table`)."""


def _close_owned_in_child() -> None:
    for fd in _OWNED:
        with contextlib.suppress(OSError):
            os.close(fd)
    _OWNED.clear()


os.register_at_fork(after_in_child=_close_owned_in_child)


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Remove envsync files that no live link holds; return the paths removed.

    Examples:
        >>> isinstance(sweep_stale(), list)
        True
    """
    removed = []
    for name in os.listdir(directory):
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            semaphores = [os.path.join(directory, f"sem.{n.lstrip('/')}") for n in _semaphore_names(fd)]
        except BlockingIOError:
            continue  # a live owner holds it
        finally:
            os.close(fd)
        for stale in [*semaphores, path]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)
                removed.append(stale)
    return removed


def sweep_until_gone(paths: Sequence[str], timeout: float) -> None:
    """Sweep until none of ``paths`` (files of owners just killed) is left on this machine,
    waiting at most ``timeout`` seconds for their last processes to let go. A path on another
    machine is not here: the next link made there sweeps it."""
    deadline = time.monotonic() + timeout
    while True:
        sweep_stale()
        if not any(os.path.exists(p) for p in paths) or time.monotonic() >= deadline:
            return
        time.sleep(0.05)


def _semaphore_names(fd: int) -> list[str]:
    """The semaphore names a link file ends with (none for a file too short to hold them)."""
    end = os.fstat(fd).st_size
    if end < _TRAILER:
        return []
    length = int.from_bytes(os.pread(fd, _TRAILER, end - _TRAILER), "little")
    if not 0 < length <= end - _TRAILER:
        return []
    text = os.pread(fd, length, end - _TRAILER - length).decode(errors="replace")
    return [n for n in text.split("\n") if n.startswith("/") and "/" not in n[1:]]


def _semaphore_name(sync: Any) -> str | None:
    """The name of a multiprocessing lock's or semaphore's semaphore (``None``: unnamed)."""
    return getattr(getattr(sync, "_semlock", None), "name", None)


def _names_trailer(syncs: Sequence[Any]) -> bytes:
    """The trailer naming ``syncs``' semaphores (named ones only)."""
    blob = "\n".join(n for n in map(_semaphore_name, syncs) if n).encode()
    return blob + len(blob).to_bytes(_TRAILER, "little")


def _release(path: str, fd: int, owner: int) -> None:
    if os.getpid() == owner:
        _OWNED.discard(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        with contextlib.suppress(OSError):
            os.close(fd)


class SharedMemoryLink(SlotWriter):
    """The sender end over a /dev/shm file: a :class:`~envsync.links.slots.SlotWriter` on a
    table it creates, owns and unlinks.

    Args:
        leaves: one worker's starting leaves (they fix the layout).
        num_workers: how many workers read this link.
        ctx: the workers' multiprocessing context (locks and semaphores are made from it).
        alive: tells whether a worker's process still runs.
        group: consecutive slots that live in one process and one worker loop (the rows of a
            natively batched env) share one slot lock, one wake-up and one relay: no
            semaphore per world (each named semaphore is a mapping in every process that opens
            it, against the kernel's limit of 65,530 a process).

    Examples:
        >>> import multiprocessing as mp
        >>> link = SharedMemoryLink({("config", "x"): torch.zeros(2)}, 1, ctx=mp.get_context("spawn"))
        >>> link.write(0, 1, {("config", "x"): torch.ones(2)})
        >>> end = link.handle().open(0)
        >>> header = end.read_header()
        >>> header.version, header.config["x"].tolist()
        (1, [1.0, 1.0])
        >>> link.close()
    """

    def __init__(
        self,
        leaves: Mapping[Key, Leaf],
        num_workers: int,
        *,
        ctx: Any,
        alive: Callable[[int], bool] = lambda worker: True,
        group: int = 1,
    ) -> None:
        sweep_stale()
        self.num_workers = num_workers
        fields, size = plan(leaves, num_workers, group)
        token = f"{os.getpid()}-{secrets.token_hex(6)}"
        self.path = os.path.join(SHM_DIR, f"{PREFIX}{token}")
        # locked under a name no sweep looks at, then renamed: a sweep never sees it unlocked
        hidden = os.path.join(SHM_DIR, f".{PREFIX}{token}")
        groups = -(-num_workers // group)
        locks = [ctx.Lock() for _ in range(groups)]
        # per group of slots a wake-up (the sender wakes the receiver), then a relay (a receiver
        # in a ParallelEnv's sub-process wakes its batched env's group, in the worker)
        wakes = [ctx.Semaphore(0) for _ in range(2 * groups)]
        acks = (ctx.Semaphore(0), ctx.Semaphore(0))
        trailer = _names_trailer([*locks, *wakes, *acks])
        fd = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.ftruncate(fd, size + len(trailer))
        os.pwrite(fd, trailer, size)
        os.rename(hidden, self.path)
        _OWNED.add(fd)
        self._finalizer = weakref.finalize(self, _release, self.path, fd, os.getpid())
        self._handle: SharedMemoryHandle | None = SharedMemoryHandle(
            path=self.path,
            fields=fields,
            size=size,
            num_workers=num_workers,
            group=group,
            locks=locks,
            wakes=wakes,
            acks=acks,
            owner=os.getpid(),
        )
        handle = self._handle
        super().__init__(handle.table(), *per_slot(locks, wakes, num_workers, group), handle.acks)
        self.initialise(leaves)
        self._alive = alive

    def alive(self, worker: int) -> bool:
        """Whether the slot's process can still answer: the collector says its worker lives,
        and the process that opened the slot (the worker, or a ``ParallelEnv``'s sub-process
        for a sub-env) still runs."""
        if not self._alive(worker):
            return False
        pid = self.worker_pid(worker)
        return not pid or pid == os.getpid() or pid_alive(pid)

    def worker_pid(self, worker: int) -> int:
        """The pid a receiver wrote when it opened its end (0 before)."""
        return int(self.table.counters["pid"][worker])

    def handle(self) -> SharedMemoryHandle:
        if self._handle is None:
            raise RuntimeError("link is closed")
        return self._handle

    def close(self) -> None:
        # drop every reference to the locks and semaphores: they are freed with the last one (the
        # mapping stays valid for whatever still reads it; its file is unlinked)
        self.release()
        self._handle = None
        self._finalizer()


@dataclass
class SharedMemoryHandle:
    """What a worker needs to open its end: the path, the layout, the locks and semaphores
    (one of each per group of slots, see :class:`SharedMemoryLink`)."""

    path: str
    fields: list[Field]
    size: int
    num_workers: int
    group: int
    locks: list[Any]
    wakes: list[Any]
    acks: tuple[Any, Any]
    owner: int
    _slots: tuple[list[Any], list[Any]] | None = field(default=None, init=False, repr=False, compare=False)

    def table(self) -> Table:
        """The table, mapped once per process while any of its ends lives (a natively
        batched env opens one end per row: a mapping each would cost n views n times)."""
        table = _MAPPED.get(self.path)
        if table is None:
            raw = torch.from_file(self.path, shared=True, size=self.size, dtype=torch.uint8)
            table = _MAPPED[self.path] = Table(raw, self.fields, self.num_workers, group=self.group, name=self.path)
        return table

    def __reduce__(self) -> tuple[Any, ...]:
        if any(_semaphore_name(s) is None for s in (*self.locks, *self.wakes, *self.acks)):
            return super().__reduce__()  # type: ignore[return-value]  # unnamed: only at process start
        state = (self.path, self.fields, self.size, self.num_workers, self.group, self.owner)
        return _rebuild_handle, (
            state,
            [_portable(s) for s in self.locks],
            [_portable(s) for s in self.wakes],
            [_portable(s) for s in self.acks],
        )

    def open(self, worker: int, *, claim: bool = True) -> SlotReader:
        """Map the file and return ``worker``'s end."""
        if not 0 <= worker < self.num_workers:
            raise IndexError(f"worker {worker} out of range for {self.num_workers} workers")
        if self._slots is None:
            self._slots = per_slot(self.locks, self.wakes, self.num_workers, self.group)
        locks, wakes = self._slots
        reader = SlotReader(self.table(), worker, locks[worker], wakes, self.acks, owner=self.owner)
        return reader.claim() if claim else reader

    def open_rows(self, first: int, count: int, *, gated: bool = False, claim: bool = True) -> RowsReader:
        """Map the file and return the end of the ``count`` rows from slot ``first`` on."""
        if not (first >= 0 and first + count <= self.num_workers):
            raise IndexError(f"rows {first}..{first + count} out of range for {self.num_workers} slots")
        if self._slots is None:
            self._slots = per_slot(self.locks, self.wakes, self.num_workers, self.group)
        locks, wakes = self._slots
        rows = locks[first : first + count]
        return RowsReader(self.table(), first, count, rows, wakes, self.acks, gated=gated, claim=claim)


def _portable(sync: Any) -> tuple[type, tuple[Any, ...]]:
    semlock = sync._semlock
    return type(sync), (semlock.handle, semlock.kind, semlock.maxvalue, semlock.name)


def _reopen(portable: tuple[type, tuple[Any, ...]]) -> Any:
    cls, state = portable
    sync: Any = object.__new__(cls)
    sync.__setstate__(state)  # reopens the semaphore by its name (sem_open)
    return sync


def _rebuild_handle(state: tuple[Any, ...], locks: list[Any], wakes: list[Any], acks: list[Any]) -> SharedMemoryHandle:
    path, fields, size, num_workers, group, owner = state
    return SharedMemoryHandle(
        path=path,
        fields=fields,
        size=size,
        num_workers=num_workers,
        group=group,
        locks=[_reopen(s) for s in locks],
        wakes=[_reopen(s) for s in wakes],
        acks=(_reopen(acks[0]), _reopen(acks[1])),
        owner=owner,
    )
