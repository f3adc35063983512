"""The tags of collected frames: ``"env_version"`` and ``"env_index"`` (at the root and
under ``"next"``), written once per rollout from the frames at which a version took effect
(:data:`Changes`), kept out of torchrl's rollout buffer while it stacks the steps, and the
truncation a ``"truncate"`` version ends an episode with."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

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
