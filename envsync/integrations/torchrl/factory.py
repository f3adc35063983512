"""Env factories: build the user's env, apply the template config, install the hooks.

The env is returned as the user built it (no ``TransformedEnv`` layer is added): the hooks
replace ``_step`` and ``_reset`` on that instance only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tensordict import TensorDictBase
from torchrl.envs import EnvBase

from envsync.errors import ValidationError
from envsync.integrations.torchrl.adapter import EnvHooks
from envsync.probe import Probe
from envsync.receiver import ApplySpec
from envsync.state import apply_config

if TYPE_CHECKING:
    from envsync.sender import Sender


def prepare_env(env: EnvBase, spec: ApplySpec, initial_config: TensorDictBase) -> EnvBase:
    """Hook ``env`` and give it the template config, so version 0 is truthful."""
    EnvHooks.install(env, spec, initial_config)
    apply_config(env, spec.apply, initial_config)
    return env


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
        return prepare_env(env, self.envsync_spec, self.envsync_initial_config)


def wrap_env_fn(sender: Sender, fn: Callable[..., EnvBase] | EnvBase) -> Any:
    """Implementation of :meth:`envsync.EnvStateSender.env_fn`."""
    initial = sender.template.values.clone()
    if isinstance(fn, EnvBase):
        env = prepare_env(fn, sender.spec, initial)
        sender.use_probe(Probe(make=lambda: env, owned=False))
        return env
    if not callable(fn):
        raise ValidationError(f"env_fn expects an env factory or an EnvBase, got {type(fn).__name__}")
    factory = EnvFactory(fn, sender.spec, initial)
    sender.use_probe(Probe(make=factory, owned=True))
    return factory
