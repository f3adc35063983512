"""What the sender last published to each env of one attachment, as columns.

A leaf every env holds alike is kept once (a fleet-wide push keeps it that way); a leaf
whose envs differ is a column of one row per env, made the first time a push gives some
envs a value of their own. A push to ``k`` envs of ``n`` is then one indexed read of what it
replaces (its undo) and one indexed write per leaf, never a Python object per env.

Columns are written in place: whoever keeps values past a push (the undo, the config
history) keeps copies (:meth:`Mirror.gather` returns them), never views.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch

from envsync.indexing import Rows, put_rows, span_of, take_rows
from envsync.links.base import Flat, Key
from envsync.state import Leaf, tensor_of


class Mirror:
    """The desired state of ``count`` envs, leaf by leaf: shared, or a column.

    Args:
        start: the leaves every env starts from.
        count: how many envs.

    Examples:
        >>> mirror = Mirror({("config", "x"): torch.tensor(0.0)}, 3)
        >>> mirror.set(np.array([1]), {}, {("config", "x"): torch.tensor([5.0])})
        >>> [float(mirror.row(slot)["config", "x"]) for slot in range(3)]
        [0.0, 5.0, 0.0]
        >>> mirror.set(np.arange(3), {("config", "x"): torch.tensor(1.0)}, {})
        >>> [float(mirror.row(slot)["config", "x"]) for slot in range(3)]  # shared again: no column
        [1.0, 1.0, 1.0]
    """

    def __init__(self, start: Mapping[Key, Leaf], count: int) -> None:
        self.count = count
        self._shared: Flat = dict(start)
        self._columns: dict[Key, torch.Tensor] = {}

    def config_keys(self) -> list[Key]:
        """The config leaves (what the config history keeps)."""
        return [key for key in dict.fromkeys([*self._shared, *self._columns]) if key[0] == "config"]

    def uniform(self, section: str) -> bool:
        """Whether every env holds the same value of each leaf of ``section`` (``"config"``,
        ``"env_state"``, ``"stamp"``): none of them is a column."""
        return not any(key[0] == section for key in self._columns)

    def row(self, slot: int) -> Flat:
        """The leaves of env ``slot`` (copies of its column rows)."""
        out = dict(self._shared)
        out.update({key: column[slot].clone() for key, column in self._columns.items()})
        return out

    def gather(self, slots: np.ndarray, keys: Iterable[Key]) -> tuple[Flat, dict[Key, torch.Tensor]]:
        """The values of ``keys`` at ``slots``: those every env holds alike (references, never
        written again), and the others as rows (copies)."""
        shared: Flat = {}
        rows: dict[Key, torch.Tensor] = {}
        at: Rows | None = None
        for key in keys:
            column = self._columns.get(key)
            if column is None:
                shared[key] = self._shared[key]
            else:
                at = span_of(slots) if at is None else at  # every env of the collector: one copy
                rows[key] = take_rows(column, at)
        return shared, rows

    def set(self, slots: np.ndarray, shared: Mapping[Key, Leaf], rows: Mapping[Key, torch.Tensor]) -> None:
        """Give the envs ``slots`` (distinct) the ``shared`` values and one row each of ``rows``."""
        whole = len(slots) == self.count
        # every env of the collector, or a run of them: one copy (index_copy_ of 4,096 rows
        # cost 0.15 ms a push); looked at only when a column is written
        at = span_of(slots) if rows or (shared and not whole) else slots
        for key, value in shared.items():
            if whole:
                self._shared[key] = value
                self._columns.pop(key, None)
            else:
                put_rows(self._column(key), at, tensor_of(value))
        for key, values in rows.items():
            put_rows(self._column(key), at, values)

    def _column(self, key: Key) -> torch.Tensor:
        column = self._columns.get(key)
        if column is None:
            value = tensor_of(self._shared[key])
            column = self._columns[key] = value.expand(self.count, *value.shape).clone()
        return column
