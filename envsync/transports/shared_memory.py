"""A transport over one shared-memory file per sender attachment.

The file ``/dev/shm/envsync-<owner pid>-<token>`` (mode 0600) holds, per worker, seven int64
counters, an error-text buffer and the payload (config, env state, stamps). Workers map it by
path; writes of one worker's slot are guarded by a seqlock (the sender is the only writer of a
payload, a worker is the only writer of its acknowledgements), so neither side ever blocks the
other. A file whose owner process is dead is removed by the next channel created.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from envsync.protocol import NO_FAILURE, WorkerStatus

SHM_DIR = "/dev/shm"
PREFIX = "envsync-"
ERROR_BYTES = 16384
_COUNTERS = ("seq", "target", "received", "applied", "failed", "error_len", "pid", "busy")
_ALIGN = 64


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class _Field:
    key: tuple[str, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * torch.empty((), dtype=self.dtype).element_size()


def _plan(payload: TensorDictBase, num_workers: int) -> tuple[list[_Field], int]:
    """Lay out counters, error buffer and payload leaves, each 64-byte aligned."""
    fields = []
    offset = 0
    for name in _COUNTERS:
        fields.append(_Field((name,), torch.int64, (num_workers,), offset))
        offset = _align(offset + 8 * num_workers)
    fields.append(_Field(("error",), torch.uint8, (num_workers, ERROR_BYTES), offset))
    offset = _align(offset + num_workers * ERROR_BYTES)
    for key, value in payload.items(include_nested=True, leaves_only=True):
        key = key if isinstance(key, tuple) else (key,)
        field = _Field(("payload", *key), value.dtype, (num_workers, *value.shape), offset)
        fields.append(field)
        offset = _align(offset + field.nbytes)
    return fields, max(offset, _ALIGN)


class _Views:
    """Typed views into the mapped file."""

    def __init__(self, path: str, fields: list[_Field], size: int, num_workers: int) -> None:
        raw = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        self.raw = raw
        tensors = {f.key: raw[f.offset : f.offset + f.nbytes].view(f.dtype).view(f.shape) for f in fields}
        self.counters = {name: tensors[(name,)].numpy() for name in _COUNTERS}
        self.error = tensors[("error",)].numpy()
        self.payload = TensorDict({k[1:]: v for k, v in tensors.items() if k[0] == "payload"}, batch_size=[num_workers])
        # one view per worker, made once: indexing a TensorDict costs ~15 µs a time
        self.slots = [self.payload[w] for w in range(num_workers)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Remove envsync files whose owner process is dead; return the paths removed.

    Examples:
        >>> isinstance(sweep_stale(), list)
        True
    """
    removed = []
    for name in os.listdir(directory):
        if not name.startswith(PREFIX):
            continue
        owner = name[len(PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not _pid_alive(int(owner)):
            path = os.path.join(directory, name)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
    return removed


def _unlink(path: str, owner: int) -> None:
    if os.getpid() == owner:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class SharedMemoryChannel:
    """The sender end: creates the file, writes payloads, reads acknowledgements.

    Args:
        payload: the payload of one worker (its initial desired state); fixes the layout.
        num_workers: how many workers read this channel.
        semaphores: one wake-up semaphore per worker (from the workers' multiprocessing
            context, or ``threading.Semaphore`` for an in-process receiver).

    Examples:
        >>> import threading
        >>> from tensordict import TensorDict
        >>> ch = SharedMemoryChannel(TensorDict(x=torch.zeros(2)), 1, semaphores=[threading.Semaphore(0)])
        >>> ch.write(0, 1, TensorDict(x=torch.ones(2)))
        >>> end = ch.handle().open(0)
        >>> version, payload = end.read()
        >>> version, payload["x"].tolist()
        (1, [1.0, 1.0])
        >>> ch.close()
    """

    def __init__(self, payload: TensorDictBase, num_workers: int, *, semaphores: list[Any]) -> None:
        sweep_stale()
        self.num_workers = num_workers
        self._fields, self._size = _plan(payload, num_workers)
        self.path = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self._size)
        finally:
            os.close(fd)
        self._finalizer = weakref.finalize(self, _unlink, self.path, os.getpid())
        self._views: _Views | None = _Views(self.path, self._fields, self._size, num_workers)
        self._views.counters["failed"][:] = NO_FAILURE
        self._views.payload.update_(payload.expand(num_workers))
        self._semaphores = semaphores

    def _live(self) -> _Views:
        if self._views is None:
            raise RuntimeError("channel is closed")
        return self._views

    def handle(self) -> SharedMemoryHandle:
        """A picklable handle that workers use to open their end."""
        return SharedMemoryHandle(self.path, self._fields, self._size, self.num_workers, self._semaphores)

    def write(self, worker: int, version: int, payload: TensorDictBase) -> None:
        """Update the given payload entries of ``worker`` and set its target, atomically."""
        views = self._live()
        seq = views.counters["seq"]
        seq[worker] += 1
        try:
            views.slots[worker].update_(payload)
            views.counters["target"][worker] = version
        finally:
            seq[worker] += 1

    def desired(self, worker: int) -> TensorDict:
        """A copy of the payload currently published to ``worker``, read back from the file."""
        return self._live().slots[worker].clone()

    def notify(self, worker: int) -> None:
        """Wake the worker's listener, unless its collector is busy: a busy worker notices
        the new target at its next safe point, and a wake-up costs a context switch."""
        if not self._live().counters["busy"][worker]:
            self._semaphores[worker].release()

    def status(self, worker: int) -> WorkerStatus:
        c = self._live().counters
        return WorkerStatus(
            worker=worker,
            target=int(c["target"][worker]),
            received=int(c["received"][worker]),
            applied=int(c["applied"][worker]),
            failed=int(c["failed"][worker]),
        )

    def worker_pid(self, worker: int) -> int:
        """The pid a receiver wrote when it opened its end (0 before)."""
        return int(self._live().counters["pid"][worker])

    def error_text(self, worker: int) -> str:
        views = self._live()
        length = int(views.counters["error_len"][worker])
        return bytes(views.error[worker, :length]).decode("utf-8", errors="replace")

    def close(self) -> None:
        self._views = None
        self._finalizer()


@dataclass
class SharedMemoryHandle:
    """What a worker needs to open its end: the path, the layout and the semaphores."""

    path: str
    fields: list[_Field]
    size: int
    num_workers: int
    semaphores: list[Any]

    def open(self, worker: int) -> SharedMemoryReceiver:
        """Map the file and return ``worker``'s end."""
        if not 0 <= worker < self.num_workers:
            raise IndexError(f"worker {worker} out of range for {self.num_workers} workers")
        return SharedMemoryReceiver(
            _Views(self.path, self.fields, self.size, self.num_workers), worker, self.semaphores[worker]
        )


class SharedMemoryReceiver:
    """One worker's end of a :class:`SharedMemoryChannel`."""

    def __init__(self, views: _Views, worker: int, semaphore: Any) -> None:
        self.worker = worker
        self._views = views
        self._c = views.counters
        self._target = views.counters["target"]
        self._semaphore = semaphore
        self._scratch: TensorDict | None = None
        self._c["pid"][worker] = os.getpid()

    def target(self) -> int:
        return int(self._target[self.worker])

    def read(self, since: int = -1) -> tuple[int, TensorDict]:
        """Snapshot (version, payload); env-state entries stamped <= ``since`` are left out.

        Env-state entries are copied into buffers this end keeps (allocating 32 MB afresh
        costs more than the copy): they stay valid until the next ``read``.
        """
        seq = self._c["seq"]
        i = self.worker
        slot = self._views.slots[i]
        while True:
            before = seq[i]
            if before % 2 == 0:
                version = int(self._target[i])
                snapshot = slot.exclude("env_state").clone()
                if "stamp" in snapshot.keys():
                    keys = [k for k, stamp in snapshot["stamp"].items(True, True) if int(stamp) > since]
                    snapshot["env_state"] = self._copy_env_state(slot, keys)
                if seq[i] == before:
                    return version, snapshot
            time.sleep(0.0001)

    def _copy_env_state(self, slot: TensorDictBase, keys: list[Any]) -> TensorDict:
        if self._scratch is None:
            self._scratch = slot["env_state"].clone()
        out = self._scratch.select(*keys)
        out.update_(slot["env_state"].select(*keys))
        return out

    def ack_received(self, version: int) -> None:
        received = self._c["received"]
        if version > received[self.worker]:
            received[self.worker] = version

    def ack_applied(self, version: int) -> None:
        self._c["applied"][self.worker] = version
        self.ack_received(version)

    def report_failure(self, version: int, text: str) -> None:
        data = text.encode("utf-8", errors="replace")[-ERROR_BYTES:]
        self._views.error[self.worker, : len(data)] = np.frombuffer(data, dtype=np.uint8)
        self._c["error_len"][self.worker] = len(data)
        self._c["failed"][self.worker] = version

    def set_busy(self, busy: bool) -> None:
        self._c["busy"][self.worker] = int(busy)

    def wait_notice(self, timeout: float) -> bool:
        return bool(self._semaphore.acquire(timeout=timeout))
