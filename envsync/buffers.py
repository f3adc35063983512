"""Reused buffers for large copies: a push of a fixed-shape payload allocates nothing once
warm, in the main process (:data:`BUFFERS`) and in a worker copying a large config value out
of shared memory (:class:`ArrayBuffers`)."""

from __future__ import annotations

import sys
import threading

import numpy as np
import torch


class Buffers:
    """Where the copy of a large pushed tensor goes: into the buffer of an earlier push of
    the same shape and dtype that nothing references any more (no Python reference, no view
    of its storage: the sender's records, a rollback's undo and the config history drop
    theirs as they move on), else a new one. A fresh 32 MB buffer costs its page faults,
    about 6x a copy into a warm one; a push of a fixed-shape payload allocates nothing once
    warm. Small tensors are copied plainly."""

    MIN_BYTES = 1 << 20
    KEEP = 6
    """Buffers kept per shape and dtype (the records hold a few: current, undo, history)."""

    def __init__(self) -> None:
        self._pools: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def copy(self, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A copy of ``value`` as a CPU tensor of ``dtype``, never ``value`` itself."""
        nbytes = value.numel() * dtype.itemsize
        if nbytes < self.MIN_BYTES or _storage_uses is None:
            return value.to(device="cpu", dtype=dtype, copy=True)
        key = (tuple(value.shape), dtype)
        with self._lock:
            pool = self._pools.setdefault(key, [])
            for buffer in pool:
                # referenced by the pool and this loop only (and getrefcount's argument), its
                # storage by this tensor only (and the storage object asked for here)
                if sys.getrefcount(buffer) == 3 and _storage_uses(buffer) == 2:
                    return buffer.copy_(value)
            buffer = value.to(device="cpu", dtype=dtype, copy=True)
            if len(pool) < self.KEEP:
                pool.append(buffer)
            return buffer


class ArrayBuffers:
    """:class:`Buffers` for numpy copies (a worker's copy of a large config value out of
    shared memory): into an earlier copy's array of the same shape and dtype that nothing
    references any more (the env, the receiver's previous config and any view let go of it)."""

    def __init__(self) -> None:
        self._pools: dict[tuple[tuple[int, ...], np.dtype], list[np.ndarray]] = {}

    def copy(self, view: np.ndarray) -> np.ndarray:
        if view.nbytes < Buffers.MIN_BYTES:
            return view.copy()
        pool = self._pools.setdefault((view.shape, view.dtype), [])
        for array in pool:
            if sys.getrefcount(array) == 3:  # the pool, this loop, getrefcount's argument
                np.copyto(array, view)
                return array
        array = view.copy()
        if len(pool) < Buffers.KEEP:
            pool.append(array)
        return array


def _storage_uses(tensor: torch.Tensor) -> int:
    return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata))


if not hasattr(torch._C, "_storage_Use_Count"):  # a torch without it: no reuse
    _storage_uses = None  # type: ignore[assignment]

BUFFERS = Buffers()
"""The buffers of this process's pushes."""
