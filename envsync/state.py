"""The desired env state: the config template and the env-state template, and their validation
(how an env takes a config is :mod:`envsync.configure`).

The *config* is a fixed set of named numbers or tensors (nested mappings allowed) whose names,
shapes and dtypes are set by the template. The *env state* is a subset of an env's
``state_dict()`` (transform buffers such as ``ObservationNorm.loc``), with torchrl's keys:
:func:`state_leaves` decides, in one place, how those keys and their nested entries (a
transform's extra state, such as ``VecNormV2``'s ``_extra_state``) become envsync's flat names,
and :meth:`EnvStateTemplate.nest` shapes flat names back like ``env.state_dict()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from envsync.errors import ValidationError
from envsync.fitting import PLAIN, check_finite, fit

ConfigValue = int | float | bool | torch.Tensor | Mapping[str, Any]
ApplyFn = Callable[[Any, TensorDictBase], None]

Leaf = torch.Tensor | np.ndarray
"""A config or env-state value inside envsync. Config values fitted from plain numbers, and
config leaves as a link reads them, are numpy arrays: a small push then makes no torch call,
and a torch call costs tens of microseconds when the caches are cold, as they are in a
process just woken up. Env-state values are always tensors."""


def numpy_view(tensor: torch.Tensor) -> np.ndarray | None:
    """A numpy view of the tensor's bytes, or ``None`` for a dtype numpy lacks (bfloat16)."""
    try:
        return tensor.numpy()
    except TypeError:
        return None


def tensor_of(value: Leaf) -> torch.Tensor:
    """``value`` as a tensor (a numpy array is wrapped, sharing its memory)."""
    return torch.from_numpy(value) if isinstance(value, np.ndarray) else value


def _leaf_tensor(path: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, bool | int | float):
        return torch.as_tensor(value)
    raise ValidationError(f"config value {path!r} must be a number or a tensor, got {type(value).__name__}")


def flatten(values: Any, *, what: str, expected: str, prefix: str = "") -> dict[str, Any]:
    """Flatten nested mappings (or a TensorDict) of config names (no dots) into dot-joined
    paths to their leaves."""
    if isinstance(values, TensorDictBase):
        return {
            ".".join(k) if isinstance(k, tuple) else k: v
            for k, v in values.items(include_nested=True, leaves_only=True)
        }
    if not isinstance(values, Mapping):
        raise ValidationError(f"{what} must be {expected}, got {type(values).__name__}")
    flat: dict[str, Any] = {}
    for name, value in values.items():
        if not isinstance(name, str) or not name or "." in name:
            raise ValidationError(f"{what} name {name!r} must be a non-empty string without '.'")
        path = f"{prefix}{name}"
        if not isinstance(value, PLAIN) and isinstance(value, Mapping):  # numbers skip the ABC check
            flat.update(flatten(value, what=what, expected=expected, prefix=f"{path}."))
        else:
            flat[path] = value
    return flat


def flatten_config(values: Any) -> dict[str, Any]:
    return flatten(values, what="config", expected="a mapping of names to values")


def nest(flat: Mapping[str, Leaf], *, copy: bool = False, batch_size: Sequence[int] = ()) -> TensorDict:
    """Flat leaves by dotted name as a nested ``TensorDict``: numpy leaves wrapped, not
    copied, or (``copy``) a ``TensorDict`` of copies of its own, built once. ``batch_size``:
    leaves that are columns, one row per env (``[n]``)."""
    return TensorDict(
        {tuple(k.split(".")): torch.as_tensor(v).clone() if copy else tensor_of(v) for k, v in flat.items()},
        batch_size=list(batch_size),
    )


