"""The sender's records: what it desires and which failures it has raised.

Plain data with public methods, no I/O and no lock (the caller, :class:`envsync.sender.core.Core`,
holds its lock around them). :class:`DesiredState` owns the version, the default leaves a
worker joining later starts from, the per-env rows a checkpoint restored before any
collector was attached, and the undo of the latest push; :class:`Failures` the failed
versions already raised; :class:`StatsBooks` the ``sync_stats`` books of both levels (a
sub-env's transforms, and a batched env's own).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from envsync.errors import ValidationError
from envsync.links.base import Flat, Key
from envsync.protocol import NO_FAILURE, WorkerStatus, failure_to_raise
from envsync.sender import desired
from envsync.sender.desired import Undo
from envsync.state import Leaf

Fit = Callable[[Any], dict[str, torch.Tensor]]
"""Fits env-state entries to the env-state template (raises ``ValidationError``)."""


class DesiredState:
    """What the sender desires, before and between attaches.

    Args:
        config: the template's config leaves (version 0).

    Examples:
        >>> import torch
        >>> state = DesiredState({"x": torch.tensor(0.0)})
        >>> state.version, float(state.default["config", "x"])
        (0, 0.0)
        >>> state.keep_for_attach(3, [{"x": torch.tensor(1.0)}], None, None)
        3
        >>> state.restored_rows is None, float(state.default["config", "x"])
        (True, 1.0)
    """

    def __init__(self, config: Mapping[str, Leaf]) -> None:
        self.version = 0
        self.default: Flat = desired.start(config, {})
        self.restored_rows: list[Flat] | None = None
        """Per-env rows of a checkpoint loaded before the collector they belong to attached."""
        self.unchecked_env_state: Any = None
        """A checkpoint's env state, fitted to the env-state template once it is known."""
        self.unchecked_rows: list[dict[str, torch.Tensor]] | None = None
        """A checkpoint's per-env own env state, fitted once the template is known."""
        self.undo: Undo | None = None

    def set_default(self, entries: Mapping[Key, Leaf | None]) -> None:
        """Change what a worker joining later starts from (``None`` removes an entry)."""
        for key, value in entries.items():
            if value is None:
                self.default.pop(key, None)
            else:
                self.default[key] = value

    def start_leaves(self, config: Mapping[str, Leaf], template: Mapping[str, torch.Tensor], fit: Fit) -> Flat:
        """The leaves every env of the next attached collector starts from: the template's,
        under the default; a checkpoint's env state (and rows) are fitted here, once the
        env-state ``template`` is known."""
        if self.unchecked_env_state is not None:
            self.set_default(desired.leaves({}, fit(self.unchecked_env_state), self.version))
            self.unchecked_env_state = None
        if self.unchecked_rows is not None and self.restored_rows is not None:
            for row, own in zip(self.restored_rows, self.unchecked_rows, strict=True):
                row.update(desired.leaves({}, fit(own), self.version))
            self.unchecked_rows = None
        leaves = desired.start(config, template)
        leaves.update(self.default)
        return leaves

    def rows_for(self, num_envs: int, envs_per_worker: int) -> list[Flat] | None:
        """The restored per-env rows the next collector of ``num_envs`` envs starts from.

        Raises:
            ValidationError: the checkpoint has another number of rows.
        """
        rows = self.restored_rows
        if rows is not None and len(rows) != num_envs:
            what = "workers" if envs_per_worker == 1 else "envs"
            raise ValidationError(
                f"the checkpoint has {len(rows)} {what[:-1]} configs; the collector has {num_envs} {what}"
            )
        return rows

    def keep_for_attach(
        self, version: int, rows: list[dict[str, Leaf]], env_state: Any, own: list[dict[str, Any]] | None
    ) -> int:
        """A checkpoint restored with no collector attached: what the next one starts from
        (its env state is fitted at attach, when the env's keys are known); returns the
        version now desired. A restore with envs' own env state is a version of its own."""
        self.version = max(self.version, version) + (own is not None)
        self.set_default(desired.leaves(rows[0], {}, self.version))
        per_env = len(rows) > 1 or own is not None
        self.restored_rows = [desired.leaves(r, {}, self.version) for r in rows] if per_env else None
        self.unchecked_env_state = env_state
        self.unchecked_rows = own
        return self.version


class Failures:
    """Which failed versions have been raised, per env: each failed version is raised once,
    by whichever env reports it first.

    Examples:
        >>> failures = Failures()
        >>> status = WorkerStatus(worker=0, target=2, received=2, applied=1, failed=2, reached=2)
        >>> failures.to_raise(0, status)
        2
        >>> failures.raised(0, 2); failures.to_raise(0, status) is None
        True
    """

    def __init__(self) -> None:
        self._by_env: dict[int, int] = {}
        self._versions: set[int] = set()

    def to_raise(self, index: int, status: WorkerStatus, waited: int | None = None) -> int | None:
        """The failed version to raise for env ``index``, or ``None``: a version already
        raised through another env is marked raised here too (a waiter of that very version
        still learns of it)."""
        failed = failure_to_raise(status, self._by_env.get(index, NO_FAILURE), waited)
        if failed is not None and failed != waited and failed in self._versions:
            self._by_env[index] = max(failed, self._by_env.get(index, NO_FAILURE))
            return None
        return failed

    def reported(self, indices: np.ndarray) -> np.ndarray:
        """Per env of ``indices`` (int64), the latest failed version raised (or marked raised)
        for it: a column to compare at once (none ever failed: no walk over the envs)."""
        if not self._by_env:
            return np.full(len(indices), NO_FAILURE, dtype=np.int64)
        get = self._by_env.get
        return np.fromiter((get(i, NO_FAILURE) for i in indices.tolist()), dtype=np.int64, count=len(indices))

    def raised(self, index: int, failed: int) -> None:
        """Note that env ``index``'s failure of version ``failed`` is being raised."""
        self._by_env[index] = max(failed, self._by_env.get(index, NO_FAILURE))
        self._versions.add(failed)
