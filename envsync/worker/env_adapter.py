"""What a receiver needs from the env it serves (:class:`EnvAdapter`): each integration
gives one (``envsync.integrations``), and a batched env's own level one of its own."""

from __future__ import annotations

from typing import Protocol

import torch

from envsync.state import FlatConfig


class EnvAdapter(Protocol):
    """What a receiver needs from the env it serves (see ``envsync.integrations``)."""

    def apply_config(self, config: FlatConfig) -> None:
        """Give the env a whole config (by dotted name) through the user's config method."""

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The env's live ``state_dict()`` tensors by key (written in place), and its running
        statistics (``stats.*``: fresh exports, loaded back by :meth:`commit`)."""

    def read_attributes(self, paths: list[str]) -> dict[str, torch.Tensor]:
        """Copies of what the env holds at attribute paths (a row's part, for a row of a
        natively batched env), by path."""

    def note_read(self, entries: dict[str, torch.Tensor], target: int) -> None:
        """A gather read ``entries`` while ``target`` was the latest version published: the
        statistics of a version published later (a merge of what was read) are loaded on top
        of what the env saw after this read."""

    def commit(self, written: dict[str, torch.Tensor], *, version: int, restore: bool = False) -> None:
        """Load entries of ``version`` written into :meth:`state_tensors` that are not live
        (``stats.*``): statistics on top of what the env saw since the latest read before
        ``version`` was published (see :meth:`note_read`), unless ``restore`` (the env's own
        earlier values, put back) or the same transform's own entries were written too (its
        whole state: a checkpoint row)."""

    @property
    def has_reinit(self) -> bool:
        """Whether any re-initialisation policy runs after an apply (and so may fail)."""

    def reinit(self, version: int) -> None:
        """Run the re-initialisation policies after a version is in place."""

    def reset(self) -> None:
        """Reset the env through its collector, so the next rollout starts a fresh episode."""
