"""Exact merging of running statistics: counts, means and variances.

A :class:`Moments` is the summary of a set of weighted samples: ``count`` is the total weight
``W = sum(w_i)``, ``mean`` the weighted mean and ``m2 = sum(w_i * (x_i - mean) ** 2)``. With plain
samples every weight is 1 and ``count`` is the number of samples. Everything is computed in
float64, with the pairwise formulas of Chan, Golub and LeVeque (1979):

* :func:`merge` gives the moments of the union of the parts' samples, exactly;
* :func:`delta` is its inverse: from two snapshots of one accumulator, the samples in between;
* :func:`merge_rounds` is what a sync does: ``base ⊕ Σ deltas``, where each worker's delta is its
  current moments ⊖ the base it was last given, so no sample is ever counted twice.

Two kinds of accumulators keep such statistics with a forgetting factor ``decay`` ``d``
(``envsync.integrations.torchrl.vecnorm`` reads torchrl's normalisers as them): one that
counts its whole updates ``c`` and weighs ``(1 - d**c) / (1 - d)`` (``c`` if ``d == 1``;
torchrl's ``VecNormV2``, see :func:`decayed_mass`), and one that decays its count instead
(``VecNorm``: ``count = d * count + N`` per update of ``N`` values).

**Decay.** With ``d < 1`` both are exponentially weighted accumulators: a value seen ``a``
updates ago weighs ``d**a``. Their moments are exactly those weights' ``W``, mean and ``m2``,
and :func:`merge` is the weighted Chan merge (the moments of the union of the weighted
samples). A worker given ``base`` that then made ``n`` updates holds ``base.scaled(d**n) ⊕ new``,
so its delta is ``delta(current, base.scaled(d**n))``, and the sync ages the base by the same
factor: ``merge_rounds(base, deltas, base_factor=d**n)``. When every worker made the same ``n``
updates (a collector steps its envs in lockstep), the merged statistics are the weighted moments
of every value every worker saw, a value ``a`` (lockstep) updates old weighing ``d**a``.
An accumulator that counts updates exports ``n`` (:data:`UPDATES`). One that decays its count
determines it: each update does ``count = d * count + N``, so the count tends to its *limit*
``K = N / (1 - d)`` and ``K - count = d**n * (K - c0)`` after ``n`` updates from ``c0``: the
aging factor is ``d**n = (K - count) / (K - c0)``, with ``d`` the decay in the dtype of its
counts (float32 for ``VecNorm``): it exports ``K`` (:data:`LIMIT`). That ratio is well
determined while ``c0`` is away from ``K``; near ``K`` the count's float32 rounding blurs ``n``
(``docs/statistics.md``). An accumulator that counts whole updates holds at most the weight
``1 / (1 - d)`` and only weights of a whole number of updates: loading keeps the mean and the
variance and rounds the weight (:func:`stored`), and the loaders return the moments *as
stored*, the base for the next delta. Each merge with ``d == 1`` is exact to the precision of
the accumulator's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from envsync.errors import ValidationError

# A delta whose weight is below this fraction of the total is treated as empty: float32 state
# leaves noise of about 1e-7 of the total weight, and dividing by that noise would blow up the mean.
_EMPTY = 1e-6


def _f64(value: torch.Tensor | float) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float64)


def ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` where ``den > 0``, else 0 (an empty accumulator has mean and m2 0).

    Examples:
        >>> ratio(torch.tensor([2.0, 3.0]), torch.tensor([4.0, 0.0])).tolist()
        [0.5, 0.0]
    """
    positive = den > 0
    return torch.where(positive, num / torch.where(positive, den, torch.ones_like(den)), torch.zeros_like(num))


