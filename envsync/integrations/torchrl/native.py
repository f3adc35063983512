"""Natively batched envs: an ``EnvBase`` with ``batch_size=[n]`` holds ``n`` envs of the fleet.

The rows share one env object, so their receivers live beside it in one process, and its
hooks (:class:`NativeHooks`) run the rows' safe points: before a batched step, each row's
``before_step``; before a reset, ``before_reset`` of the rows being reset only (the
``"_reset"`` mask of a partial reset); after a step, a truncating row's ``done`` and
``truncated`` are set. Everything else (tags, idle work, busy marks) is the batched env's
(:mod:`.batched`).

A row's config reaches the env through the user's ``apply``: a method (or callable) that
takes an ``env_ids`` keyword is called with the rows being changed and their indices in
the env; one that does not is called with the whole batch (every row's current config), and
then per-env ``"reset"`` mode is refused, since changing one row would change them all.

A row's env state is its row of every ``state_dict()`` entry whose leading dim is the batch
size (written in place into that row); the env's transforms as a whole are the batched
env's own (``batched.*``, :mod:`envsync.levels`), which its group serves. The rows share the
transforms: re-initialisation policies address them only as ``"batched.*"``.
"""

from __future__ import annotations

import inspect
import traceback
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.envs import EnvBase

from envsync.configure import config_kwargs, env_state_dict, find_config_method
from envsync.errors import EnvSyncError, ValidationError
from envsync.integrations.torchrl.batched import HOOKS, BatchedHooks, Leaves
from envsync.integrations.torchrl.level import outer_env
from envsync.integrations.torchrl.paths import held_at
from envsync.integrations.torchrl.tags import truncate_at
from envsync.levels import split_reinit
from envsync.links.base import End, LinkHandle
from envsync.places import SubEnv
from envsync.protocol import ApplyAt
from envsync.receiver import EnvStateReceiver
from envsync.spec import ApplySpec
from envsync.state import FlatConfig, flat_names, tensor_of


