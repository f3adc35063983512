"""Attribute paths into an env: where ``envsync.apply.attributes()`` and ``scales()`` write.

A config name ``"model.body_mass"`` (nested ``{"model": {"body_mass": ...}}`` in a config) is
an attribute path: its first part is found along :func:`envsync.configure.wrapper_chain` (the
first object that holds it), the rest is followed as attributes. An array at the end of the
path (a numpy array such as a MuJoCo model's ``body_mass``, or a tensor) is written in place,
keeping its dtype and shape, so a simulator that reads that memory sees the new values at its
next step; anything else is set with ``setattr``. An array proxy (mjlab's model fields) is read
as the tensor it shows and written through its own indexing (:mod:`.mjlab_fields`).

In a natively batched env each config row is one row of the array (its leading dim is the
env's batch): a write names its ``rows`` and is one indexed write of all of them. An array
whose rows share memory (stride 0 on a dim, as MuJoCo Warp keeps a model field until it is
expanded) would take one row's value into every row: it is expanded to per-row memory where
the simulator can (:func:`.mjlab_fields.give_own_rows`), and refused otherwise.

A value that does not fit (another shape, a dtype that does not cast within its kind, an array
for a number) is a :class:`~envsync.ValidationError` naming the path, raised where the path is
first written: when the env is built, in the main process for the sender's probe env.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from envsync.configure import chain_names, wrapper_chain
from envsync.errors import ValidationError
from envsync.integrations.torchrl.mjlab_fields import array_view, give_own_rows, is_proxy
from envsync.state import Leaf

_MISSING = object()

Array = np.ndarray | torch.Tensor


def _holds(owner: Any, name: str, *, settable: bool) -> bool:
    """Whether ``owner`` itself holds a data attribute ``name`` (no ``__getattr__``
    forwarding, as torchrl's wrappers do; no method; with ``settable``, no read-only property)."""
    found = inspect.getattr_static(owner, name, _MISSING)
    if found is _MISSING or inspect.isroutine(found):
        return False
    return not settable or not isinstance(found, property) or found.fset is not None


def find_owner(env: Any, name: str, *, settable: bool = True) -> Any:
    """The first object along the env's wrapper chain that holds attribute ``name``.

    Raises:
        ValidationError: none does (the message names the chain searched).
    """
    owners = wrapper_chain(env)
    for owner in owners:
        if _holds(owner, name, settable=settable):
            return owner
    raise ValidationError(
        f"attributes(): no object along the env's wrapper chain has an attribute {name!r} "
        f"(searched {chain_names(owners)})"
    )


def _is_array(value: Any) -> bool:
    return isinstance(value, np.ndarray | torch.Tensor)


def _shares_rows(array: Any) -> bool:
    """Whether some elements of ``array`` are one memory location (a stride of 0 on a dim of
    more than one element: an ``expand``ed or broadcast view)."""
    strides = array.stride() if isinstance(array, torch.Tensor) else array.strides
    return any(s == 0 and n > 1 for s, n in zip(strides, array.shape, strict=True))


def _describe(value: Any) -> str:
    if _is_array(value):
        return f"a {str(value.dtype).removeprefix('torch.')} array of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


@dataclass(frozen=True)
class AttributePath:
    """One attribute path, resolved on one env: the object holding its first part, and the
    rest of the path from there.

    Examples:
        >>> from torchrl.envs import GymEnv
        >>> path = AttributePath.resolve(GymEnv("Pendulum-v1"), "g")
        >>> type(path.owner).__name__, path.get()
        ('PendulumEnv', 10.0)
    """

    name: str
    owner: Any
    rest: tuple[str, ...]

    @classmethod
    def resolve(cls, env: Any, name: str) -> AttributePath:
        """Find ``name``'s first part along ``env``'s chain and check the rest exists.

        Raises:
            ValidationError: a part of the path that does not exist.
        """
        first, *rest = name.split(".")
        path = cls(name, find_owner(env, first, settable=not rest), tuple(rest))
        obj = getattr(path.owner, first) if rest else None
        for depth, part in enumerate(rest, start=1):  # every later part exists and is no method
            obj = _follow(name, obj, part, depth)
        return path

    def parent(self) -> Any:
        """The object that holds the path's last attribute (the path was checked when resolved)."""
        return self.objects()[-1]

    def objects(self) -> list[Any]:
        """The objects along the path, from its owner to the holder of its last attribute."""
        objects = [self.owner]
        if self.rest:
            objects.append(getattr(self.owner, self.name.split(".", 1)[0]))
            for part in self.rest[:-1]:
                objects.append(getattr(objects[-1], part))
        return objects

    @property
    def last(self) -> str:
        """The attribute the path ends with."""
        return (self.rest or (self.name,))[-1]

    def get(self) -> Any:
        """The attribute's current value (an array is the env's own, not a copy; a proxy's
        the tensor view it shows)."""
        return array_view(getattr(self.parent(), self.last))

    def own_rows(self) -> None:
        """Make sure a write to one element reaches that element only: an array whose
        elements share memory is expanded where its simulator can (an mjlab model field).

        Raises:
            ValidationError: it cannot be, naming the path.
        """
        current = self.get()
        if not _is_array(current) or not _shares_rows(current):
            return
        objects = self.objects()
        if give_own_rows(objects, self.last) and not _shares_rows(self.get()):
            return
        raise ValidationError(
            f"attributes(): {self.name!r} is {_describe(current)} whose rows share one memory (stride "
            f"{current.stride() if isinstance(current, torch.Tensor) else current.strides}): a write to one row "
            "would reach every row; give it memory of its own (a simulator's per-world copy) before envsync binds"
        )

    def check(self, value: Leaf, rows: int | None = None) -> None:
        """Refuse a value that the attribute cannot take as it is. With ``rows`` (the batch
        size of a natively batched env), ``value`` has a leading dim of some of the env's
        rows, and the array one row per env.

        Raises:
            ValidationError: an array of another shape or of a dtype that does not cast
                within its kind; an array (not 0-d) for an attribute that is not one.
        """
        current = self.get()
        shape = tuple(value.shape) if rows is None else (rows, *value.shape[1:])
        if _is_array(current):
            if isinstance(current, torch.Tensor):
                fits = torch.can_cast(torch.as_tensor(value).dtype, current.dtype)
            else:
                source = value.numpy() if isinstance(value, torch.Tensor) else value
                fits = np.can_cast(source.dtype, current.dtype, casting="same_kind")
            if shape != tuple(current.shape) or not fits:
                per_env = "" if rows is None else f" (one row per env of a natively batched env of {rows} envs)"
                raise ValidationError(
                    f"attributes(): {self.name!r} is {_describe(current)}, written in place{per_env}; "
                    f"the config gives {_describe(value)}"
                )
        elif shape != ():
            given = _describe(value)
            raise ValidationError(f"attributes(): {self.name!r} is {_describe(current)}; the config gives {given}")

    def write(self, value: Leaf | np.generic, rows: torch.Tensor | None = None) -> None:
        """Write ``value`` into the array in place (``rows``: into those rows of it, one
        indexed write), or set the attribute to the number."""
        parent, last = self.parent(), self.last
        current = getattr(parent, last)
        if isinstance(current, np.ndarray):
            source = value.numpy() if isinstance(value, torch.Tensor) else value
            if rows is None:
                np.copyto(current, source, casting="same_kind")
            else:
                current[rows.numpy()] = source
        elif isinstance(current, torch.Tensor) or is_proxy(current):
            device = current.device
            current[... if rows is None else rows.to(device)] = torch.as_tensor(value).to(device, current.dtype)
        else:
            setattr(parent, last, value.item() if isinstance(value, np.generic) or _is_array(value) else value)


def held_at(env: Any, name: str) -> torch.Tensor:
    """A copy of what ``env`` holds at attribute path ``name``, as a tensor (what
    ``sender.read_attributes`` reads back).

    Raises:
        ValidationError: the path does not exist, or holds neither a number nor an array.

    Examples:
        >>> from torchrl.envs import GymEnv
        >>> held_at(GymEnv("Pendulum-v1"), "g")
        tensor(10., dtype=torch.float64)
    """
    value = AttributePath.resolve(env, name).get()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, np.ndarray | np.generic | bool | int | float):
        return torch.as_tensor(np.array(value))
    raise ValidationError(f"read_attributes: {name!r} holds {_describe(value)}, not a number or an array")


