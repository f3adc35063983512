"""The sender's record of the desired state: what workers joining later start from, and
what the latest push replaced (so a failed push can be rolled back).

A *payload* is one worker's desired state as the transport carries it: ``"config"`` (the
whole config), ``"env_state"`` (entries of the env's ``state_dict()``) and ``"stamp"`` (per
env-state entry, the version that last pushed it; 0 = never pushed, so never loaded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase


def stamped(update: TensorDictBase, version: int) -> TensorDictBase:
    """Add the version stamp of every env-state entry an update carries.

    Examples:
        >>> update = TensorDict(env_state=TensorDict(loc=torch.zeros(2)))
        >>> stamped(update, 7)["stamp", "loc"].item()
        7
    """
    if "env_state" not in update.keys():
        return update
    out = update.clone(recurse=False)
    out["stamp"] = update["env_state"].apply(lambda t: torch.full((), version, dtype=torch.int64))
    return out


def previous_values(payload: TensorDictBase, update: TensorDictBase) -> TensorDict:
    """The entries of ``payload`` that ``update`` is about to replace (stamps included).

    They are references, not copies: the sender never writes into a tensor it has published
    (each push brings fresh tensors), so the old ones stay as they were.
    """
    keys = [k if isinstance(k, tuple) else (k,) for k in update.keys(include_nested=True, leaves_only=True)]
    keys += [("stamp", *k[1:]) for k in keys if k[0] == "env_state"]
    return TensorDict({k: payload.get(k) for k in keys})


class DesiredState:
    """The desired state of workers that join later (the result of every broadcast push).

    Args:
        config: the config template's values (version 0).

    Examples:
        >>> desired = DesiredState(TensorDict(difficulty=torch.tensor(0.0)))
        >>> desired.update(TensorDict(config=TensorDict(difficulty=torch.tensor(0.5))), version=1)
        >>> desired.payload(TensorDict())["config", "difficulty"].item()
        0.5
    """

    def __init__(self, config: TensorDict) -> None:
        self.config = config.clone()
        self._env_state = TensorDict()
        self._stamps = TensorDict()

    def update(self, update: TensorDictBase, version: int) -> None:
        """Merge a broadcast push into the desired state."""
        if "config" in update.keys():
            self.config.update(update["config"])
        if "env_state" in update.keys():
            self._env_state.update(update["env_state"])
            self._stamps.update(stamped(update, version)["stamp"])

    def previous_values(self, update: TensorDictBase, env_state_template: TensorDictBase) -> TensorDict:
        """What ``update`` is about to overwrite in this desired state (see :func:`previous_values`)."""
        if "env_state" in update.keys():
            return previous_values(self._current(env_state_template), update)
        return previous_values(TensorDict(config=self.config), update)

    def payload(self, env_state_template: TensorDictBase) -> TensorDict:
        """One worker's full payload: template env state overlaid with what was pushed."""
        return self._current(env_state_template).clone()

    def _current(self, env_state_template: TensorDictBase) -> TensorDict:
        payload = TensorDict(config=self.config.copy())
        if not env_state_template.is_empty():
            values = env_state_template.copy()
            values.update(self._env_state)
            stamps = env_state_template.apply(lambda t: torch.zeros((), dtype=torch.int64))
            stamps.update(self._stamps)
            payload["env_state"] = values
            payload["stamp"] = stamps
        return payload


class Mirror:
    """Per worker, the tensors last published to it, by reference (no copies), so that what a
    push replaces is known without reading shared memory back.

    Args:
        payload: the payload every worker starts from.
        num_workers: how many workers.
    """

    def __init__(self, payload: TensorDictBase, num_workers: int) -> None:
        self._workers = [payload.copy() for _ in range(num_workers)]

    def previous_values(self, worker: int, update: TensorDictBase) -> TensorDict:
        """What ``update`` is about to replace for ``worker``."""
        return previous_values(self._workers[worker], update)

    def config(self, worker: int) -> TensorDictBase:
        """The config last published to ``worker`` (references: do not write into it)."""
        return self._workers[worker]["config"]

    def record(self, worker: int, published: TensorDictBase) -> None:
        """Remember what was just published to ``worker``."""
        self._workers[worker].update(published)


@dataclass
class Undo:
    """What the latest push replaced: per targeted worker, and in the default state."""

    version: int
    workers: dict[int, TensorDict]
    default: TensorDict | None