def _takes_env_ids(fn: Callable[..., Any]) -> bool:
    try:
        return "env_ids" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class RowApplier:
    """Gives rows of a natively batched env their configs through the user's ``apply``.

    Every row's current config is kept as one table per name (leading dim: the rows). A
    built-in apply (:mod:`envsync.apply`) writes the rows given a config inside
    :meth:`batch` at its end, all at once (one indexed write per array, one ``finish``):
    a push to every row of the env costs one write per field, not one per row.

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
        self._staged: set[int] | None = None
        self._acks: list[tuple[End, int]] = []  # acknowledgements that wait for the batch's write
        self.by_rows = False
        self.defers = False
        bind = getattr(apply, "bind", None)
        if isinstance(apply, str):
            method = find_config_method(env, apply)
            self.by_rows = _takes_env_ids(method)
            self._call = lambda config, **ids: method(**config_kwargs(config), **ids)
        elif bind is not None:  # a built-in apply (envsync.apply): its targets resolved once, for the whole batch
            applier = bind(env)
            self.by_rows = self.defers = _takes_env_ids(applier)
            self._call = applier
        elif apply is not None:
            self.by_rows = _takes_env_ids(apply)
            self._call = lambda config, **ids: apply(env, _rows(config), **ids)

    def apply_all(self) -> None:
        """Give every row its current config (at build: the template's, so version 0 is truthful)."""
        self._write(list(range(self._n)))

    def apply(self, row: int, flat: FlatConfig) -> None:
        """Give ``row`` the whole config ``flat`` (inside :meth:`batch`, of a deferring
        apply: at the batch's end)."""
        config = tensors(flat)
        if self._staged is not None:
            self._set_row(row, config)
            self._staged.add(row)
            return
        if self._call is not None:
            if self.by_rows:
                self._call({k: v.unsqueeze(0) for k, v in config.items()}, env_ids=torch.tensor([row]))
            else:
                stacked = {k: t.clone() for k, t in self._table.items()}
                for k, v in config.items():
                    stacked[k][row] = v
                self._call(stacked)
        self._set_row(row, config)

    def _set_row(self, row: int, config: dict[str, torch.Tensor]) -> None:
        for k, v in config.items():
            self._table[k][row] = v

    def _write(self, rows: list[int]) -> None:
        if self._call is None or not rows:
            return
        if not self.by_rows:
            self._call({k: t.clone() for k, t in self._table.items()})
            return
        index = torch.tensor(rows)
        everyone = len(rows) == self._n
        self._call({k: t.clone() if everyone else t[index] for k, t in self._table.items()}, env_ids=index)

    def ack_applied(self, end: End, version: int) -> None:
        """Acknowledge ``version`` as applied on a row's ``end`` once the simulator holds it:
        at once, or (inside :meth:`batch`, of a deferring apply) after the batch's write and
        its ``finish`` returned."""
        if self._staged is None:
            end.ack_applied(version)
        else:
            self._acks.append((end, version))

    @contextmanager
    def batch(self) -> Iterator[None]:
        """The rows' safe points of one step, reset or idle apply: a deferring apply writes
        the rows given a config here once, at the end, and only then are their versions
        acknowledged as applied. A write that fails there is reported as each row's failure
        of its version and raised to the caller (the env's step or reset): the values were
        checked against the arrays when the apply was bound, so only a ``finish`` can fail
        at this point."""
        if not self.defers or self._staged is not None:
            yield
            return
        self._staged = set()
        try:
            yield
        finally:
            rows, self._staged = sorted(self._staged), None
            acks, self._acks = self._acks, []
        try:
            self._write(rows)
        except Exception:
            text = traceback.format_exc()
            for end, version in acks:
                end.report_failure(version, text)
            raise
        for end, version in acks:
            end.ack_applied(version)


def tensors(config: FlatConfig) -> dict[str, torch.Tensor]:
    """A config's values as tensors (a link reads them back as numpy arrays)."""
    return {k: tensor_of(v) for k, v in config.items()}


def _rows(config: FlatConfig) -> TensorDict:
    batch = next(iter(config.values())).shape[:1] if config else torch.Size([0])
    return TensorDict({tuple(k.split(".")): v for k, v in config.items()}, batch_size=batch)


class RowAdapter:
    """A receiver's view of one row of a natively batched env: its config through the
    applier, its state as its row of each per-row entry (views, written in place)."""

    has_reinit = False

    def __init__(self, applier: RowApplier, row: int, env: EnvBase) -> None:
        self._applier = applier
        self._row = row
        self._env = weakref.ref(env)
        self._n = int(env.batch_size[0])

    def apply_config(self, config: FlatConfig) -> None:
        self._applier.apply(self._row, config)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        env = self._env()
        if env is None:
            raise EnvSyncError("the env of this row is gone")
        n, row = self._n, self._row
        return {k: v[row] for k, v in env_state_dict(env, keep_vars=True).items() if v.ndim and v.shape[0] == n}

    def read_attributes(self, paths: list[str]) -> dict[str, torch.Tensor]:
        """This row's part of what the env holds at ``paths``: its row of a per-row array,
        a value shared by every row as it is."""
        env = self._env()
        if env is None:
            raise EnvSyncError("the env of this row is gone")
        out = {}
        for path in paths:
            value = held_at(env, path)
            out[path] = value[self._row].clone() if value.ndim and value.shape[0] == self._n else value
        return out

    def note_read(self, entries: dict[str, torch.Tensor], target: int) -> None:
        return None

    def commit(self, written: dict[str, torch.Tensor], *, version: int, restore: bool = False) -> None:
        return None

    def reinit(self, version: int) -> None:
        return None

    def reset(self) -> None:
        raise EnvSyncError("a row of a batched env is reset through its collector, not by its receiver")


class RowEnd:
    """A row's link end whose "applied" acknowledgements go through the env's
    :class:`RowApplier` (:meth:`RowApplier.ack_applied`): sent once the simulator holds the
    row, never before a deferred write and its ``finish``. Everything else is the end's."""

    def __init__(self, end: End, applier: RowApplier) -> None:
        self._end = end
        self._applier = applier

    def __getattr__(self, name: str) -> Any:
        return getattr(self._end, name)

    def ack_applied(self, version: int) -> None:
        self._applier.ack_applied(self._end, version)


class NativeHooks(BatchedHooks):
    """:class:`~.batched.BatchedHooks` that also run each row's safe points. The env's own
    ``step_and_maybe_reset`` (``EnvBase``'s) steps and resets through these hooks."""

    hooks_step_and_maybe_reset = False

    def __init__(self, env: EnvBase, spec: ApplySpec, initial_config: TensorDictBase, applier: RowApplier) -> None:
        super().__init__(env, spec)
        self.env = weakref.ref(env)
        self.initial_config = initial_config
        self.applier = applier
        self.rows: list[EnvStateReceiver] = []  # one per row once bound

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
        group, owner = self.group, self.owner
        if owner.depth or group is None or (owner.settled and group.unchanged()):
            out = self._step(tensordict)
            if not owner.depth:
                self.frame += 1  # what _after_step does with nothing to read
            return out
        rows = self.rows
        # only the rows whose safe point has something to do: a vector read, whatever their number
        walk = np.flatnonzero(group.unsettled(pending=self.spec.apply_at is ApplyAt.STEP)).tolist()
        with self.applier.batch():
            for i in walk:
                rows[i].before_step()  # each row notes the version its part of the step runs under
        owner.depth = 1
        try:
            out = self._step(tensordict)
        finally:
            owner.depth = 0
        if self.spec.truncates:
            for i in np.flatnonzero(group.unsettled(pending=True)).tolist():
                if rows[i].truncate_now():
                    truncate_at(out, i)
        self._after_step()
        return out

    def reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDictBase:
        group = self.group
        if self.rows and group is not None:
            reset = _rows_reset(tensordict, self.num_envs)
            walk = np.flatnonzero(reset & group.unsettled(pending=True)).tolist()
            with self.applier.batch():
                for i in walk:
                    self.rows[i].before_reset()  # each row notes the version its reset's observation comes from
        self.owner.depth += 1
        try:
            out = self._reset(tensordict, **kwargs)
        finally:
            self.owner.depth -= 1
        self._after_reset()
        return out


def _rows_reset(tensordict: TensorDictBase | None, num_envs: int) -> np.ndarray:
    """A mask of the rows a reset resets (its ``"_reset"`` entry; every row without one)."""
    mask = None if tensordict is None else tensordict.get("_reset", None)
    if mask is None:
        return np.ones(num_envs, dtype=bool)
    return mask.reshape(num_envs, -1).any(-1).cpu().numpy()


class Rows:
    """The rows of a natively batched env, each with its receiver in this process."""

    in_own_loops = False

    def __init__(self, hooks: NativeHooks) -> None:
        self._hooks = hooks

    def bind(self, handle: LinkHandle, first_slot: int, first_env: int, *, gated: bool) -> bool:
        hooks = self._hooks

        def end(index: int) -> End:
            opened = handle.open(first_slot + index)
            return RowEnd(opened.gated(wake_group=False) if gated else opened, hooks.applier)

        rows = [
            EnvStateReceiver(
                link=end(index),
                spec=hooks.spec,
                adapter=RowAdapter(hooks.applier, index, hooks.live_env()),
                initial_config=hooks.initial_config,
                place=SubEnv(hooks.owner.unsettle),
                owner=hooks.owner,  # the rows are one env object: one owner
            )
            for index in range(hooks.num_envs)
        ]
        hooks.rows = rows
        with hooks.applier.batch():
            return any([row.start(loop=None) for row in rows])  # a list: every row catches up

    def apply_now(self, indices: list[int]) -> None:
        with self._hooks.applier.batch():
            for index in indices:
                self._hooks.rows[index].apply_if_idle()

    def serve(self, indices: list[int]) -> None:
        for index in indices:
            self._hooks.rows[index].serve()


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