def _follow(name: str, obj: Any, part: str, depth: int) -> Any:
    """Attribute ``part`` of ``obj``, the ``depth``-th part of path ``name``.

    Raises:
        ValidationError: ``obj`` has no such attribute, or it is a method.
    """
    value = getattr(obj, part, _MISSING)
    if value is _MISSING or inspect.isroutine(value):
        followed = ".".join(name.split(".")[:depth])
        raise ValidationError(f"attributes(): {name!r}: {followed!r} ({type(obj).__name__}) has no attribute {part!r}")
    return value


_BUILT: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
"""Per owner object (the unwrapped env, say), the values its paths had before envsync first
wrote them: what a scale is relative to. Kept with the env, not with an apply's binding, since
an env is bound more than once (when built, and again when a collector binds it)."""


def as_built(path: AttributePath) -> Any:
    """The value ``path`` had before any scale was written to it (a copy, read on first call).

    Examples:
        >>> from torchrl.envs import GymEnv
        >>> env = GymEnv("Pendulum-v1")
        >>> path = AttributePath.resolve(env, "g")
        >>> as_built(path)
        10.0
        >>> path.write(np.array(3.0)); as_built(path)
        10.0
    """
    try:
        built = _BUILT.setdefault(path.owner, {})
    except TypeError as err:
        raise ValidationError(f"scales(): {type(path.owner).__name__} holding {path.name!r} cannot be tracked") from err
    if path.name not in built:
        current = path.get()
        built[path.name] = (
            current.copy()
            if isinstance(current, np.ndarray)
            else (current.clone() if isinstance(current, torch.Tensor) else current)
        )
    return built[path.name]


