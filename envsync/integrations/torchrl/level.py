"""The batched env's own transforms (:mod:`envsync.levels`) as a receiver of their own.

A ``TransformedEnv`` around a ``SerialEnv``/``ParallelEnv`` (or a natively batched env's
transforms) is shared by every env of the worker: its entries (``batched.<key>``) ride in
every env's slot, and its receiver, beside the batched env in the process that drives it,
is an :class:`~envsync.worker.receiver.EnvStateReceiver` like any other, on the gate over the
envs' ends (:class:`~envsync.worker.gate.GateEnd`), with the batched level's place
(:class:`~envsync.worker.places.BatchedLevel`) and this module's adapter, which shows the batched
env's own ``state_dict()`` under those names. Its group applies it at the batched env's
safe points (:meth:`~envsync.worker.receiver.EnvStateReceiver.apply_pending`), under the group's
owner, never while the collector drives the env.
"""

from __future__ import annotations

import torch
from torchrl.envs import EnvBase, TransformedEnv

from envsync.integrations.torchrl.adapter import CollectorAdapter
from envsync.levels import PREFIX, inner, split_reinit
from envsync.spec import ApplySpec
from envsync.state import FlatConfig
from envsync.worker.gate import GateEnd
from envsync.worker.owner import Owner
from envsync.worker.places import BatchedLevel
from envsync.worker.receiver import EnvStateReceiver


def outer_env(env: object) -> TransformedEnv | None:
    """The env whose own transforms are the batched level: ``env`` (a collector's env, or a
    natively batched env as hooked) when it is a ``TransformedEnv``. torchrl folds nested
    ``TransformedEnv`` layers into one, so it holds every transform above the batched env."""
    return env if isinstance(env, TransformedEnv) else None


def outer_spec(spec: ApplySpec) -> ApplySpec:
    """How the batched env's own transforms are applied: no config method, the
    batched-level ``reinit`` rules only."""
    return ApplySpec(apply=None, apply_at=spec.apply_at, reinit=split_reinit(spec.reinit)[1])


class LevelAdapter:
    """The batched env's own state as its receiver sees it: its ``state_dict()`` entries
    under their ``batched.`` names; no config (the envs under it take the config)."""

    def __init__(self, env: EnvBase, spec: ApplySpec) -> None:
        self._adapter = CollectorAdapter(None, env, outer_spec(spec))
        self.has_reinit = self._adapter.has_reinit

    def apply_config(self, config: FlatConfig) -> None:
        return None

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"{PREFIX}{key}": value for key, value in self._adapter.state_tensors().items()}

    def read_attributes(self, paths: list[str]) -> dict[str, torch.Tensor]:
        return self._adapter.read_attributes(paths)

    def note_read(self, entries: dict[str, torch.Tensor], target: int) -> None:
        self._adapter.note_read({inner(name): value for name, value in entries.items()}, target)

    def commit(self, written: dict[str, torch.Tensor], *, version: int, restore: bool = False) -> None:
        self._adapter.commit({inner(name): value for name, value in written.items()}, version=version, restore=restore)

    def reinit(self, version: int) -> None:
        self._adapter.reinit(version)

    def reset(self) -> None:
        self._adapter.reset()


def level_receiver(env: EnvBase, spec: ApplySpec, gate: GateEnd, owner: Owner) -> EnvStateReceiver:
    """The receiver of ``env``'s own transforms on ``gate`` (over the worker's envs' ends),
    under its group's ``owner``."""
    return EnvStateReceiver(
        link=gate,
        spec=spec,
        adapter=LevelAdapter(env, spec),
        initial_config=None,
        place=BatchedLevel(),
        owner=owner,
    )
