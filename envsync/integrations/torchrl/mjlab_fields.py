"""mjlab's model fields (MuJoCo Warp, through torchrl's ``MJLabWrapper``): what envsync reaches
of mjlab, each reach with its reason. mjlab is never imported here unless a finish runs.

* A field of ``env.sim.model`` is mjlab's ``TorchArray`` (``mjlab.sim.sim_data``), not a
  ``torch.Tensor``: :func:`array_view` reads it as a tensor (``field[...]``, a view of the
  Warp memory), and envsync writes it through its own ``__setitem__`` (mjlab's way: on CUDA
  it writes on Warp's stream).
* MuJoCo Warp stores a model field with one world (a Warp array of shape ``(1, ...)``) that
  mjlab shows as ``(nworld, ...)`` with stride 0: one world's write would reach every world.
  :func:`give_own_rows` expands such a field with ``Simulation.expand_model_fields`` (real
  per-world memory, CUDA graphs re-captured by mjlab), once, when envsync binds.
* Constants MuJoCo derives from a field (``body_subtreemass`` from ``body_mass``, ...) are
  recomputed by :class:`RecomputeConstants` (``Simulation.recompute_constants``), which
  first expands the derived fields too: mujoco_warp's ``set_const`` runs over as many worlds
  as those fields hold, so with one world it would give every world world 0's constants.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

LEVELS = ("set_const_fixed", "set_const_0", "set_const")
"""mjlab's ``RecomputeLevel`` names, cheapest first (``none`` needs no finish)."""


def is_proxy(value: Any) -> bool:
    """Whether ``value`` is an array proxy over Warp memory (mjlab's ``TorchArray``: a
    ``wp_array`` and tensor indexing), not an array itself."""
    return not isinstance(value, torch.Tensor) and hasattr(type(value), "__setitem__") and hasattr(value, "wp_array")


def array_view(value: Any) -> Any:
    """``value`` as a tensor when it is a proxy (``value[...]``: the same memory, the same
    strides, so a stride-0 world dim shows); anything else as it is."""
    return value[...] if is_proxy(value) else value


def give_own_rows(objects: Sequence[Any], field: str) -> bool:
    """Expand model field ``field`` to per-world memory if ``objects`` (the path's objects,
    first to last, ending with the field's holder) reach it as ``<simulation>.model.<field>``
    of an mjlab ``Simulation``; return whether it did (the caller reads the field again: mjlab
    replaced the array)."""
    if len(objects) < 2:
        return False
    sim, model = objects[-2], objects[-1]
    expand = getattr(sim, "expand_model_fields", None)
    if not callable(expand) or getattr(sim, "model", None) is not model:
        return False
    try:
        expand((field,))
    except ValueError:  # mjlab: not a field of the MuJoCo model
        return False
    return True


_EXPANDED: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


class RecomputeConstants:
    """A ``finish=`` for mjlab envs: ``env.sim.recompute_constants(level)`` after every apply,
    the derived fields of ``level`` first expanded to per-world memory (once per simulation).

    Args:
        level: an mjlab ``RecomputeLevel`` name: ``"set_const"`` after ``body_mass`` or
            ``body_ipos``; ``"set_const_0"`` after ``body_inertia``, ``dof_armature``,
            ``body_pos``/``body_quat``, ``qpos0``; ``"set_const_fixed"`` after
            ``body_gravcomp``. Friction, damping and actuator gains need none.

    Examples:
        >>> RecomputeConstants("set_const")
        envsync.apply.recompute_constants('set_const')
    """

    def __init__(self, level: str = "set_const") -> None:
        if level not in LEVELS:
            from envsync.errors import ValidationError

            raise ValidationError(f"recompute_constants(): level must be one of {LEVELS}, got {level!r}")
        self.level = level

    def __call__(self, env: Any) -> None:
        from mjlab.managers.event_manager import RecomputeLevel, requires_model_fields

        sim = env.sim
        level = RecomputeLevel[self.level]
        done = _EXPANDED.setdefault(sim, set())
        if self.level not in done:
            # mjlab's public list of the fields a level recomputes: the one its own DR expands
            derived = requires_model_fields(recompute=level)(_no_event).model_fields
            sim.expand_model_fields(tuple(f for f in derived if hasattr(sim.mj_model, f)))
            done.add(self.level)
        sim.recompute_constants(level)

    def __repr__(self) -> str:
        return f"envsync.apply.recompute_constants({self.level!r})"


def _no_event() -> None:
    """What ``requires_model_fields`` decorates to tell its derived fields."""


__all__ = ["LEVELS", "RecomputeConstants", "array_view", "give_own_rows", "is_proxy"]
