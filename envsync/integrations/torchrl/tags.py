"""The tags of collected frames: ``"env_version"`` and ``"env_index"`` (at the root and
under ``"next"``), written once per rollout from the frames at which a version took effect
(:data:`Changes`), kept out of torchrl's rollout buffer while it stacks the steps, and the
truncation a ``"truncate"`` version ends an episode with."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

VERSION_KEY = "env_version"
INDEX_KEY = "env_index"

Changes = list[tuple[int, int]]
"""``(frame index, version)`` pairs: the version from that frame of the rollout on."""


def mark_change(changes: Changes, frame: int, version: int) -> None:
    """Note that ``version`` holds from ``frame`` on (merged with the latest change)."""
    if changes[-1][1] == version:
        return
    if changes[-1][0] == frame:
        changes[-1] = (frame, version)
    else:
        changes.append((frame, version))


def fill_changes(out: torch.Tensor, changes: Changes) -> None:
    """Write each change's version into ``out`` from its frame to the next change's."""
    steps = out.shape[-1]
    for i, (frame, version) in enumerate(changes):
        end = changes[i + 1][0] if i + 1 < len(changes) else steps
        if frame < steps:
            out[..., frame:end] = version


LARGE = 8192
"""Tags of at least this many frames are filled first with the rollout's latest versions by
one torch call over every frame (a contiguous copy or a memset: at 4,096 worlds x 16 frames 2
to 4x faster than numpy's broadcast, which wins below a few thousand frames)."""


class Columns:
    """The versions of every env of a batched env over one rollout, as columns: the frames at
    which any env's version changed, each with the versions of all of them from that frame
    on. Marking and filling are vector operations: no loop over the envs, whatever their
    number.

    Examples:
        >>> import numpy as np
        >>> track = Columns(np.array([0, 0, 0]))
        >>> track.mark(2, np.array([0, 5, 0]))
        >>> track.mark(2, np.array([0, 5, 5]))   # the same frame: merged
        >>> track.mark(3, np.array([0, 5, 5]))   # nothing changed: nothing noted
        >>> out = torch.empty(3, 4, dtype=torch.int64)
        >>> track.fill(out)
        >>> out.tolist()
        [[0, 0, 0, 0], [0, 0, 5, 5], [0, 0, 5, 5]]
    """

    __slots__ = ("_changes",)

    def __init__(self, versions: np.ndarray) -> None:
        # kept, not copied (an int64 array the caller no longer changes: a read's copy): a
        # rollout that starts where the last one settled starts from the very same array
        self._changes: list[tuple[int, np.ndarray]] = [(0, np.asarray(versions, dtype=np.int64))]

    def mark(self, frame: int, versions: np.ndarray) -> None:
        """Note every env's version from ``frame`` on (merged with the latest change)."""
        last_frame, last = self._changes[-1]
        if np.array_equal(last, versions):
            return
        if last_frame == frame:
            self._changes[-1] = (frame, np.array(versions, dtype=np.int64))
        else:
            self._changes.append((frame, np.array(versions, dtype=np.int64)))

    def constant(self) -> np.ndarray | None:
        """Every env's version, where none changed during the rollout; else ``None``."""
        return self._changes[0][1] if len(self._changes) == 1 else None

    def fill(self, out: torch.Tensor) -> None:
        """Write each change's versions into ``out`` (leading dim: the envs; last: the frames)
        from its frame to the next change's."""
        steps = out.shape[-1]
        shape = (-1, *([1] * (out.ndim - 1)))
        changes = [change for change in self._changes if change[0] < steps]
        earlier = len(changes)
        if earlier and out.numel() >= LARGE:
            # the latest change over every frame in one torch call (a memset where every env
            # has the same version), the earlier ones over their frames after
            versions = changes[-1][1]
            if versions.min() == versions.max():
                out.fill_(int(versions[0]))
            else:
                out.copy_(torch.from_numpy(versions.reshape(shape)).expand_as(out))
            earlier -= 1
        # small tags, and the frames of the earlier changes, through numpy (a torch call costs
        # more than numpy's whole copy at a few envs)
        target = out.numpy() if out.device.type == "cpu" else None
        for i in range(earlier):
            frame, versions = changes[i]
            end = changes[i + 1][0] if i + 1 < len(changes) else steps
            column = versions.reshape(shape)
            if target is not None:
                target[..., frame:end] = column
            else:
                out[..., frame:end] = torch.from_numpy(column).to(out.device)


class Filled:
    """The version tags a batched env last wrote into its collector's rollout buffer, so
    that a rollout whose every env kept the version the buffer's tags already hold writes
    nothing (at 65,536 worlds x 16 frames, 16 MB not rewritten at every batch of a run with
    nothing pushed).

    A tag is skipped only if it is the same tensor as last written, unchanged since (its
    version counter, which every in-place torch op moves: a batch a user changed in place,
    or a buffer torchrl reset, is written again), and the versions are the same.
    """

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: dict[Any, tuple[torch.Tensor, int, np.ndarray]] = {}

    def fill(self, key: Any, out: torch.Tensor, columns: Columns) -> None:
        """Write ``columns`` into ``out``, the tag ``key`` (unless it holds them already)."""
        versions = columns.constant()
        held = self._held.get(key)
        if versions is not None and held is not None and held[0] is out and held[1] == _writes(out):
            if held[2] is versions:
                return
            if np.array_equal(held[2], versions):
                self._held[key] = (out, held[1], versions)  # the next rollout's start is this array
                return
        columns.fill(out)
        if versions is None:
            self._held.pop(key, None)
        else:
            self._held[key] = (out, _writes(out), versions)


def _writes(tensor: torch.Tensor) -> int:
    """The in-place writes torch has made to ``tensor`` (the version counter autograd keeps
    on every tensor, which torch names only privately)."""
    return int(tensor._version)


TAG_KEYS: tuple[Any, ...] = (VERSION_KEY, INDEX_KEY, ("next", VERSION_KEY), ("next", INDEX_KEY))


@contextmanager
def tags_set_aside(collector: Any) -> Iterator[None]:
    """Take the tags out of ``collector``'s rollout buffer while its rollout runs, then put
    the same tensors back (same storage: a worker's buffer is shared with the main process).

    torchrl stacks the steps into that buffer key by key, looking every buffer key up in
    every step; the steps never carry the tags (they are written once per rollout), so
    left in the buffer they would cost four lookups a frame.
    """
    buffer = getattr(collector, "_final_rollout", None)
    if not isinstance(buffer, TensorDictBase):
        yield
        return
    held = {key: value for key in TAG_KEYS if (value := buffer.get(key, None)) is not None}
    if not held:  # before the first rollout is tagged
        yield
        return
    with _unlocked(buffer):
        for key in held:
            buffer.del_(key)
    try:
        yield
    finally:
        with _unlocked(buffer):
            for key, value in held.items():
                buffer.set(key, value)


@contextmanager
def _unlocked(batch: TensorDictBase) -> Iterator[None]:
    if batch.is_locked:
        with batch.unlock_():
            yield
    else:
        yield


def set_tag(batch: TensorDictBase, key: Any, value: torch.Tensor) -> None:
    """Set a tag in ``batch`` (unlocked for the write, as torchrl locks its buffers)."""
    with _unlocked(batch):
        batch.set(key, value)


def truncate_at(next_tensordict: TensorDictBase, index: Any) -> None:
    """End the frames ``next_tensordict[index]`` as truncated (written back in place)."""
    part = next_tensordict[index]
    truncate(part)
    next_tensordict[index] = part


def truncate(next_tensordict: TensorDictBase) -> None:
    """End the frame(s) of ``next_tensordict`` as truncated (in place)."""
    done = next_tensordict.get("done")
    truncated = next_tensordict.get("truncated", None)
    truncated = torch.zeros_like(done) if truncated is None else truncated
    next_tensordict.set("truncated", truncated | ~done)
    next_tensordict.set("done", torch.ones_like(done))
