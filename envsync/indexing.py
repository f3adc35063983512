"""Rows of a column by index: the one way envsync reads and writes the rows of thousands of
worlds (:func:`take_rows`, :func:`put_rows`), as a slice where the rows are consecutive
(:func:`span_of`: every row of an env, a run of them)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

Rows = np.ndarray | slice
"""Row indices (int64), or the slice they make when they are consecutive (:func:`span_of`)."""

Indices = Sequence[int] | np.ndarray | torch.Tensor
"""Indices a user gives (``workers=``, ``envs=``): ints, or a 1-D integer array or tensor."""


def span_of(indices: np.ndarray, *, ascending: bool = False) -> Rows:
    """``indices`` (int64) as a slice when they are consecutive and ascending (every row of
    an env, a run of them), else themselves: numpy and torch read and write a slice as one
    copy, an index array element by element (thousands of rows at every push).
    ``ascending``: the caller knows them strictly ascending (rows found by ``flatnonzero``),
    so their ends decide, with no pass over them.

    Examples:
        >>> span_of(np.array([3, 4, 5])), span_of(np.array([5, 4, 3])).tolist(), span_of(np.array([1, 3])).tolist()
        (slice(3, 6, None), [5, 4, 3], [1, 3])
        >>> span_of(np.array([3, 4, 5]), ascending=True), span_of(np.array([3, 5]), ascending=True).tolist()
        (slice(3, 6, None), [3, 5])
    """
    count = len(indices)
    if not count or int(indices[-1]) - int(indices[0]) != count - 1:
        return indices
    first = int(indices[0])
    if not ascending and count > 2:
        if count <= 16:  # a few envs: a list compare costs less than three numpy calls
            if indices.tolist() != list(range(first, first + count)):
                return indices
        elif not bool((np.diff(indices) == 1).all()):
            return indices
    return slice(first, first + count)


def take_rows(values: torch.Tensor, rows: Rows | torch.Tensor) -> torch.Tensor:
    """A copy of ``values``' rows ``rows`` (indices). ``index_select``, never ``values[rows]``:
    torch's advanced indexing hands thousands of rows to its thread pool, which on a busy
    machine costs milliseconds where this costs microseconds.

    Examples:
        >>> take_rows(torch.tensor([1.0, 2.0, 3.0]), np.array([2, 0])).tolist()
        [3.0, 1.0]
    """
    if isinstance(rows, slice):
        return values[rows].clone()
    index = rows if isinstance(rows, torch.Tensor) else torch.from_numpy(np.asarray(rows, dtype=np.int64))
    return values.index_select(0, index.to(values.device))


def put_rows(target: torch.Tensor, rows: Rows | torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values`` (one row per index, or one value for all) into ``target``'s rows
    ``rows`` in place (``index_copy_``, see :func:`take_rows`).

    Examples:
        >>> target = torch.zeros(3)
        >>> put_rows(target, np.array([2, 0]), torch.tensor([5.0, 7.0])); target.tolist()
        [7.0, 0.0, 5.0]
    """
    source = values.to(device=target.device, dtype=target.dtype)
    if isinstance(rows, slice):
        target[rows] = source  # one value broadcasts
        return
    index = rows if isinstance(rows, torch.Tensor) else torch.from_numpy(np.asarray(rows, dtype=np.int64))
    index = index.to(target.device)
    if source.ndim < target.ndim:  # one value for every row
        source = source.expand(len(index), *target.shape[1:])
    target.index_copy_(0, index, source)
