"""How an env takes a config: the user's config method found along the env's wrapper chain
and called with keyword arguments, a built-in apply bound once, or the user's callable; and
the env's own ``state_dict()`` tensors by envsync's flat names."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from envsync.errors import ValidationError
from envsync.state import ApplyFn, FlatConfig, Leaf, flatten, is_state_tensor, nest, state_leaves, state_name


def config_kwargs(config: TensorDictBase | Mapping[str, Leaf]) -> dict[str, Any]:
    """Turn a config (nested, or flat by dotted name) into keyword arguments: 0-d values
    become Python numbers, others fresh tensors, dotted names nested mappings.

    Examples:
        >>> import numpy as np
        >>> from tensordict import TensorDict
        >>> config_kwargs(TensorDict({"a": torch.tensor(2.5), "b": {"c": torch.ones(2)}}))
        {'a': 2.5, 'b': {'c': tensor([1., 1.])}}
        >>> config_kwargs({"a": torch.tensor(1), "b.c": np.array(True), "d": np.zeros(2)})
        {'a': 1, 'b': {'c': True}, 'd': tensor([0., 0.], dtype=torch.float64)}
    """
    flat = flatten(config, what="config", expected="a mapping") if isinstance(config, TensorDictBase) else config
    out: dict[str, Any] = {}
    for name, value in flat.items():
        *path, leaf = name.split(".")
        into = out
        for part in path:
            into = into.setdefault(part, {})
        if value.ndim == 0:
            into[leaf] = value.item()
        else:
            into[leaf] = torch.from_numpy(value.copy()) if isinstance(value, np.ndarray) else value.clone()
    return out


def wrapper_chain(env: Any) -> list[Any]:
    """The env, its base envs, then the library env a torchrl wrapper holds (``GymEnv``'s
    gymnasium env) and its wrappers down to the unwrapped env: where envsync looks names up.

    Examples:
        >>> from torchrl.envs import GymEnv, StepCounter, TransformedEnv
        >>> [type(o).__name__ for o in wrapper_chain(TransformedEnv(GymEnv("Pendulum-v1"), StepCounter()))]
        ['TransformedEnv', 'GymEnv', 'TimeLimit', 'OrderEnforcing', 'PendulumEnv']
    """
    owners = [env]
    while hasattr(owners[-1], "base_env"):
        owners.append(owners[-1].base_env)
    inner = getattr(owners[-1], "_env", None)  # torchrl's library wrappers keep the library env there
    while inner is not None:
        owners.append(inner)
        unwrapped = getattr(inner, "unwrapped", inner)
        inner = None if unwrapped is inner else getattr(inner, "env", unwrapped)
    return owners


def chain_names(owners: list[Any]) -> str:
    """The chain as a reader follows it: ``TransformedEnv -> GymEnv -> ... -> PendulumEnv``."""
    return " -> ".join(type(o).__name__ for o in owners)


def find_config_method(env: Any, name: str) -> Callable[..., Any]:
    """Look ``name`` up along :func:`wrapper_chain`: the env, its base envs, then the
    gymnasium env, its wrappers and the unwrapped env.

    Raises:
        ValidationError: no such method anywhere along the chain.
    """
    owners = wrapper_chain(env)
    for owner in owners:
        method = getattr(type(owner), name, None)
        if method is not None and callable(method):
            return getattr(owner, name)
    raise ValidationError(f"apply={name!r}: no such method on the env or its wrappers ({chain_names(owners)})")


def config_applier(env: Any, apply: str | ApplyFn | None) -> Callable[[FlatConfig], None]:
    """Resolve, once, how ``env`` takes a whole (flat) config: its config method, called with
    keyword arguments; a built-in apply's ``bind(env)`` (see ``envsync.apply``); or the
    user's callable, called with a nested ``TensorDict``.
    (Looking a method up through torchrl's env wrappers costs ~0.2 ms.)"""
    if apply is None:
        return lambda config: None
    if isinstance(apply, str):
        method = find_config_method(env, apply)
        return lambda config: method(**config_kwargs(config))
    bind = getattr(apply, "bind", None)
    if bind is not None:  # a built-in apply (envsync.apply): resolves its targets on this env once
        applier: Callable[[FlatConfig], None] = bind(env)
        return applier
    return lambda config: apply(env, nest(dict(config)))


def apply_config(env: Any, apply: str | ApplyFn | None, config: TensorDictBase) -> None:
    """Apply a whole config to an env once (see :func:`config_applier` to apply repeatedly)."""
    config_applier(env, apply)(flatten(config, what="config", expected="a mapping"))


def env_state_dict(env: Any, *, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of ``env.state_dict()`` by envsync's flat name (torchrl's keys, nested
    entries dot-joined: :func:`state_leaves`); lazy buffers left out. With ``keep_vars`` they
    are the env's own tensors, extra state included (``VecNormV2``'s ``_extra_state`` holds
    its live statistics): copying into them in place loads a single entry, where torchrl's
    ``load_state_dict`` takes only a whole extra state and re-points the transform at it.

    Examples:
        >>> from torchrl.envs import ObservationNorm, TransformedEnv
        >>> from envsync.envs import make_drift_env
        >>> norm = ObservationNorm(loc=torch.zeros(2), scale=torch.ones(2), in_keys=["observation"])
        >>> sorted(env_state_dict(TransformedEnv(make_drift_env(), norm)))
        ['loc', 'scale', 'standard_normal']
    """
    leaves = state_leaves(env.state_dict(keep_vars=True))  # keep_vars=False detaches lazy buffers: raises
    return {state_name(p): v if keep_vars else v.detach() for p, v in leaves.items() if is_state_tensor(v)}