class ConfigTemplate:
    """Names, shapes and dtypes of a config, fixed at construction.

    Args:
        config: a mapping of names to numbers or tensors; nested mappings allowed.
        allow_nonfinite: accept NaN and inf values.

    Examples:
        >>> template = ConfigTemplate({"difficulty": 0.0, "task": {"id": 3}})
        >>> template.validate({"difficulty": 0.5})["difficulty"]
        tensor(0.5000)
        >>> template.validate({"colour": 1})
        Traceback (most recent call last):
        ...
        envsync.errors.ValidationError: unknown config name 'colour'; known: ['difficulty', 'task.id']
    """

    def __init__(self, config: Mapping[str, ConfigValue], *, allow_nonfinite: bool = False) -> None:
        flat = {path: _leaf_tensor(path, v) for path, v in flatten_config(config).items()}
        if not allow_nonfinite:
            for path, tensor in flat.items():
                check_finite("config value", path, tensor)
        self.allow_nonfinite = allow_nonfinite
        self._flat = flat
        views = {path: numpy_view(t) if t.ndim == 0 else None for path, t in flat.items()}
        self._numpy = {path: None if view is None else view.dtype for path, view in views.items()}
        self.values = nest(flat)

    @property
    def names(self) -> list[str]:
        """The dotted names of the config's leaves, sorted."""
        return sorted(self._flat)

    def validate(self, values: Mapping[str, Any] | TensorDictBase) -> TensorDict:
        """Check a (partial) config against the template.

        Args:
            values: a subset of the template's names, nested like the template.

        Returns:
            The values as a nested :class:`TensorDict` of fresh tensors in the template's dtypes.

        Raises:
            ValidationError: unknown name, wrong shape or dtype, non-numeric or non-finite value.
        """
        return nest(self.fit(values))

    def fit(self, values: Mapping[str, Any] | TensorDictBase) -> dict[str, Leaf]:
        """Like :meth:`validate`, but flat: dotted names to fresh values (a plain number for a
        0-d leaf becomes a numpy array, see :data:`Leaf`; everything else a tensor)."""
        return {path: self._fit_named(path, value) for path, value in flatten_config(values).items()}

    def _fit_named(self, path: str, value: Any) -> Leaf:
        like = self._flat.get(path)
        if like is None:
            raise ValidationError(f"unknown config name {path!r}; known: {self.names}")
        return fit("config value", path, value, like, self.allow_nonfinite, numpy_dtype=self._numpy[path])

    def fit_rows(
        self, values: Mapping[str, Any] | TensorDictBase, count: int
    ) -> tuple[dict[str, Leaf], dict[str, torch.Tensor]]:
        """Fit a config for ``count`` envs: a value whose shape is ``(count, *template
        shape)`` (or any value of a TensorDict with batch size ``[count]``) gives one row per
        env; every other value is the same for all of them. Returns the values shared (as
        :meth:`fit` returns them) and the rows, as columns of ``count`` rows (checked and
        copied once, never split into a value per env).

        Examples:
            >>> template = ConfigTemplate({"difficulty": 0.0, "seed": 1})
            >>> shared, rows = template.fit_rows({"difficulty": torch.tensor([0.1, 0.2]), "seed": 7}, 2)
            >>> shared["seed"].item(), [round(v, 1) for v in rows["difficulty"].tolist()]
            (7, [0.1, 0.2])
            >>> template.fit_rows({"difficulty": 0.3}, 2)
            ({'difficulty': array(0.3, dtype=float32)}, {})
        """
        batch = tuple(values.batch_size) if isinstance(values, TensorDictBase) else ()
        if batch and batch != (count,):
            raise ValidationError(f"a config with batch size {list(batch)} needs one row per targeted env: [{count}]")
        flat = flatten_config(values)

        def per_env(path: str, value: Any) -> bool:
            like = self._flat.get(path)
            return like is not None and isinstance(value, torch.Tensor) and value.shape == (count, *like.shape)

        rowed = {p: v for p, v in flat.items() if count and per_env(p, v)}
        shared = {p: self._fit_named(p, v) for p, v in flat.items() if p not in rowed}
        rows = {}
        for path, value in rowed.items():
            like = self._flat[path]
            column = fit("config value", path, value, like.expand(count, *like.shape), self.allow_nonfinite)
            assert isinstance(column, torch.Tensor)  # a tensor fits as a tensor
            rows[path] = column
        return shared, rows

    @property
    def flat(self) -> dict[str, torch.Tensor]:
        """The template's values by dotted name (do not write into them)."""
        return self._flat