@dataclass(frozen=True, eq=False)
class Moments:
    """Weight, mean and sum of squared deviations of a set of (weighted) samples, in float64.

    Args:
        count: total weight, a scalar or a tensor broadcastable against ``mean``.
        mean: the weighted mean.
        m2: ``sum(w * (x - mean) ** 2)``, same shape as ``mean``.

    Examples:
        >>> m = Moments.from_samples(torch.tensor([1.0, 2.0, 3.0, 6.0]))
        >>> m.count.item(), m.mean.item(), m.var.item()
        (4.0, 3.0, 3.5)
    """

    count: torch.Tensor
    mean: torch.Tensor
    m2: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("count", "mean", "m2"):
            object.__setattr__(self, name, _f64(getattr(self, name)))
        if (self.count < 0).any():
            raise ValidationError(f"Moments.count must be >= 0, got {self.count}")

    @classmethod
    def from_samples(cls, x: torch.Tensor, dim: int = 0, weights: torch.Tensor | None = None) -> Moments:
        """The moments of ``x`` along ``dim``, each sample weighing ``weights[i]`` (default 1).

        Examples:
            >>> x = torch.tensor([[1.0, 10.0], [3.0, 30.0]])
            >>> Moments.from_samples(x).mean.tolist()
            [2.0, 20.0]
            >>> Moments.from_samples(x, weights=torch.tensor([3.0, 1.0])).mean.tolist()
            [1.5, 15.0]
        """
        x = _f64(x)
        shape = [1] * x.ndim
        shape[dim] = x.shape[dim]
        w = torch.ones(shape, dtype=torch.float64) if weights is None else _f64(weights).reshape(shape)
        count = w.sum()
        mean = ratio((w * x).sum(dim), count)
        m2 = (w * (x - mean.unsqueeze(dim)) ** 2).sum(dim)
        return cls(count, mean, m2)

    @classmethod
    def empty(cls, shape: tuple[int, ...] | torch.Size = ()) -> Moments:
        """No samples yet, for features of ``shape``.

        Examples:
            >>> Moments.empty((2,)).count.item()
            0.0
        """
        zeros = torch.zeros(shape, dtype=torch.float64)
        return cls(torch.zeros((), dtype=torch.float64), zeros, zeros.clone())

    @property
    def var(self) -> torch.Tensor:
        """Population variance ``m2 / count`` (0 where ``count`` is 0).

        Examples:
            >>> Moments.from_samples(torch.tensor([0.0, 2.0])).var.item()
            1.0
        """
        return ratio(self.m2, self.count)

    def scaled(self, factor: torch.Tensor | float) -> Moments:
        """The same samples with every weight multiplied by ``factor``: ``d**n`` ages them ``n`` updates.

        Examples:
            >>> m = Moments.from_samples(torch.tensor([1.0, 3.0])).scaled(0.5)
            >>> m.count.item(), m.mean.item(), m.var.item()
            (1.0, 2.0, 1.0)
        """
        factor = _f64(factor)
        return Moments(self.count * factor, self.mean, self.m2 * factor)


def _merge2(a: Moments, b: Moments) -> Moments:
    count = a.count + b.count
    shift = b.mean - a.mean
    share_b = ratio(b.count, count)
    mean = a.mean + shift * share_b
    m2 = a.m2 + b.m2 + shift**2 * a.count * share_b
    return Moments(count, mean, m2)


def merge(*parts: Moments) -> Moments:
    """The moments of the union of the parts' samples (Chan et al.'s pairwise formula).

    Examples:
        >>> x = torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0])
        >>> merged = merge(Moments.from_samples(x[:2]), Moments.from_samples(x[2:]))
        >>> torch.allclose(merged.var, Moments.from_samples(x).var)
        True
    """
    if not parts:
        raise ValidationError("merge needs at least one Moments")
    total = parts[0]
    for part in parts[1:]:
        total = _merge2(total, part)
    return total


def delta(new: Moments, old: Moments) -> Moments:
    """The moments of the samples added between two snapshots of one accumulator.

    The inverse of :func:`merge`: ``merge(old, delta(new, old))`` is ``new``. A delta with no
    weight (nothing was added) has mean and ``m2`` 0.

    Raises:
        ValidationError: ``old`` weighs more than ``new``, so it is no earlier snapshot of it.

    Examples:
        >>> x = torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0])
        >>> added = delta(Moments.from_samples(x), Moments.from_samples(x[:2]))
        >>> torch.allclose(added.mean, x[2:].double().mean())
        True
    """
    added = new.count - old.count
    if (added < -_EMPTY * new.count).any():
        raise ValidationError(f"old (count {old.count}) is not an earlier snapshot of new (count {new.count})")
    added = torch.where(added > _EMPTY * new.count, added, torch.zeros_like(added))
    shift = new.mean - old.mean
    mean = new.mean + shift * ratio(old.count, added)
    m2 = new.m2 - old.m2 - shift**2 * ratio(old.count * new.count, added)
    nonempty = added > 0
    return Moments(
        added,
        torch.where(nonempty, mean, torch.zeros_like(mean)),
        torch.where(nonempty, m2.clamp_min(0), torch.zeros_like(m2)),
    )


