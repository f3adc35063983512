"""The built-in ``apply=`` objects (their public front is :mod:`envsync.apply`).

Each is picklable and has the small interface the rest of envsync looks for:

* ``bind(env)`` returns the function that gives ``env`` a whole config (flat, by name). It
  is called once per env, when the env is built, in the worker and for the probe env in the
  main process; what it cannot find is a :class:`~envsync.ValidationError` there, before
  any worker runs.
* ``read(env, names)`` reads the current values of ``names`` from an env
  (:meth:`envsync.EnvStateSender.from_env`).
* optionally ``check_spec(spec)`` (when the sender is built: the apply mode) and
  ``check_config(env, config)`` (on the probe env, before a push is published).

Objects are looked up along :func:`envsync.state.wrapper_chain`: the torchrl env, its base
envs, the gymnasium env ``GymEnv`` holds, its wrappers, and the unwrapped env.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torchrl.envs import EnvBase

from envsync.errors import ValidationError
from envsync.integrations.torchrl.factory import split
from envsync.protocol import ApplyAt
from envsync.spec import ApplySpec
from envsync.state import FlatConfig, Leaf, chain_names, config_kwargs, wrapper_chain

_MISSING = object()


def _holds(owner: Any, name: str) -> bool:
    """Whether ``owner`` itself holds a settable data attribute ``name`` (no ``__getattr__``
    forwarding, as torchrl's wrappers do; no method; no read-only property)."""
    found = inspect.getattr_static(owner, name, _MISSING)
    if found is _MISSING or inspect.isroutine(found):
        return False
    return not isinstance(found, property) or found.fset is not None


def attribute_owner(env: Any, name: str) -> Any:
    """The first object along the env's wrapper chain that holds attribute ``name``.

    Raises:
        ValidationError: none does (the message names the chain searched).
    """
    if "." in name:
        raise ValidationError(f"attributes() sets plain attribute names; {name!r} is nested")
    owners = wrapper_chain(env)
    for owner in owners:
        if _holds(owner, name):
            return owner
    raise ValidationError(
        f"attributes(): no object along the env's wrapper chain has an attribute {name!r} "
        f"(searched {chain_names(owners)})"
    )


def _like(current: Any, value: Any) -> Any:
    """``value`` (a number or a tensor, from :func:`config_kwargs`) in the form the attribute holds."""
    if isinstance(current, np.ndarray) and isinstance(value, torch.Tensor):
        return value.numpy().astype(current.dtype)
    return value


def template_value(name: str, value: Any) -> bool | int | float | torch.Tensor:
    """A value read from an env as a config template leaf: its own dtype (a Python float is
    a double, so version 0 gives the env back exactly the value it was built with).

    Examples:
        >>> template_value("g", 9.81).dtype, template_value("n", 3).dtype, template_value("b", np.ones(2)).dtype
        (torch.float64, torch.int64, torch.float64)
    """
    if isinstance(value, bool | np.bool_):
        return torch.tensor(bool(value))
    if isinstance(value, int | float | np.ndarray | np.generic):
        return torch.as_tensor(np.asarray(value)).clone()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    raise ValidationError(f"from_env: {name!r} holds a {type(value).__name__}, not a number or an array")


class Attributes:
    """Sets each config name as an attribute of the first object along the env's wrapper
    chain that has it: the torchrl env, its base envs, ``GymEnv``'s gymnasium env, its
    wrappers, the unwrapped env (Pendulum's ``g``, CartPole's ``gravity``).

    A name found nowhere is a :class:`~envsync.ValidationError` when the env is built (for
    the main process's probe env: at attach), naming the chain searched. Build it with
    :func:`envsync.apply.attributes`.

    Examples:
        >>> from torchrl.envs import GymEnv
        >>> env = GymEnv("Pendulum-v1")
        >>> Attributes().bind(env)({"g": np.array(3.5)})
        >>> Attributes().read(env, ["g", "max_speed"])
        {'g': 3.5, 'max_speed': 8}
    """

    def bind(self, env: Any) -> Callable[[FlatConfig], None]:
        """The function that sets a whole config on ``env`` (owners found on first use)."""
        owners: dict[str, Any] = {}

        def apply(config: FlatConfig) -> None:
            for name, value in config_kwargs(config).items():
                owner = owners.get(name)
                if owner is None:
                    owner = owners[name] = attribute_owner(env, name)
                setattr(owner, name, _like(getattr(owner, name), value))

        return apply

    def __call__(self, env: Any, config: Any) -> None:
        """As an ``apply=`` callable ``fn(env, config)`` (a natively batched env calls it so)."""
        self.bind(env)({k: v for k, v in config.items(include_nested=True, leaves_only=True)})

    def read(self, env: Any, names: Sequence[str]) -> dict[str, Any]:
        """The current values of ``names``, read where :meth:`bind` would set them."""
        return {name: getattr(attribute_owner(env, name), name) for name in names}

    def __repr__(self) -> str:
        return "envsync.apply.attributes()"


def _rebuilder(env: Any) -> Any:
    """The torchrl ``GymEnv`` along the chain (it has ``rebuild_with_kwargs`` and a gymnasium env)."""
    owners = wrapper_chain(env)
    for owner in owners:
        if callable(getattr(type(owner), "rebuild_with_kwargs", None)) and getattr(owner, "_env", None) is not None:
            inner = owner._env
            if getattr(inner, "spec", None) is not None and hasattr(inner, "np_random"):
                return owner
    raise ValidationError(f"rebuild() needs a torchrl GymEnv along the env's chain; found {chain_names(owners)}")


def _check_parameters(owner: Any, names: Sequence[str]) -> None:
    unwrapped = owner._env.unwrapped
    params = inspect.signature(type(unwrapped).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = [n for n in names if n not in params or n == "self"]
    if unknown:
        known = [n for n in params if n != "self"]
        raise ValidationError(
            f"rebuild(): {unknown} are not constructor parameters of {type(unwrapped).__name__} (it takes {known})"
        )


def _space_changes(old: Any, new: Any) -> list[str]:
    return [
        f"{name} {getattr(old, name)} -> {getattr(new, name)}"
        for name in ("observation_space", "action_space")
        if getattr(old, name) != getattr(new, name)
    ]


class Rebuild:
    """Rebuilds the gymnasium env inside the torchrl ``GymEnv`` with the whole config as
    constructor keyword arguments (torchrl's ``GymEnv.rebuild_with_kwargs``): for parameters
    an env takes only in ``gym.make`` (LunarLander's ``gravity``, ``enable_wind``).

    What it adds to ``apply="rebuild_with_kwargs"``:

    * the rebuilt env is seeded the way torchrl's ``GymEnv.set_seed`` seeds one
      (``reset(seed=...)``), with a seed drawn from the generator of the env it replaces: a
      run seeded with ``collector.set_seed(s)`` replays exactly, rebuilds included;
    * names that are not constructor parameters are refused when the env is built;
    * before a push is published, the env is made with the new keyword arguments in the main
      process and its spaces compared: a push that would change the specs (which the
      collector allocated its buffers from) is refused with a :class:`~envsync.ValidationError`
      naming the spaces that would change (not with a declared ``env_state_template=``,
      which builds no env in the main process);
    * ``apply_at="step"`` is refused when the sender is built: the rebuilt env starts a new
      episode, so a rebuild must be followed by a reset (``"reset"`` or ``"truncate"`` mode).

    A rebuild keeps the torchrl env and its transforms (running statistics included); it
    replaces the gymnasium env, its episode in progress and any attribute set on it.
    Build it with :func:`envsync.apply.rebuild`.

    Examples:
        >>> from torchrl.envs import GymEnv
        >>> env = GymEnv("Pendulum-v1")
        >>> Rebuild().bind(env)({"g": np.array(4.0)})
        >>> Rebuild().read(env, ["g"])
        {'g': 4.0}
        >>> Rebuild().check_config(env, {"g": np.array(12.0)})  # same spaces: accepted
    """

    def bind(self, env: Any) -> Callable[[FlatConfig], None]:
        """The function that rebuilds ``env``'s gymnasium env with a whole config."""
        owner = _rebuilder(env)
        checked: set[str] = set()

        def apply(config: FlatConfig) -> None:
            kwargs = config_kwargs(config)
            if not checked.issuperset(kwargs):
                _check_parameters(owner, list(kwargs))
                checked.update(kwargs)
            seed = int(owner._env.np_random.integers(2**31 - 1))
            owner.rebuild_with_kwargs(**kwargs)
            owner._env.reset(seed=seed)

        return apply

    def __call__(self, env: Any, config: Any) -> None:
        """As an ``apply=`` callable ``fn(env, config)``."""
        self.bind(env)({k: v for k, v in config.items(include_nested=True, leaves_only=True)})

    def read(self, env: Any, names: Sequence[str]) -> dict[str, Any]:
        """The constructor arguments ``names``: as the env was made, else the constructor's
        defaults, else the attribute of that name along the chain."""
        owner = _rebuilder(env)
        _check_parameters(owner, names)
        made_with = dict(owner._env.spec.kwargs)
        params = inspect.signature(type(owner._env.unwrapped).__init__).parameters
        out = {}
        for name in names:
            default = params[name].default if name in params else inspect.Parameter.empty
            if name in made_with:
                out[name] = made_with[name]
            elif default is not inspect.Parameter.empty:
                out[name] = default
            else:
                out[name] = Attributes().read(env, [name])[name]
        return out

    def check_spec(self, spec: ApplySpec) -> None:
        """Refuse a mode that would step the rebuilt env without a reset first."""
        if spec.apply_at is ApplyAt.STEP and not spec.truncates:
            raise ValidationError(
                "rebuild() starts a new gymnasium env, which must be reset before it steps: "
                "use apply_at='reset' or 'truncate', not 'step'"
            )

    def check_config(self, env: Any, config: Mapping[str, Leaf]) -> None:
        """Refuse a whole config whose rebuilt env would have other spaces than the env as built."""
        import gymnasium

        owner = _rebuilder(env)
        kwargs = config_kwargs(config)
        _check_parameters(owner, list(kwargs))
        made = owner._env.spec
        before, after = gymnasium.make(made), gymnasium.make(made, **kwargs)
        try:
            changes = _space_changes(before, after)
        finally:
            before.close()
            after.close()
        if changes:
            raise ValidationError(
                f"rebuild() with {kwargs} would change the env's specs ({'; '.join(changes)}); "
                "the collector allocated its buffers from them: build a new collector instead"
            )

    def __repr__(self) -> str:
        return "envsync.apply.rebuild()"


def read_config(make_env: Any, names: Sequence[str], apply: Any) -> dict[str, Any]:
    """The template :meth:`envsync.EnvStateSender.from_env` builds: ``names`` read from the
    env ``make_env`` builds (or is), by ``apply.read`` (attributes along the chain for an
    apply without one), each as a tensor of its own dtype."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ValidationError(f"from_env: config must be a list of names, got {names!r}")
    built = not isinstance(make_env, EnvBase)
    env = make_env() if built else make_env
    make_leaf = split(env).make_leaf
    leaf = env if make_leaf is None else make_leaf()
    try:
        read = getattr(apply, "read", None) or Attributes().read
        values = read(leaf, list(names))
    finally:
        if leaf is not env:
            leaf.close()
        if built:
            env.close(raise_if_closed=False)
    return {name: template_value(name, value) for name, value in values.items()}


__all__ = ["Attributes", "Rebuild", "attribute_owner", "read_config", "template_value"]