StatePath = tuple[str, ...]
"""Where an env-state leaf sits in an ``env.state_dict()``: its key as torch writes it
(``"loc"``, ``"transforms.1.loc"``), then one part per nested mapping below it (a transform's
extra state: ``("_extra_state", "loc.-|-.observation")`` for a ``VecNormV2``)."""


def state_name(path: StatePath) -> str:
    """The flat name envsync gives the leaf at ``path``: its parts joined by ``"."``, which is
    also how torch joins the keys of nested modules (``"transforms.1._extra_state.<...>"``)."""
    return ".".join(path)


def state_leaves(state: Mapping[Any, Any] | TensorDictBase) -> dict[StatePath, Any]:
    """The leaves of a mapping shaped like ``env.state_dict()``, by path.

    A key is kept whole (torch's dotted keys are one part), a tuple key gives its parts, and
    every nested mapping or ``TensorDict`` (a transform's extra state) adds one part; so
    ``{"_extra_state": {"k": t}}``, ``{("_extra_state", "k"): t}`` and
    ``{"_extra_state.k": t}`` all reach the leaf named ``"_extra_state.k"``.

    Examples:
        >>> sorted(state_leaves({"loc": 1, "_extra_state": {"count.-|-.obs": 2}, ("a", "b"): 3}))
        [('_extra_state', 'count.-|-.obs'), ('a', 'b'), ('loc',)]

    Raises:
        ValidationError: not a mapping, or a key that is not a string or a tuple of strings.
    """
    if isinstance(state, TensorDictBase):
        return {k if isinstance(k, tuple) else (k,): v for k, v in state.items(include_nested=True, leaves_only=True)}
    if not isinstance(state, Mapping):
        raise ValidationError(f"env_state must be a mapping like env.state_dict(), got {type(state).__name__}")
    leaves: dict[StatePath, Any] = {}
    for key, value in state.items():
        path = key if isinstance(key, tuple) else (key,)
        if not path or not all(isinstance(part, str) and part for part in path):
            raise ValidationError(f"env_state key {key!r} must be a non-empty string or a tuple of them")
        if isinstance(value, Mapping | TensorDictBase):
            leaves.update({(*path, *inner): leaf for inner, leaf in state_leaves(value).items()})
        else:
            leaves[path] = value
    return leaves


def is_state_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not torch.nn.parameter.is_lazy(value)


