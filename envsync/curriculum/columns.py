"""The curriculum's state per env as columns: a version per env, and the piece of an episode
each env left running at the end of its last batch (a strategy over 65,536 worlds reads and
writes them by vector ops, never an object or a dict entry per world)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np


class VersionColumn:
    """A version per env as one int64 column, -1 for an env with none yet (a strategy of
    65,536 envs reads and writes them by vector ops, not as a dict of 65,536 entries)."""

    def __init__(self) -> None:
        self.values = np.full(0, -1, dtype=np.int64)

    def _fit(self, top: int) -> None:
        size = len(self.values)
        if top >= size:
            self.values = np.r_[self.values, np.full(max(top + 1, 2 * size) - size, -1, dtype=np.int64)]

    def of(self, envs: np.ndarray) -> np.ndarray:
        """Each env's version (-1: none)."""
        out = np.full(len(envs), -1, dtype=np.int64)
        inside = envs < len(self.values)
        out[inside] = self.values[envs[inside]]
        return out

    def set(self, envs: np.ndarray, version: int) -> None:
        if len(envs):
            self._fit(int(envs.max()))
            self.values[envs] = version

    def raise_to(self, envs: np.ndarray, versions: np.ndarray) -> None:
        """Each env's version to at least its ``versions`` (an env may be listed more than once)."""
        if len(envs):
            self._fit(int(envs.max()))
            np.maximum.at(self.values, envs, versions)

    def clear(self) -> None:
        self.values[:] = -1

    def as_dict(self) -> dict[int, int]:
        """Env to version, for the envs that have one."""
        envs = np.flatnonzero(self.values >= 0)
        return dict(zip(envs.tolist(), self.values[envs].tolist(), strict=True))


class OpenPieces:
    """Per env, the piece it left running, as columns (an env of 65,536 is a row, not an
    object): whether it has one, its version, return, length, wholeness and measures."""

    def __init__(self) -> None:
        self.has = np.zeros(0, dtype=bool)
        self.version = np.zeros(0, dtype=np.int64)
        self.returns = np.zeros(0, dtype=np.float64)
        self.lengths = np.zeros(0, dtype=np.int64)
        self.whole = np.zeros(0, dtype=bool)
        self.values: dict[str, np.ndarray] = {}

    def _fit(self, top: int, names: Iterable[str]) -> None:
        """Make room for env ``top`` and the measures ``names``."""
        size = len(self.has)
        grow = max(top + 1, 2 * size) - size if top >= size else 0
        if grow:
            self.has = np.r_[self.has, np.zeros(grow, dtype=bool)]
            self.version = np.r_[self.version, np.zeros(grow, dtype=np.int64)]
            self.returns = np.r_[self.returns, np.zeros(grow)]
            self.lengths = np.r_[self.lengths, np.zeros(grow, dtype=np.int64)]
            self.whole = np.r_[self.whole, np.zeros(grow, dtype=bool)]
            self.values = {name: np.r_[v, np.zeros(grow)] for name, v in self.values.items()}
        for name in names:
            if name not in self.values:
                self.values[name] = np.zeros(len(self.has))

    def take(self, envs: np.ndarray) -> tuple[Any, ...] | None:
        """The running pieces of ``envs`` (distinct), taken out: ``(has, version, return,
        length, whole, values)`` per env; ``None`` when none of them has one."""
        if not len(envs) or int(envs.max()) >= len(self.has):
            self._fit(int(envs.max()) if len(envs) else 0, ())
        has = self.has[envs]
        if not has.any():
            return None
        self.has[envs] = False
        out = (self.version[envs], self.returns[envs], self.lengths[envs], self.whole[envs])
        return (has, *out, {name: v[envs] for name, v in self.values.items()})

    def put(
        self,
        envs: np.ndarray,
        version: np.ndarray,
        returns: np.ndarray,
        lengths: np.ndarray,
        whole: np.ndarray,
        values: dict[str, np.ndarray],
        at: np.ndarray,
    ) -> None:
        """Leave each of ``envs`` its piece running (``values`` at the pieces ``at``)."""
        if not len(envs):
            return
        self._fit(int(envs.max()), values)
        self.has[envs] = True
        self.version[envs], self.returns[envs], self.lengths[envs], self.whole[envs] = version, returns, lengths, whole
        for name, v in values.items():
            self.values[name][envs] = v[at]