def scaled(built: Any, factor: np.ndarray, rows: torch.Tensor | None = None) -> Any:
    """``built`` (``rows``: those rows of it) times ``factor``, the factor's dims aligned with
    the leading dims of ``built`` (a per-body factor of shape ``(8,)`` scales every column of
    an ``(8, 3)`` array). A tensor stays a tensor, on its device.

    Examples:
        >>> scaled(np.ones((2, 3)), np.array([2.0, 3.0]))
        array([[2., 2., 2.],
               [3., 3., 3.]])
        >>> scaled(torch.ones(3, 2), np.array([2.0, 3.0]), rows=torch.tensor([0, 2]))
        tensor([[2., 2.],
                [3., 3.]])
    """
    if isinstance(built, torch.Tensor):
        rows_of = built if rows is None else built[rows.to(built.device)]
        scale = torch.as_tensor(factor).to(rows_of.device, rows_of.dtype)
        return rows_of * scale.reshape(scale.shape + (1,) * (rows_of.ndim - scale.ndim))
    base = np.asarray(built) if rows is None else np.asarray(built)[rows.numpy()]
    return base * factor.reshape(factor.shape + (1,) * (base.ndim - factor.ndim))


def check_factor(path: AttributePath, factor: np.ndarray, rows: int | None = None) -> None:
    """Refuse a scale factor whose shape is not a leading part of the attribute's shape
    (``rows``: a natively batched env's, whose leading dim must be its batch).

    Raises:
        ValidationError: naming the path, its shape and the factor's.
    """
    current = path.get()
    shape = tuple(current.shape) if _is_array(current) else ()
    if not _is_array(current) and not isinstance(current, int | float | np.generic):
        raise ValidationError(f"scales(): {path.name!r} is {_describe(current)}, not a number or an array")
    if rows is not None and shape[:1] != (rows,):
        raise ValidationError(
            f"scales(): {path.name!r} has shape {shape}; a natively batched env of {rows} envs scales one "
            f"row per env of an array of {rows} rows"
        )
    if tuple(factor.shape) != shape[: factor.ndim]:
        raise ValidationError(
            f"scales(): {path.name!r} has shape {shape}; a scale must have a leading part of it "
            f"(() for all, {shape[:1]} per row), got {tuple(factor.shape)}"
        )


__all__ = ["AttributePath", "as_built", "check_factor", "find_owner", "scaled"]
