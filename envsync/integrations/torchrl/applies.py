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

Objects are looked up along :func:`envsync.configure.wrapper_chain`: the torchrl env, its base
envs, the gymnasium env ``GymEnv`` holds, its wrappers, and the unwrapped env.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torchrl.envs import EnvBase

from envsync.configure import apply_config, chain_names, config_kwargs, wrapper_chain
from envsync.errors import ValidationError
from envsync.integrations.torchrl.factory import split
from envsync.integrations.torchrl.paths import AttributePath, as_built, check_factor, scaled
from envsync.protocol import ApplyAt
from envsync.spec import ApplySpec
from envsync.state import FlatConfig, Leaf

Finish = Callable[[Any], None]
"""Called after an apply has set its attributes, with the innermost object along the env's
wrapper chain (the unwrapped gymnasium env, or the torchrl base env): recomputes what the env
derives from them. Picklable with cloudpickle (it travels to the workers with the apply)."""


def _factor(value: Leaf) -> np.ndarray:
    return value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


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
        return torch.as_tensor(np.array(value))
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    raise ValidationError(f"from_env: {name!r} holds a {type(value).__name__}, not a number or an array")


class Attributes:
    """Sets each config name as an attribute path along the env's wrapper chain: the first
    part is found on the first object that holds it (the torchrl env, its base envs,
    ``GymEnv``'s gymnasium env, its wrappers, the unwrapped env), the rest followed as
    attributes (``"model.body_mass"``, nested ``{"model": {"body_mass": ...}}`` in a config).
    An array at the end of a path (a MuJoCo model's ``body_mass``, a tensor) is written in
    place, keeping its dtype and shape; a number is set (Pendulum's ``g``).

    A path found nowhere, or a value that does not fit (another shape, a dtype that does not
    cast within its kind), is a :class:`~envsync.ValidationError` naming the path when the
    env is built (for the main process's probe env: at attach). ``finish``, if given, is
    called after every apply with the innermost object of the chain, to recompute what the
    env derives from the attributes set (CartPole's ``polemass_length``). Build it with
    :func:`envsync.apply.attributes`.

    Args:
        finish: recomputes derived parameters after the attributes are set.

    Examples:
        >>> from torchrl.envs import GymEnv
        >>> env = GymEnv("Pendulum-v1")
        >>> Attributes().bind(env)({"g": np.array(3.5)})
        >>> Attributes().read(env, ["g", "max_speed"])
        {'g': 3.5, 'max_speed': 8}
    """

    def __init__(self, finish: Finish | None = None) -> None:
        self.finish = finish

    def bind(self, env: Any) -> Callable[..., None]:
        """The function that sets a whole config on ``env`` (paths resolved and checked on
        first use, the innermost object for ``finish`` found once). Called with
        ``env_ids`` (a natively batched env), each config value holds one row per index
        and each array is written at those rows, one indexed write per array."""
        resolved: dict[str, list[tuple[AttributePath, Any]]] = {}
        inner: list[Any] = []

        def apply(config: FlatConfig, env_ids: torch.Tensor | None = None) -> None:
            for name, value in config.items():
                targets = resolved.get(name)
                if targets is None:
                    rows = None if env_ids is None else int(env.batch_size[0])
                    targets = resolved[name] = self.resolve(env, name, value, rows)
                for path, built in targets:
                    path.write(self.value(built, value, env_ids), env_ids)
            if self.finish is not None and config:
                if not inner:
                    inner.append(wrapper_chain(env)[-1])
                self.finish(inner[0])

        return apply

    def resolve(self, env: Any, name: str, value: Leaf, rows: int | None = None) -> list[tuple[AttributePath, Any]]:
        """The paths config name ``name`` writes, checked against its first ``value`` (with
        ``rows``, the batch size of a natively batched env: one row per env, in memory of
        its own), each with what :meth:`value` needs besides the config value (nothing here)."""
        path = AttributePath.resolve(env, name)
        path.own_rows()
        path.check(value, rows)
        return [(path, None)]

    def value(self, built: Any, value: Leaf, env_ids: torch.Tensor | None = None) -> Any:
        """What a path is written with for config ``value``: the value itself."""
        return value

    def __call__(self, env: Any, config: Any) -> None:
        """As an ``apply=`` callable ``fn(env, config)``."""
        apply_config(env, self, config)

    def read(self, env: Any, names: Sequence[str]) -> dict[str, Any]:
        """The current values of ``names`` (paths), read where :meth:`bind` would set them."""
        return {name: AttributePath.resolve(env, name).get() for name in names}

    def __repr__(self) -> str:
        finish = "" if self.finish is None else f"finish={self.finish!r}"
        return f"envsync.apply.attributes({finish})"


