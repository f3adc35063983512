"""Env factories: build the user's env, apply the template config, install the hooks.

The env is returned as the user built it (no ``TransformedEnv`` layer is added): the hooks
replace ``_step`` and ``_reset`` on that instance only.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tensordict import TensorDictBase
from torchrl.envs import EnvBase, SerialEnv, TransformedEnv
from torchrl.envs.batched_envs import BatchedEnvBase

from envsync.configure import apply_config
from envsync.errors import ValidationError
from envsync.integrations.torchrl.adapter import EnvHooks
from envsync.integrations.torchrl.batched import find_batched, prepare_batched, prepare_leaf
from envsync.integrations.torchrl.chain import chain_of
from envsync.integrations.torchrl.native import prepare_native
from envsync.integrations.torchrl.paths import held_at
from envsync.levels import split_reinit
from envsync.sender.probe import Layout, Probe
from envsync.spec import ApplySpec

if TYPE_CHECKING:
    from envsync.sender.sender import Sender


def prepare_env(env: EnvBase, spec: ApplySpec, initial_config: TensorDictBase) -> EnvBase:
    """Hook ``env`` and give it the template config, so version 0 is truthful; for a
    batched env, make each of its sub-envs an env of the fleet instead.

    Raises:
        ValidationError: a batched env envsync cannot reach into, or settings it cannot
            honour (see :func:`~.native.prepare_native`).
    """
    batched = find_batched(env)
    if batched is not None:
        leaf = dataclasses.replace(spec, reinit=split_reinit(spec.reinit)[0])  # the sub-envs' own rules
        prepare_batched(batched, spec, lambda fn: LeafFactory(fn, leaf, initial_config))
        return env
    if env.batch_size:
        prepare_native(env, spec, initial_config)
        return env
    EnvHooks.install(env, spec, initial_config)
    apply_config(env, spec.apply, initial_config)
    return env


def split(env: EnvBase) -> Layout:
    """How many envs of the fleet ``env`` holds, and where their state lives: a sub-env of a
    ``SerialEnv``/``ParallelEnv`` is built alone to describe one; the transforms around it
    are copied onto a ``SerialEnv`` of its sub-envs (in this process: the batched env itself
    stays unstarted); a natively batched env's rows are rows of its own entries."""
    outer: Callable[[], EnvBase] | None
    batched = find_batched(env)
    if batched is not None:
        outer = functools.partial(_outer_copy, env, batched) if isinstance(env, TransformedEnv) else None
        return Layout(
            int(batched.num_workers),
            lambda: batched.create_env_fn[0](**batched.create_env_kwargs[0]),
            make_outer=outer,
            batched=True,
        )
    if env.batch_size:
        outer = (lambda: env) if isinstance(env, TransformedEnv) else None
        return Layout(int(env.batch_size[0]), rows=True, make_outer=outer, batched=True)
    return Layout()


def _outer_copy(env: TransformedEnv, batched: BatchedEnvBase) -> EnvBase:
    fns, kwargs = batched.create_env_fn, batched.create_env_kwargs
    return TransformedEnv(SerialEnv(batched.num_workers, fns, create_env_kwargs=kwargs), copy.deepcopy(env.transform))


class EnvFactory:
    """A picklable env factory: builds the user's env, then :func:`prepare_env`.

    Its attributes carry an ``envsync_`` prefix: torchrl's ``CloudpickleWrapper`` copies a
    factory's ``__dict__`` onto itself (``functools.update_wrapper``), and a plain ``fn``
    would replace the wrapper's own.

    Args:
        make_env: the user's factory.
        spec: how versions are applied.
        initial_config: the config template (version 0).
    """

    def __init__(self, make_env: Callable[..., EnvBase], spec: ApplySpec, initial_config: TensorDictBase) -> None:
        self.envsync_make_env = make_env
        self.envsync_spec = spec
        self.envsync_initial_config = initial_config

    def __call__(self, **kwargs: Any) -> EnvBase:
        env = self.envsync_make_env(**kwargs)
        if not isinstance(env, EnvBase):
            raise ValidationError(
                f"env factory {self.envsync_make_env!r} returned {type(env).__name__}, not a torchrl EnvBase"
            )
        return self.prepare(env)

    def prepare(self, env: EnvBase) -> EnvBase:
        return prepare_env(env, self.envsync_spec, self.envsync_initial_config)


class LeafFactory(EnvFactory):
    """Builds one sub-env of a batched env (replacing the batched env's own factory for it)
    and hooks it like an unbatched env (:func:`~.batched.prepare_leaf`)."""

    def prepare(self, env: EnvBase) -> EnvBase:
        return prepare_leaf(env, self.envsync_spec, self.envsync_initial_config)


def wrap_env_fn(sender: Sender, fn: Callable[..., EnvBase] | EnvBase) -> Any:
    """Implementation of :meth:`envsync.EnvStateSender.env_fn`."""
    initial = sender.template.values.clone()
    if isinstance(fn, EnvBase):
        if sender.spec.reinit.computes_in_main:
            # the probe would be the collector's own env: a push would run the new config on
            # it, mid-episode and under the old tag, and reset it from the user's thread
            raise ValidationError(
                "reinit.recompute(where='main') computes statistics on an env of the sender's own, and "
                f"env_fn was given a built {type(fn).__name__} (the collector's own env): pass a factory "
                "instead (env_fn(make_env)), or use recompute(where='worker')"
            )
        env = prepare_env(fn, sender.spec, initial)
        sender.port.use_probe(Probe(make=lambda: env, owned=False, chain=chain_of, split=split, held_at=held_at))
        return env
    if not callable(fn):
        raise ValidationError(f"env_fn expects an env factory or an EnvBase, got {type(fn).__name__}")
    factory = EnvFactory(fn, sender.spec, initial)
    sender.port.use_probe(Probe(make=factory, owned=True, chain=chain_of, split=split, held_at=held_at))
    return factory
