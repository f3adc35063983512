"""What every curriculum shares: the interface, and a base class that drives one.

A curriculum is anything with ``observe(batch)``, ``history()``, ``state_dict()`` and
``load_state_dict()`` (:class:`Curriculum`). :class:`Strategy` implements the loop once:
``observe`` hands the batch to a :class:`~envsync.curriculum.Ledger`, gives the finished
episodes to the subclass's decision rule (:meth:`Strategy.update`), which pushes through
:meth:`Strategy.push` (fleet-wide) or :meth:`Strategy.assign` (one row per env), and whose
state over time goes to :meth:`Strategy.record` (and to a torchrl ``Logger``, if given).

Pushes wait at most for ``"received"`` (the default ``wait``): a worker's loop arms the
version at once, so the collection loop never waits for an episode to end.

When an env gets its next decision (:meth:`Strategy.due`) depends on the apply mode. In
``"reset"`` mode an env is due as soon as the ledger has seen it run its latest decision:
the next one is then armed for its next reset, so every decision runs at least one whole
episode and none is lost to a wait. In ``"step"`` and ``"truncate"`` modes a push changes
the running episode, so an env is due only once a whole episode under its latest decision
has ended.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from envsync.curriculum.columns import VersionColumn
from envsync.curriculum.heap import collections_deferred
from envsync.curriculum.ledger import Episode, Ledger, Measure, NestedKey
from envsync.errors import ValidationError
from envsync.protocol import ApplyAt
from envsync.sender.sender import Sender


@runtime_checkable
class Curriculum(Protocol):
    """The interface every curriculum offers (a user's own needs nothing more)."""

    def observe(self, batch: TensorDictBase) -> list[Episode]:
        """Take one collected batch; push when the rule decides; return its finished episodes."""
        ...

    def history(self) -> list[dict[str, Any]]:
        """The curriculum's state over time, one record per change."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`."""
        ...


class Strategy(ABC):
    """A curriculum driven by one decision rule over finished episodes.

    Subclasses implement :meth:`update` (and extend ``state_dict``/``load_state_dict`` with
    their own state).

    Args:
        sender: the sender whose collectors produce the batches, and which pushes decisions.
        measures: per-episode measures for the ledger (see :class:`~envsync.curriculum.Ledger`).
        logger: a torchrl ``Logger`` (anything with ``log_scalar(name, value, step)``): every
            number of every record is logged under ``curriculum/<name>``, at the frame count.
        wait: how pushes wait: ``"received"`` (default) or ``None``.

    Examples:
        >>> from envsync import EnvStateSender
        >>> class Harder(Strategy):
        ...     '''One more unit of difficulty after every 10 whole episodes.'''
        ...     def update(self, episodes):
        ...         self.count = getattr(self, "count", 0) + sum(e.whole for e in episodes)
        ...         if self.count >= 10:
        ...             self.count = 0
        ...             level = self.sender.desired_config()["difficulty"].item() + 1
        ...             self.record(difficulty=level, version=self.push({"difficulty": level}))
        >>> sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
        >>> isinstance(Harder(sender), Curriculum)
        True
        >>> sender.close()
    """

    def __init__(
        self,
        sender: Sender,
        *,
        measures: Mapping[str, NestedKey | Measure] | None = None,
        logger: Any = None,
        wait: str | None = "received",
    ) -> None:
        if wait not in ("received", None):
            raise ValidationError(f"wait={wait!r}: a curriculum waits for 'received' at most, or not at all (None)")
        self.sender = sender
        self.ledger = Ledger(sender, measures=measures)
        self.logger = logger
        self.wait = wait
        self._records: list[dict[str, Any]] = []
        self._decided = VersionColumn()
        """Per env: the version of its latest decision."""
        self._whole = VersionColumn()
        """Per env: the newest version it ran a whole episode under."""

    def observe(self, batch: TensorDictBase) -> list[Episode]:
        """Attribute the batch's finished episodes, let the rule decide (and push); return them."""
        with collections_deferred():  # the episodes' objects and the rule's, thousands a batch (see .heap)
            episodes = self.ledger.observe(batch)
            whole = [(e.env, e.version) for e in episodes if e.whole]
            if whole:
                envs, versions = np.array(whole, dtype=np.int64).T
                self._whole.raise_to(envs, versions)
            self.update(episodes)
        return episodes

    @abstractmethod
    def update(self, episodes: list[Episode]) -> None:
        """The decision rule: take the finished episodes of one batch; push if it decides."""

    # ---- pushing ---------------------------------------------------------------------------

    def push(self, config: Mapping[str, Any]) -> int:
        """Push ``config`` (names of the template to values) to every env; return the version."""
        version = self.sender.push(config=dict(config), wait=self.wait)
        self._decided.set(self._envs(None), version)
        return version

    def assign(self, rows: Mapping[int, Mapping[str, Any]]) -> int:
        """Push one version that gives each env (fleet index) its own config; return it.

        Every row names the same template names (dotted for nested ones).
        """
        envs = sorted(rows)
        return self.assign_columns(envs, columns_of([rows[e] for e in envs], "env's row"))

    def assign_columns(self, envs: Sequence[int] | np.ndarray, columns: Mapping[str, Any]) -> int:
        """Push one version that gives each of ``envs`` (distinct fleet indices) its row of
        every column (template names, dotted for nested ones; leading dim: the envs, in
        their order); return it. One push of columns, whatever the number of envs.

        Raises:
            ValidationError: a column has another number of rows than there are envs (and
                what the push refuses: an unknown name or env, a value that does not fit).
        """
        targets = np.asarray(envs, dtype=np.int64)
        config = TensorDict(batch_size=[len(targets)])
        for name, column in columns.items():
            value = torch.as_tensor(column)
            if value.ndim == 0 or len(value) != len(targets):
                rows = "a single value" if value.ndim == 0 else f"{len(value)} rows"
                raise ValidationError(f"column {name!r} has {rows}; one row per env needs {len(targets)}")
            config.set(tuple(name.split(".")), value)
        version = self.sender.push(config=config, envs=targets, wait=self.wait)
        self._decided.set(targets, version)
        return version

    def due(self, envs: Iterable[int] | None = None) -> list[int]:
        """The envs (of ``envs``, default every env) ready for their next decision (see the
        module docstring): never decided yet, or seen running their latest decision (in
        ``"reset"`` mode) or done with a whole episode under it (in the other modes)."""
        chosen = self._envs(envs)
        seen = self.ledger.latest_of(chosen) if self.sender.spec.apply_at is ApplyAt.RESET else self._whole.of(chosen)
        decided = self._decided.of(chosen)
        return chosen[(decided < 0) | (seen >= decided)].tolist()

    def _envs(self, envs: Iterable[int] | None) -> np.ndarray:
        if envs is not None:
            return np.fromiter(envs, dtype=np.int64)
        return np.arange(self.sender.num_envs or 0, dtype=np.int64)

    def unsettled(self, entries: dict[tuple[int, int], Any]) -> dict[tuple[int, int], Any]:
        """``entries`` keyed by ``(env, version)`` (a subclass's decisions awaiting their
        episodes), without those of versions older than their env's newest frame (no episode
        of them can end any more). Pruned only once they outnumber the envs four to one, so
        that a batch costs no walk over every env's entries."""
        if len(entries) <= 4 * max(self.sender.num_envs or 0, 16):
            return entries
        keys = np.array(list(entries), dtype=np.int64).reshape(-1, 2)
        keep = keys[:, 1] >= self.ledger.latest_of(keys[:, 0])
        return {k: v for (k, v), kept in zip(entries.items(), keep.tolist(), strict=True) if kept}

    # ---- seeing it -------------------------------------------------------------------------

    def record(self, **values: Any) -> None:
        """Add a record to :meth:`history` (with the frame count), and log its numbers."""
        entry = {"frames": self.ledger.frames, **values}
        self._records.append(entry)
        if self.logger is not None:
            for name, value in values.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self.logger.log_scalar(f"curriculum/{name}", float(value), step=self.ledger.frames)

    def history(self) -> list[dict[str, Any]]:
        """The strategy's state over time: one record (a dict) per change, oldest first."""
        return [dict(r) for r in self._records]

    # ---- resuming --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The base state: the frame count and the history (subclasses add their own)."""
        return {"frames": self.ledger.frames, "history": self.history()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`. Decisions in flight are not restored: every env
        is due again, as the collector of a new process starts fresh."""
        self._records = [dict(r) for r in state.get("history", [])]
        self.ledger.frames = int(state.get("frames", 0))
        self._decided.clear()
        self._whole.clear()


def columns_of(rows: Sequence[Mapping[str, Any]], what: str) -> dict[str, torch.Tensor]:
    """Rows of configs (template names, dotted for nested ones, to values) as columns: a
    tensor per name, a row each.

    Raises:
        ValidationError: the rows do not all give the same names (``what`` names a row).
    """
    names = sorted(rows[0])
    if any(sorted(row) != names for row in rows):
        raise ValidationError(f"every {what} must give the same names; got {[sorted(row) for row in rows]}")
    columns = {}
    for name in names:
        values = [row[name] for row in rows]
        numbers = all(isinstance(v, int | float) for v in values)  # one call for a column of numbers
        columns[name] = torch.tensor(values) if numbers else torch.stack([torch.as_tensor(v) for v in values])
    return columns


def envs_of_workers(sender: Sender, workers: Sequence[int] | None = None) -> dict[int, list[int]]:
    """The env fleet indices of each worker (default: every worker of the fleet)."""
    members = [m for m in sender.fleet() if workers is None or m.index in workers]
    return {m.index: list(range(m.first_env, m.first_env + m.envs)) for m in members}
