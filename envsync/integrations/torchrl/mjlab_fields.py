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
* The constants MuJoCo derives from a field are recomputed by
  :class:`~.finishes.RecomputeConstants`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


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


__all__ = ["array_view", "give_own_rows", "is_proxy"]