def merge_rounds(base: Moments, deltas: list[Moments], *, base_factor: torch.Tensor | float = 1.0) -> Moments:
    """What a sync computes: ``base`` (aged by ``base_factor``) ⊕ every worker's delta.

    Each worker's delta is ``delta(current, base.scaled(base_factor))``, its current moments less
    the base it was last given, so a round adds each sample once. With ``decay == 1`` the factor
    is 1; with ``decay < 1`` it is ``decay ** n`` for ``n`` updates since the base (see the module
    docstring).

    Examples:
        >>> base = Moments.from_samples(torch.tensor([0.0, 1.0]))
        >>> workers = [merge(base, Moments.from_samples(torch.tensor([v]))) for v in (2.0, 3.0)]
        >>> merged = merge_rounds(base, [delta(w, base) for w in workers])
        >>> merged.count.item(), merged.mean.item(), merged.m2.item()
        (4.0, 1.5, 5.0)
    """
    return merge(base.scaled(base_factor), *deltas)


def decayed_mass(updates: torch.Tensor, decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Of an accumulator that counts whole updates (``x = d * x + (1 - d) * value`` per update):
    the mass ``1 - d**c`` its sums carry after ``c`` updates, and the weight it stands for,
    ``(1 - d**c) / (1 - d)`` (with ``d == 1``: mass 1 once updated, weight ``c``).

    Examples:
        >>> mass, weight = decayed_mass(torch.tensor(2.0, dtype=torch.float64), 0.5)
        >>> mass.item(), weight.item()
        (0.75, 1.5)
    """
    if decay == 1.0:
        return (updates > 0).to(torch.float64), updates
    mass = -torch.expm1(updates * math.log(decay))
    return mass, mass / (1.0 - decay)


def whole_updates(weight: float, decay: float) -> int:
    """The whole number of updates whose weight (:func:`decayed_mass`) is nearest ``weight``,
    capped for ``decay < 1`` where ``decay ** updates`` no longer changes in float64.

    Examples:
        >>> whole_updates(10.4, 1.0), whole_updates(1.5, 0.5), whole_updates(100.0, 0.5)
        (10, 2, 53)
    """
    if decay == 1.0:
        return round(weight)
    most = math.ceil(math.log(2.0**-53) / math.log(decay))
    mass = (1.0 - decay) * weight
    if mass >= 1.0:
        return most
    return min(round(math.log1p(-mass) / math.log(decay)), most)


FIELDS = ("count", "mean", "m2")
UPDATES = "updates"
"""An optional leaf beside the moments: how many updates the accumulator made (``decay < 1``
ages a base by ``decay ** updates-since``)."""
LIMIT = "limit"
"""An optional leaf beside the moments of an accumulator that decays its count instead of
counting its updates (``VecNorm``): the weight its count tends to, from which two counts
tell the updates made in between."""


def _groups(flat: Mapping[str, torch.Tensor]) -> dict[str, Moments]:
    """``{"<prefix>.count", "<prefix>.mean", "<prefix>.m2"}`` leaves -> ``{prefix: Moments}``."""
    prefixes = {name.rsplit(".", 1)[0] for name in flat}
    return {p: Moments(flat[f"{p}.count"], flat[f"{p}.mean"], flat[f"{p}.m2"]) for p in sorted(prefixes)}


def _flat(groups: Mapping[str, Moments]) -> dict[str, torch.Tensor]:
    return {f"{p}.{field}": getattr(m, field) for p, m in groups.items() for field in FIELDS}


def _updates(flat: Mapping[str, torch.Tensor], prefix: str) -> float:
    value = flat.get(f"{prefix}.{UPDATES}")
    return 0.0 if value is None else float(value)


def _age(now: Mapping[str, torch.Tensor], before: Mapping[str, torch.Tensor], prefix: str, decay: float) -> float:
    """The updates an accumulator made from ``before`` to ``now``: the difference of its
    update counts, or, for one with a count ``limit`` ``K``, ``n`` with
    ``d**n = (K - count) / (K - count_before)`` (0 where that is undetermined: a count at
    its limit, or rounding that moved it away from it)."""
    limit = now.get(f"{prefix}.{LIMIT}")
    if limit is None:
        return _updates(now, prefix) - _updates(before, prefix)
    k = float(limit)
    left, was = (k - float(side[f"{prefix}.count"].reshape(-1)[0]) for side in (now, before))
    ratio = left / was if was != 0.0 else 1.0
    return max(0.0, math.log(ratio) / math.log(decay)) if ratio > 0.0 else 0.0


def stored(merged: Moments, decay: float) -> tuple[Moments, int]:
    """What an accumulator that counts whole updates (``VecNormV2``) holds after loading
    ``merged``: the weight rounded to a whole number of updates (capped at ``1 / (1 - decay)``),
    mean and variance kept; and that number of updates.

    Examples:
        >>> kept, updates = stored(Moments(torch.tensor(10.4), torch.tensor([1.0]), torch.tensor([20.8])), 1.0)
        >>> updates, kept.count.item(), kept.var.tolist()
        (10, 10.0, [2.0])
    """
    updates = whole_updates(float(merged.count.reshape(-1)[0]), decay)
    _, weight = decayed_mass(_f64(updates), decay)
    return Moments(weight, merged.mean, merged.var * weight), updates


Leaves = Mapping[str, torch.Tensor]


def sync_round(
    base: Leaves, given: Mapping[int, Leaves], current: Mapping[int, Leaves], decay: Mapping[str, float] | None = None
) -> dict[str, torch.Tensor]:
    """One ``sync_stats`` round over flat moment leaves (``<prefix>.count/.mean/.m2``, and
    ``.updates`` where an accumulator counts them, or ``.limit`` where its count tells them).

    Each worker contributes ``delta(current[w], given[w] aged by decay ** n_w)``: what it saw
    since it was last loaded with ``given[w]`` (``base`` if absent), ``n_w`` its updates since.
    The result is ``base`` aged by the workers' mean ``n`` ⊕ every delta; for a prefix with an
    update count it is given as stored by such an accumulator (see :func:`stored`); one that
    stores any weight (``.limit``) keeps it.

    Examples:
        >>> empty = {"x.count": torch.tensor(0.0), "x.mean": torch.zeros(1), "x.m2": torch.zeros(1)}
        >>> seen = {w: _flat({"x": Moments.from_samples(torch.tensor([[float(w)], [w + 2.0]]))}) for w in (0, 1)}
        >>> merged = sync_round(empty, {}, seen)
        >>> merged["x.count"].item(), merged["x.mean"].tolist()
        (4.0, [1.5])
    """
    out = {}
    extra = (f".{UPDATES}", f".{LIMIT}")
    for prefix, total in _groups({k: v for k, v in base.items() if not k.endswith(extra)}).items():
        d = (decay or {}).get(prefix, 1.0)
        deltas, ages = [], []
        for worker, values in current.items():
            before = given.get(worker, base)
            n = _age(values, before, prefix, d)
            ages.append(n)
            before_m = Moments(before[f"{prefix}.count"], before[f"{prefix}.mean"], before[f"{prefix}.m2"])
            now = Moments(values[f"{prefix}.count"], values[f"{prefix}.mean"], values[f"{prefix}.m2"])
            deltas.append(delta(now, before_m.scaled(d**n)))
        aged = d ** (sum(ages) / len(ages)) if ages else 1.0
        merged = merge_rounds(total, deltas, base_factor=aged)
        if f"{prefix}.{UPDATES}" in base:
            merged, updates = stored(merged, d)
            out[f"{prefix}.{UPDATES}"] = torch.tensor(float(updates), dtype=torch.float64)
        if f"{prefix}.{LIMIT}" in base and current:
            out[f"{prefix}.{LIMIT}"] = next(iter(current.values()))[f"{prefix}.{LIMIT}"]
        out.update({f"{prefix}.{field}": getattr(merged, field) for field in FIELDS})
    return out
