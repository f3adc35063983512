"""The sender's records of desired state, as flat leaves (:data:`~envsync.links.base.Key`):
the default (what a worker joining later starts from), a push's :class:`Update` (columns:
values shared by every targeted env, and one row per env), and what the latest push
replaced (:class:`Undo`, so a failed push can be rolled back). What each attached env was
last sent is its attachment's :class:`~envsync.sender.mirror.Mirror`.

Shared leaves are kept by reference: every push brings fresh tensors (the templates' ``fit``
copies what the caller gave) and the sender never writes into a tensor it has published,
so an old reference keeps its old value; rows are copies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from envsync.indexing import take_rows
from envsync.links.base import Flat, Key
from envsync.state import Leaf, tensor_of

NEVER = torch.zeros((), dtype=torch.int64)
"""The stamp of an env-state entry that was never pushed (a worker never loads it)."""


def leaves(config: Mapping[str, Leaf], env_state: Mapping[str, torch.Tensor], version: int) -> Flat:
    """One update as leaves: config names, env-state entries and their stamps.

    Examples:
        >>> sorted(leaves({"x": torch.tensor(1.0)}, {"t.0.loc": torch.zeros(2)}, 7))
        [('config', 'x'), ('env_state', 't.0.loc'), ('stamp', 't.0.loc')]
    """
    out: Flat = {("config", k): v for k, v in config.items()}
    stamp = torch.tensor(version, dtype=torch.int64) if env_state and version else NEVER
    for key, value in env_state.items():
        out[("env_state", key)] = value
        out[("stamp", key)] = stamp
    return out


def start(config: Mapping[str, Leaf], env_state: Mapping[str, torch.Tensor]) -> Flat:
    """The leaves every worker starts from: the template config, env state never pushed."""
    return leaves(config, env_state, 0)


def section(flat: Mapping[Key, Leaf], name: str) -> dict[str, Leaf]:
    """The leaves of one section by dotted name (``"config"``, ``"env_state"``, ``"stamp"``)."""
    return {k[1]: v for k, v in flat.items() if k[0] == name}


def pushed_env_state(flat: Mapping[Key, Leaf]) -> dict[str, torch.Tensor]:
    """The env-state entries that were pushed at least once (stamp > 0)."""
    return {k[1]: tensor_of(v) for k, v in flat.items() if k[0] == "env_state" and int(flat[("stamp", k[1])]) > 0}


def restamped(update: Update, stamp: torch.Tensor) -> Update:
    """Previous values to publish again: entries pushed before get the new ``stamp``, so
    every worker loads them again; never-pushed ones keep stamp 0 (the workers that loaded
    the failed version put their own live values back, see the undo mark)."""

    def again(value: Leaf) -> torch.Tensor:
        old = tensor_of(value)
        return torch.where(old > 0, stamp, old)

    shared = {k: (again(v) if k[0] == "stamp" else v) for k, v in update.shared.items()}
    rows = {k: (again(v) if k[0] == "stamp" else v) for k, v in update.rows.items()}
    return Update(update.targets, shared, rows)


@dataclass
class Update:
    """New desired leaves for the envs ``targets``, as columns: a push's whole update, or
    what it replaced (its undo). No Python object per env: a push to 65,536 worlds is a
    few tensors.

    Args:
        targets: the fleet indices of the envs (distinct), int64.
        shared: leaves with the same value for every target.
        rows: leaves with one row per target (leading dim ``len(targets)``).

    Examples:
        >>> update = Update(np.array([3, 5]), {("config", "x"): torch.tensor(1.0)},
        ...                 {("config", "y"): torch.tensor([0.5, 0.25])})
        >>> sorted(update.keys()), float(update.row(1)["config", "y"])
        ([('config', 'x'), ('config', 'y')], 0.25)
    """

    targets: np.ndarray
    shared: Flat = field(default_factory=dict)
    rows: dict[Key, torch.Tensor] = field(default_factory=dict)

    def keys(self) -> list[Key]:
        """Every leaf the update sets."""
        return [*self.shared, *self.rows]

    def row(self, position: int) -> Flat:
        """The leaves of the ``position``-th target (views of the rows)."""
        return {**self.shared, **{k: v[position] for k, v in self.rows.items()}}

    def take(self, positions: np.ndarray) -> Update:
        """The update of the targets at ``positions`` only."""
        return Update(self.targets[positions], self.shared, {k: take_rows(v, positions) for k, v in self.rows.items()})

    @classmethod
    def stacked(
        cls, targets: Sequence[int] | np.ndarray, flats: Sequence[Flat], counts: Sequence[int] | None = None
    ) -> list[Update]:
        """Updates from one flat update per target: targets with the same keys become one
        update, a leaf the same object for all of them shared, any other stacked in rows.
        ``counts``: each flat is for that many consecutive targets (the envs of one worker:
        one flat for all of them, its rows repeated by one vector op, not one per env)."""
        spans = np.cumsum([0, *(counts if counts is not None else [1] * len(flats))])
        groups: dict[tuple[Key, ...], list[int]] = {}
        for position, flat in enumerate(flats):
            groups.setdefault(tuple(flat), []).append(position)
        out = []
        for keys, positions in groups.items():
            chosen = [flats[p] for p in positions]
            sizes = torch.tensor([int(spans[p + 1] - spans[p]) for p in positions])
            shared: Flat = {}
            rows: dict[Key, torch.Tensor] = {}
            for key in keys:
                first = chosen[0][key]
                if all(flat[key] is first for flat in chosen):
                    shared[key] = first
                else:
                    rows[key] = torch.stack([tensor_of(flat[key]) for flat in chosen]).repeat_interleave(sizes, dim=0)
            at = np.concatenate([np.arange(spans[p], spans[p + 1]) for p in positions])
            out.append(cls(np.asarray(targets, dtype=np.int64)[at], shared, rows))
        return out


@dataclass
class Undo:
    """What the latest push replaced: in its targets' desired state, and in the default."""

    version: int
    parts: list[Update] = field(default_factory=list)
    """Per part of the push, the values its targets held before (the same keys)."""
    default: Flat | None = None