class EnvStateTemplate:
    """The keys, shapes and dtypes of an env's ``state_dict()`` that a push may carry.

    Keys are torchrl's own (see :func:`state_leaves`): a lone ``ObservationNorm`` gives
    ``loc``, ``scale``, ``standard_normal``; a ``Compose`` gives ``transforms.<i>.<name>``;
    a ``VecNormV2`` gives ``initialized`` and its ``_extra_state`` entries.

    Args:
        state_dict: an env's ``state_dict()`` (nested entries allowed); lazy (uninitialised)
            buffers and non-tensor values are left out.
        allow_nonfinite: accept NaN and inf values.

    Examples:
        >>> tpl = EnvStateTemplate({"loc": torch.zeros(3), "_extra_state": {"count.-|-.obs": torch.tensor(0)}})
        >>> tpl.keys
        ['_extra_state.count.-|-.obs', 'loc']
        >>> tpl.validate({"loc": torch.ones(3)})["loc"]
        tensor([1., 1., 1.])
        >>> tpl.validate({"_extra_state": {"count.-|-.obs": torch.tensor(5)}})["_extra_state", "count.-|-.obs"]
        tensor(5)
    """

    def __init__(
        self,
        state_dict: Mapping[Any, Any] | TensorDictBase,
        *,
        allow_nonfinite: bool = False,
        covers: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        leaves = {path: v for path, v in state_leaves(state_dict).items() if is_state_tensor(v)}
        self.covers = {prefix: list(keys) for prefix, keys in (covers or {}).items()}
        """Per derived statistics prefix (``stats.<index>``), the entries holding the same
        statistics under torchrl's keys (a push of the prefix supersedes them); empty for a
        declared template."""
        self._paths = {state_name(path): path for path in leaves}
        self._flat = {state_name(path): v.detach().to("cpu").clone() for path, v in leaves.items()}
        self.allow_nonfinite = allow_nonfinite
        self.values = self.nest(self._flat)

    @classmethod
    def from_env(
        cls, env: Any, *, derived: Mapping[str, torch.Tensor] | None = None, allow_nonfinite: bool = False
    ) -> EnvStateTemplate:
        """The template of ``env.state_dict()``, plus ``derived`` entries (views that are not
        ``state_dict`` entries, such as ``stats.<index>.<name>``), nested by their dots.

        Examples:
            >>> from torchrl.envs import ObservationNorm, TransformedEnv
            >>> from envsync.envs import make_drift_env
            >>> env = TransformedEnv(make_drift_env(), ObservationNorm(loc=0.0, scale=1.0, in_keys=["observation"]))
            >>> EnvStateTemplate.from_env(env, derived={"stats.0.n": torch.tensor(1.0)}).keys
            ['loc', 'scale', 'standard_normal', 'stats.0.n']
        """
        views = {tuple(k.split(".")): v for k, v in (derived or {}).items()}
        return cls({**env.state_dict(keep_vars=True), **views}, allow_nonfinite=allow_nonfinite)

    @property
    def keys(self) -> list[str]:
        """The state_dict keys a push may carry (nested entries dot-joined), sorted."""
        return sorted(self._flat)

    def validate(self, values: Mapping[Any, Any] | TensorDictBase) -> TensorDict:
        """Check a (partial) env state against the template.

        Args:
            values: a mapping shaped like ``env.state_dict()``: its keys, nested entries as
                nested mappings, tuple keys or dot-joined keys (a ``TensorDict`` too).

        Returns:
            The values as a :class:`TensorDict` shaped like ``env.state_dict()`` (see :meth:`nest`).

        Raises:
            ValidationError: a key the env does not have, wrong shape or dtype, non-finite value.
        """
        return self.nest(self.fit(values))

    def fit(self, values: Mapping[Any, Any] | TensorDictBase) -> dict[str, torch.Tensor]:
        """Like :meth:`validate`, but flat: envsync's names (:func:`state_name`) to tensors."""
        fitted = {}
        for path, value in state_leaves(values).items():
            key = state_name(path)
            if key not in self._flat:
                raise ValidationError(f"env_state key {key!r} is not in the env's state_dict; known: {self.keys}")
            # copied once here: the sender's records (what later workers start from, what a
            # rollback restores, the checkpoint) must not change when the caller's tensor does
            fitted[key] = tensor_of(fit("env_state", key, value, self._flat[key], self.allow_nonfinite))
        return fitted

    def nest(self, flat: Mapping[str, torch.Tensor], rows: int | None = None) -> TensorDict:
        """Entries by flat name, shaped like ``env.state_dict()``: a key of it stays one key
        (``"transforms.0.loc"``), a nested entry sits under its key (``"_extra_state"``);
        ``rows``: the values are columns of that many envs' rows (the batch size)."""
        return TensorDict({self._paths[k]: v for k, v in flat.items()}, batch_size=[] if rows is None else [rows])

    @property
    def flat(self) -> dict[str, torch.Tensor]:
        """The template's values by flat name (do not write into them)."""
        return self._flat


def _dotted(key: str | tuple[str, ...]) -> str:
    return ".".join(key) if isinstance(key, tuple) else key


FlatConfig = Mapping[str, Leaf]
"""A whole config by dotted name, as a link carries it."""


def flat_names(values: TensorDictBase) -> dict[str, torch.Tensor]:
    """A TensorDict's leaves by dotted name.

    Examples:
        >>> sorted(flat_names(TensorDict({"a": torch.tensor(1.0), "b": {"c": torch.zeros(2)}})))
        ['a', 'b.c']
    """
    return {_dotted(k): v for k, v in values.items(True, True)}
