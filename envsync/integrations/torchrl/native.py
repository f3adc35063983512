"""Natively batched envs: an ``EnvBase`` with ``batch_size=[n]`` holds ``n`` envs of the fleet.

The rows share one env object, so they get one receiver (:class:`~envsync.worker.rows.RowsReceiver`,
their versions as columns) beside it, and its hooks (:class:`NativeHooks`) run the rows'
safe points: before a batched step, the rows whose safe point has something to do (one
vector read tells which: nothing is walked row by row); before a reset, those of the rows
being reset (the ``"_reset"`` mask of a partial reset); after a step, a truncating row's
``done`` and ``truncated`` are set. Everything else (tags, idle work, busy marks) is the
batched env's (:mod:`.batched`).

The rows' config reaches the env through the user's ``apply``, called once per safe point
with every row it changes: a method (or callable) that takes an ``env_ids`` keyword gets
those rows and their indices in the env; one that does not gets the whole batch (every row's
current config), and then per-env ``"reset"`` mode is refused, since changing one row would
change them all.

A row's env state is its row of every ``state_dict()`` entry whose leading dim is the batch
size (written in place into that row); the env's transforms as a whole are the batched
env's own (``batched.*``, :mod:`envsync.levels`), which its group serves. The rows share the
transforms: re-initialisation policies address them only as ``"batched.*"``.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.envs import EnvBase

from envsync.configure import config_kwargs, env_state_dict, find_config_method
from envsync.errors import EnvSyncError, ValidationError
from envsync.indexing import put_rows
from envsync.integrations.torchrl.batched import HOOKS, BatchedHooks, Leaves
from envsync.integrations.torchrl.level import outer_env
from envsync.integrations.torchrl.paths import held_at
from envsync.integrations.torchrl.tags import truncate_at
from envsync.levels import split_reinit
from envsync.links.base import LinkHandle
from envsync.protocol import ApplyAt
from envsync.spec import ApplySpec
from envsync.state import FlatConfig, flat_names, nest, tensor_of
from envsync.worker.rows import RowsReceiver


def _takes_env_ids(fn: Callable[..., Any]) -> bool:
    try:
        return "env_ids" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class RowApplier:
    """Gives rows of a natively batched env their configs through the user's ``apply``, in
    one call per safe point (a built-in apply, :mod:`envsync.apply`: one indexed write per
    array and one ``finish`` for every row of the call).

    Every row's current config is kept as one table per name (leading dim: the rows).

    Args:
        env: the env.
        apply: a method name, a callable ``fn(env, config)``, or ``None``.
        initial_config: every row's config at version 0 (flat).
        num_envs: the env's rows.
    """

    def __init__(self, env: EnvBase, apply: Any, initial_config: FlatConfig, num_envs: int) -> None:
        row = tensors(initial_config)
        self._table = {k: v.unsqueeze(0).repeat(num_envs, *([1] * v.ndim)) for k, v in row.items()}
        self._n = num_envs
        self._call: Callable[..., Any] | None = None
        self.by_rows = False
        bind = getattr(apply, "bind", None)
        if isinstance(apply, str):
            method = find_config_method(env, apply)
            self.by_rows = _takes_env_ids(method)
            self._call = lambda config, **ids: method(**config_kwargs(config), **ids)
        elif bind is not None:  # a built-in apply (envsync.apply): its targets resolved once, for the whole batch
            applier = bind(env)
            self.by_rows = _takes_env_ids(applier)
            self._call = applier
        elif apply is not None:
            self.by_rows = _takes_env_ids(apply)
            self._call = lambda config, **ids: apply(env, _rows(config), **ids)

    def apply_all(self) -> None:
        """Give every row its current config (at build: the template's, so version 0 is truthful)."""
        index = torch.arange(self._n)
        self.apply(index, self.config_of(index))

    def config_of(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copies of the config these rows hold."""
        return {k: t.index_select(0, rows) for k, t in self._table.items()}

    def apply(self, rows: torch.Tensor, config: dict[str, Any]) -> None:
        """Give ``rows`` the whole config ``config`` (one row per index) in one call; the
        table keeps it only once the call returned."""
        values = {k: tensor_of(v) for k, v in config.items()}
        if self._call is not None:
            if self.by_rows:
                self._call(values, env_ids=rows)
            else:
                stacked = {k: t.clone() for k, t in self._table.items()}
                for k, v in values.items():
                    put_rows(stacked[k], rows, v)
                self._call(stacked)
        for k, v in values.items():
            put_rows(self._table[k], rows, v)


def tensors(config: FlatConfig) -> dict[str, torch.Tensor]:
    """A config's values as tensors (a link reads them back as numpy arrays)."""
    return {k: tensor_of(v) for k, v in config.items()}


def _rows(config: FlatConfig) -> TensorDict:
    batch = next(iter(config.values())).shape[:1] if config else torch.Size([0])
    return nest(config, batch_size=batch)


class NativeRows:
    """A natively batched env as its rows receiver sees it (:class:`~envsync.worker.rows.RowsEnv`):
    its config through the applier, its state as the per-row entries of its ``state_dict()``
    (written in place), what a row holds at attribute paths."""

    def __init__(self, applier: RowApplier, env: EnvBase) -> None:
        self._applier = applier
        self._env = weakref.ref(env)
        self._n = int(env.batch_size[0])
        self.config_of = applier.config_of
        self.apply = applier.apply

    def _live(self) -> EnvBase:
        env = self._env()
        if env is None:
            raise EnvSyncError("the natively batched env is gone")
        return env

    def state_rows(self) -> dict[str, torch.Tensor]:
        n = self._n
        return {k: v for k, v in env_state_dict(self._live(), keep_vars=True).items() if v.ndim and v.shape[0] == n}

    def read_attributes(self, paths: list[str], rows: np.ndarray) -> dict[str, torch.Tensor]:
        """The rows' part of what the env holds at ``paths`` (one row per index of ``rows``):
        their rows of a per-row array, a value shared by every row as it is, for each."""
        env, out, index = self._live(), {}, torch.from_numpy(rows)
        for path in paths:
            value = held_at(env, path)
            if value.ndim and value.shape[0] == self._n:
                out[path] = value.index_select(0, index.to(value.device))
            else:
                out[path] = value.unsqueeze(0).expand(len(rows), *value.shape)
        return out


class NativeHooks(BatchedHooks):
    """:class:`~.batched.BatchedHooks` that also run each row's safe points. The env's own
    ``step_and_maybe_reset`` (``EnvBase``'s) steps and resets through these hooks."""

    hooks_step_and_maybe_reset = False

    def __init__(self, env: EnvBase, spec: ApplySpec, initial_config: TensorDictBase, applier: RowApplier) -> None:
        super().__init__(env, spec)
        self.env = weakref.ref(env)
        self.initial_config = initial_config
        self.applier = applier
        self.rows: RowsReceiver | None = None  # once bound

    def leaves(self, env: EnvBase) -> Leaves:
        return Rows(self)

    def live_env(self) -> EnvBase:
        env = self.env()
        if env is None:
            raise EnvSyncError("the batched env is gone")
        return env

    @staticmethod
    def own_transforms(env: EnvBase, collector: Any) -> EnvBase | None:
        """The hooked env itself holds the transforms its rows share."""
        return outer_env(env)

    def step(self, tensordict: TensorDictBase) -> TensorDictBase:
        group, owner, rows = self.group, self.owner, self.rows
        if owner.depth or group is None or rows is None or (owner.settled and group.unchanged()):
            out = self._step(tensordict)
            if not owner.depth:
                self.frame += 1  # what _after_step does with nothing to read
            return out
        # only the rows whose safe point has something to do: one vector read, whatever their number
        rows.before_step(np.flatnonzero(group.unsettled(pending=self.spec.apply_at is ApplyAt.STEP)))
        owner.depth = 1
        try:
            out = self._step(tensordict)
        finally:
            owner.depth = 0
        for i in rows.truncating().tolist():
            truncate_at(out, i)
        self._after_step()
        return out

    def reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDictBase:
        group, rows, owner = self.group, self.rows, self.owner
        # settled and no push since: the reset applies nothing and its tags stay (most resets
        # of thousands of worlds, some of which end an episode at nearly every step)
        quiet = group is None or rows is None or owner.depth > 0 or (owner.settled and group.unchanged())
        if not quiet:
            assert rows is not None and group is not None
            reset = _rows_reset(tensordict, self.num_envs)
            rows.before_reset(np.flatnonzero(reset & group.unsettled(pending=True)))
        owner.depth += 1
        try:
            out = self._reset(tensordict, **kwargs)
        finally:
            owner.depth -= 1
        if not quiet or group is None:
            self._after_reset()
        return out


def _rows_reset(tensordict: TensorDictBase | None, num_envs: int) -> np.ndarray:
    """A mask of the rows a reset resets (its ``"_reset"`` entry; every row without one)."""
    mask = None if tensordict is None else tensordict.get("_reset", None)
    if mask is None:
        return np.ones(num_envs, dtype=bool)
    return mask.reshape(num_envs, -1).any(-1).cpu().numpy()


class Rows:
    """The rows of a natively batched env, with their receiver in this process."""

    in_own_loops = False
    rows = True

    def __init__(self, hooks: NativeHooks) -> None:
        self._hooks = hooks

    def bind(self, handle: LinkHandle, first_slot: int, first_env: int, *, gated: bool) -> bool:
        hooks = self._hooks
        hooks.rows = rows = RowsReceiver(
            link=handle.open_rows(first_slot, hooks.num_envs, gated=gated),
            spec=hooks.spec,
            env=NativeRows(hooks.applier, hooks.live_env()),
            owner=hooks.owner,  # the rows are one env object: one owner
        )
        return rows.start()

    def _receiver(self) -> RowsReceiver:
        rows = self._hooks.rows
        if rows is None:
            raise EnvSyncError("the rows of this batched env are not bound")
        return rows

    def apply_now(self, indices: np.ndarray) -> None:
        self._receiver().apply_if_idle(indices)

    def serve(self, indices: np.ndarray) -> None:
        self._receiver().serve()  # the group asks for every row with a request: all, in one read


def prepare_native(env: EnvBase, spec: ApplySpec, initial_config: TensorDictBase) -> None:
    """Make every row of a natively batched env an env of the fleet.

    Raises:
        ValidationError: a batch size of more than one dim, re-initialisation policies (the
            rows share the transforms), or per-env ``"reset"`` mode with an ``apply`` that
            takes no ``env_ids``.
    """
    if isinstance(env.__dict__.get(HOOKS), NativeHooks):
        return
    if len(env.batch_size) != 1:
        raise ValidationError(f"envsync needs a batch size of one dim on a batched env, got {list(env.batch_size)}")
    if any(policy.kind != "keep" for _, policy in split_reinit(spec.reinit)[0].rules):
        raise ValidationError(
            "the rows of a natively batched env share its transforms: a reinit policy cannot run for one row; "
            "address the env's own transforms as 'batched.<class name or index>' (see docs/batched.md)"
        )
    flat = flat_names(initial_config)
    applier = RowApplier(env, spec.apply, flat, int(env.batch_size[0]))
    if spec.apply is not None and not applier.by_rows and spec.apply_at is ApplyAt.RESET:
        raise ValidationError(
            f"apply={spec.apply!r} takes no env_ids keyword, so it can only change every row of this batched env at "
            "once; apply_at='reset' changes each row at its own reset: add an env_ids keyword (it receives the "
            "indices of the rows being changed, and each config value one row per index), or use apply_at='step'"
        )
    applier.apply_all()
    NativeHooks(env, spec, initial_config, applier).attach(env)