class Scales(Attributes):
    """Scales attributes relative to their values as built: each config value is a factor,
    and the attribute becomes *as built × factor*, written in place as
    :class:`Attributes` writes (a template of ones, version 0, is the env as built).

    ``targets`` maps a config name to the attribute path(s) it scales (``{"mass":
    ["model.body_mass", "model.body_inertia"]}``); a name it does not map scales the
    attribute path of its own name. A factor's dims are aligned with the attribute's leading
    dims: shape ``()`` scales every element, ``(8,)`` each body's row of an ``(8,)`` or an
    ``(8, 3)`` array. The values as built are read when a path is first written and kept
    with the env. Build it with :func:`envsync.apply.scales`.

    Args:
        targets: config name -> the attribute path or paths it scales.
        finish: as for :class:`Attributes`.

    Examples:
        >>> from torchrl.envs import GymEnv
        >>> env = GymEnv("Pendulum-v1")
        >>> apply = Scales({"heavier": ["g", "m"]}).bind(env)
        >>> apply({"heavier": np.array(2.0)}); apply({"heavier": np.array(3.0)})
        >>> Attributes().read(env, ["g", "m"])
        {'g': 30.0, 'm': 3.0}
    """

    def __init__(self, targets: Mapping[str, str | Sequence[str]] | None = None, finish: Finish | None = None) -> None:
        super().__init__(finish)
        self.targets = {n: [p] if isinstance(p, str) else list(p) for n, p in (targets or {}).items()}

    def paths_of(self, name: str) -> list[str]:
        """The attribute paths config name ``name`` scales."""
        return self.targets.get(name, [name])

    def resolve(self, env: Any, name: str, value: Leaf, rows: int | None = None) -> list[tuple[AttributePath, Any]]:
        """The paths config name ``name`` scales, each with its value as built (read once
        the path has memory of its own); the factor ``value`` checked against each."""
        factor = _factor(value)
        out = []
        for target in self.paths_of(name):
            path = AttributePath.resolve(env, target)
            path.own_rows()
            check_factor(path, factor, rows)
            out.append((path, as_built(path)))
        return out

    def value(self, built: Any, value: Leaf, env_ids: torch.Tensor | None = None) -> Any:
        """The value as built (``env_ids``: those rows of it) times the factor ``value``."""
        return scaled(built, _factor(value), env_ids)

    def read(self, env: Any, names: Sequence[str]) -> dict[str, Any]:
        """A factor of ones for each name, one per element of the first attribute it scales
        (the env as built; give a template of ``1.0`` instead for one factor for all)."""
        out = {}
        for name in names:
            current = AttributePath.resolve(env, self.paths_of(name)[0]).get()
            out[name] = np.ones(tuple(current.shape)) if isinstance(current, np.ndarray | torch.Tensor) else 1.0
        return out

    def __repr__(self) -> str:
        finish = "" if self.finish is None else f", finish={self.finish!r}"
        return f"envsync.apply.scales({self.targets!r}{finish})"


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
        apply_config(env, self, config)

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
                out[name] = AttributePath.resolve(env, name).get()
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


def _first_row(value: Any, rows: int) -> Any:
    """Row 0 of an array with one row per env; anything else as it is (refused at attach)."""
    is_array = isinstance(value, np.ndarray | torch.Tensor)
    return value[0] if is_array and tuple(value.shape[:1]) == (rows,) else value


def read_config(make_env: Any, names: Sequence[str], apply: Any) -> dict[str, Any]:
    """The template :meth:`envsync.EnvStateSender.from_env` builds: ``names`` read from the
    env ``make_env`` builds (or is), by ``apply.read`` (attributes along the chain for an
    apply without one), each as a tensor of its own dtype."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ValidationError(f"from_env: config must be a list of names or dotted paths, got {names!r}")
    built = not isinstance(make_env, EnvBase)
    env = make_env() if built else make_env
    layout = split(env)
    leaf = env if layout.make_leaf is None else layout.make_leaf()
    try:
        read = getattr(apply, "read", None) or Attributes().read
        values = read(leaf, list(names))
        if layout.rows:  # a natively batched env's arrays hold one row per env: the template is one
            values = {name: _first_row(value, layout.num_envs) for name, value in values.items()}
    finally:
        if leaf is not env:
            leaf.close()
        if built:
            env.close(raise_if_closed=False)
    template: dict[str, Any] = {}
    for name, value in values.items():  # a dotted path becomes a nested name, as configs nest
        *parents, last = name.split(".")
        into = template
        for part in parents:
            into = into.setdefault(part, {})
        into[last] = template_value(name, value)
    return template


__all__ = ["Attributes", "Finish", "Rebuild", "Scales", "read_config", "template_value"]
