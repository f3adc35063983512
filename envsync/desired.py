"""The sender's records of desired state, as flat leaves (:data:`~envsync.links.base.Key`):
the default (what a worker joining later starts from), what each attached worker was last
sent, and what the latest push replaced (so a failed push can be rolled back).

Leaves are kept by reference: every push brings fresh tensors (the templates' ``fit``
copies what the caller gave) and the sender never writes into a tensor it has published,
so an old reference keeps its old value.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

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


def replaced(current: Mapping[Key, Leaf], update: Iterable[Key]) -> Flat:
    """The entries of ``current`` that ``update`` is about to replace (references)."""
    return {key: current[key] for key in update}


def restamped(entries: Flat, stamp: torch.Tensor) -> Flat:
    """Previous values to publish again: entries pushed before get the new ``stamp``, so
    every worker loads them again; never-pushed ones keep stamp 0 (the workers that loaded
    the failed version put their own live values back, see the undo mark)."""
    return {k: (stamp if k[0] == "stamp" and int(v) > 0 else v) for k, v in entries.items()}


@dataclass
class Undo:
    """What the latest push replaced: per targeted fleet index, and in the default state."""

    version: int
    workers: dict[int, Flat] = field(default_factory=dict)
    default: Flat | None = None
