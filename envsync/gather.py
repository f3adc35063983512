"""What ``gather`` and ``sync_stats`` decide, apart from moving bytes: which env-state entries
a request names, and, per worker, the statistics each was last given (so a sync counts each
observation once)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from envsync import stats
from envsync.errors import ValidationError


def select(known: Sequence[str], requested: Sequence[str] | None) -> list[str]:
    """The entries of ``known`` that ``requested`` names: whole keys or dotted prefixes
    (``"transforms.0"``); ``None`` names every entry.

    Examples:
        >>> select(["transforms.0.loc", "transforms.0.scale", "transforms.1.loc"], ["transforms.0"])
        ['transforms.0.loc', 'transforms.0.scale']
    """
    if requested is None:
        return list(known)
    if isinstance(requested, str):
        requested = [requested]
    chosen: list[str] = []
    for want in requested:
        hits = [k for k in known if k == want or k.startswith(f"{want}.")]
        if not hits:
            raise ValidationError(f"env_state {want!r} names no entry of the env; known: {list(known)}")
        chosen += [k for k in hits if k not in chosen]
    return chosen


class StatsBook:
    """Per fleet index, the statistics each worker was last loaded with; and the latest merge.

    Args:
        start: the statistics a worker starts with before any sync (the template's).
    """

    def __init__(self, start: Mapping[str, torch.Tensor]) -> None:
        self.merged = {k: torch.zeros_like(v) for k, v in start.items()}  # nothing seen yet
        self._given: dict[int, dict[str, torch.Tensor]] = {}

    def round(self, current: Mapping[int, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Merge the workers' ``current`` statistics of the names in ``current``."""
        names = sorted(next(iter(current.values())))
        base = {k: self.merged[k] for k in names}
        given = {w: {k: self._given[w][k] for k in names} for w in current if w in self._given}
        return stats.sync_round(base, given, current)

    def record(self, merged: Mapping[str, torch.Tensor], workers: Sequence[int]) -> None:
        """``workers`` now hold ``merged`` (and so will workers that join later)."""
        self.merged.update(merged)
        for worker in workers:
            self._given.setdefault(worker, dict(self.merged)).update(merged)

    def state_dict(self, workers: Sequence[int]) -> dict[str, Any]:
        """The last merge, and what each of ``workers`` (fleet order) was given."""
        return {"merged": dict(self.merged), "given": [dict(self._given.get(w, self.merged)) for w in workers]}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> StatsBook:
        """Restore a book; rows of ``"given"`` become fleet indices 0, 1, ... (resume order)."""
        book = cls(state["merged"])
        book.merged = dict(state["merged"])
        book._given = {w: dict(given) for w, given in enumerate(state["given"])}
        return book
