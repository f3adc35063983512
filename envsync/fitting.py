"""How a pushed value is fitted to its template: checked for its kind, dtype, shape and
finiteness (a :class:`~envsync.errors.ValidationError` naming its path otherwise) and copied
(a plain number as a 0-d numpy array, a tensor into one of the sender's reused buffers). Used
by both templates of :mod:`envsync.state`."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from envsync.buffers import BUFFERS
from envsync.errors import ValidationError

PLAIN = (bool, int, float, torch.Tensor, np.ndarray)
"""Values that are never mappings (checked first: a number skips the ABC check)."""


def check_finite(what: str, path: str, value: torch.Tensor) -> None:
    """Refuse a tensor that holds NaN or inf, naming ``what`` and ``path``."""
    # a finite sum proves every element finite, at the cost of one read (no bool tensor; read
    # as a Python float: a third of torch.isfinite's dispatch on a 0-d tensor, ~2 µs against
    # ~7 at every push); only a non-finite sum (or an overflow) needs the element-wise check
    if not value.is_floating_point() or math.isfinite(value.sum().item()):
        return
    if not bool(torch.isfinite(value).all()):
        raise ValidationError(
            f"{what} {path!r} holds NaN or inf; build the sender with allow_nonfinite=True to allow it"
        )


@functools.cache
def float_max(numpy_dtype: np.dtype) -> float:
    """The largest finite value of a float dtype (cached: read on every push of a number)."""
    return float(np.finfo(numpy_dtype).max)


def as_number(value: bool | int | float, like: torch.Tensor, numpy_dtype: np.dtype | None) -> torch.Tensor | np.ndarray:
    """``value`` as a 0-d numpy array of ``numpy_dtype`` (else a tensor of ``like``'s dtype);
    a float past the dtype's range becomes inf, without numpy's overflow warning (the caller
    refuses it unless non-finite values are allowed)."""
    if numpy_dtype is None:
        return torch.as_tensor(value, dtype=like.dtype)
    if isinstance(value, float) and numpy_dtype.kind == "f" and abs(value) > float_max(numpy_dtype):
        with np.errstate(over="ignore"):  # entered only then: it is a context change per call
            return np.asarray(value, dtype=numpy_dtype)
    return np.asarray(value, dtype=numpy_dtype)


def fit(
    what: str,
    path: str,
    value: Any,
    like: torch.Tensor,
    allow_nonfinite: bool,
    *,
    numpy_dtype: np.dtype | None = None,
) -> torch.Tensor | np.ndarray:
    """Check one pushed value against its template tensor; return it as a fresh tensor (a
    copy, never the caller's own). A plain number for a 0-d template with ``numpy_dtype`` becomes a 0-d numpy array."""
    if not isinstance(value, PLAIN) and isinstance(value, Mapping | TensorDictBase):
        raise ValidationError(f"{what} {path!r} is a value in the template, not a mapping")
    if isinstance(value, bool | int | float):
        if like.dtype == torch.bool:
            fits = isinstance(value, bool)
        elif like.is_floating_point():
            fits = not isinstance(value, bool)
        else:
            fits = isinstance(value, int) and not isinstance(value, bool)
        if not fits:
            raise ValidationError(f"{what} {path!r} has dtype {like.dtype}, got {type(value).__name__} {value!r}")
        if not allow_nonfinite and not math.isfinite(value):
            raise ValidationError(
                f"{what} {path!r} holds NaN or inf; build the sender with allow_nonfinite=True to allow it"
            )
        try:
            number = as_number(value, like, numpy_dtype)
        except (OverflowError, ValueError, RuntimeError) as err:  # numpy's, torch's
            raise ValidationError(f"{what} {path!r} does not fit dtype {like.dtype}: {value!r}") from err
        if not allow_nonfinite and isinstance(value, float) and not math.isfinite(number.item()):
            raise ValidationError(f"{what} {path!r} overflows dtype {like.dtype}: {value!r}")  # 1e300 as float32
        if number.shape != like.shape:
            raise ValidationError(f"{what} {path!r} has shape {tuple(like.shape)}, got {tuple(number.shape)}")
        return number
    elif isinstance(value, torch.Tensor):
        widens_to_float = like.is_floating_point() and value.dtype not in (torch.bool,) and not value.is_complex()
        if value.dtype != like.dtype and not widens_to_float:
            raise ValidationError(f"{what} {path!r} has dtype {like.dtype}, got {value.dtype}")
        if value.shape != like.shape:
            raise ValidationError(f"{what} {path!r} has shape {tuple(like.shape)}, got {tuple(value.shape)}")
        tensor = BUFFERS.copy(value.detach(), like.dtype)
    else:
        raise ValidationError(f"{what} {path!r} must be a number or a tensor, got {type(value).__name__}")
    if not allow_nonfinite:
        check_finite(what, path, tensor)
    return tensor
