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
from envsync.indexing import put_rows, span_of
from envsync.links.base import Flat, Key
from envsync.protocol import NO_FAILURE, WorkerStatus, failure_to_raise
from envsync.sender import desired
from envsync.sender.desired import Undo, Update
from envsync.state import Leaf, tensor_of

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
        >>> state.keep_for_attach(3, {"x": torch.tensor(1.0)}, None, 1, None, None)
        3
        >>> state.restored is None, float(state.default["config", "x"])
        (True, 1.0)
    """

    def __init__(self, config: Mapping[str, Leaf]) -> None:
        self.version = 0
        self.default: Flat = desired.start(config, {})
        self.restored: list[Update] | None = None
        """Per-env rows of a checkpoint loaded before the collector they belong to attached,
        as columns: updates of the positions ``0..restored_count - 1`` (the config's; one
        per set of keys once each env's own env state joined them)."""
        self.restored_count = 0
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
        if self.unchecked_rows is not None and self.restored is not None:
            rows = self.restored[0]  # the config's, of positions 0..n-1: a position is its index
            own = [desired.leaves({}, fit(entries), self.version) for entries in self.unchecked_rows]
            self.restored = [
                Update(part.targets, part.shared, {**rows.take(part.targets).rows, **part.rows})
                for part in Update.stacked(np.arange(self.restored_count), own)
            ]
            self.unchecked_rows = None
        leaves = desired.start(config, template)
        leaves.update(self.default)
        return leaves

    def rows_for(self, num_envs: int, envs_per_worker: int) -> list[Update] | None:
        """The restored per-env rows the next collector of ``num_envs`` envs starts from
        (call after :meth:`start_leaves`, which joins each env's own env state to them).

        Raises:
            ValidationError: the checkpoint has another number of rows.
        """
        if self.restored is not None and self.restored_count != num_envs:
            what = "workers" if envs_per_worker == 1 else "envs"
            raise ValidationError(
                f"the checkpoint has {self.restored_count} {what[:-1]} configs; the collector has {num_envs} {what}"
            )
        return self.restored

    def restored_row_list(self) -> list[Flat] | None:
        """The restored rows as one flat per env (for a link that starts its envs from such
        a list: Ray's, one per remote worker)."""
        if self.restored is None:
            return None
        rows: list[Flat] = [{} for _ in range(self.restored_count)]
        for part in self.restored:
            for position, target in enumerate(part.targets.tolist()):
                rows[target] = part.row(position)
        return rows

    def restored_columns(self, section: str) -> dict[str, torch.Tensor] | None:
        """The restored rows' leaves of ``section`` (``"config"``) as columns, by dotted name,
        ``restored_count`` rows each: one write per part and leaf, no dict per env (a checkpoint
        of 65,536 worlds saved again before its collector attached)."""
        if self.restored is None:
            return None
        out: dict[str, torch.Tensor] = {}
        for part in self.restored:
            at = span_of(part.targets)
            for key, leaf in (*part.shared.items(), *part.rows.items()):
                if key[0] != section:
                    continue
                value = tensor_of(leaf)
                column = out.get(key[1])
                if column is None:
                    shape = value.shape if key in part.shared else value.shape[1:]
                    column = out[key[1]] = torch.zeros((self.restored_count, *shape), dtype=value.dtype)
                put_rows(column, at, value)  # a shared value: one for every row
        return out

    def keep_for_attach(
        self,
        version: int,
        first: Mapping[str, Leaf],
        columns: Mapping[str, torch.Tensor] | None,
        count: int,
        env_state: Any,
        own: list[dict[str, Any]] | None,
    ) -> int:
        """A checkpoint restored with no collector attached: what the next one starts from
        (``first``: the first row's config, what a worker joining later starts from;
        ``columns``: every row's, ``count`` rows, or ``None`` for one); its env state is
        fitted at attach, when the env's keys are known. Returns the version now desired. A
        restore with envs' own env state is a version of its own."""
        self.version = max(self.version, version) + (own is not None)
        self.set_default(desired.leaves(first, {}, self.version))
        self.restored, self.restored_count = None, count
        if columns is not None or own is not None:
            rows = columns if columns is not None else {k: torch.as_tensor(v).unsqueeze(0) for k, v in first.items()}
            self.restored = [Update(np.arange(count), {}, {("config", k): v for k, v in rows.items()})]
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
