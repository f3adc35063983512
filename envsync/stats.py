"""Exact merging of running statistics: counts, means and variances.

A :class:`Moments` is the summary of a set of weighted samples: ``count`` is the total weight
``W = sum(w_i)``, ``mean`` the weighted mean and ``m2 = sum(w_i * (x_i - mean) ** 2)``. With plain
samples every weight is 1 and ``count`` is the number of samples. Everything is computed in
float64, with the pairwise formulas of Chan, Golub and LeVeque (1979):

* :func:`merge` gives the moments of the union of the parts' samples, exactly;
* :func:`delta` is its inverse: from two snapshots of one accumulator, the samples in between;
* :func:`merge_rounds` is what a sync does: ``base ⊕ Σ deltas``, where each worker's delta is its
  current moments ⊖ the base it was last given, so no sample is ever counted twice.

The converters read and write the running statistics of torchrl's normalising transforms, as
verified against torchrl 0.14.1 (``x`` a value seen, ``a`` the number of updates since it was
seen, ``d`` the transform's ``decay``, ``c`` its number of updates):

* ``VecNormV2``: ``_loc[k] = (1 - d) * Σ d**a x`` and ``_var[k] = (1 - d) * Σ d**a x**2`` (a raw
  second moment, *not* a variance), ``_count[k]`` the integer ``c`` (int64, one per key: a reset
  updates the observation but not the reward). With ``d == 1`` they are the plain mean, the
  mean of squares and the number of values. Its weight is ``(1 - d**c) / (1 - d)`` (``c`` if
  ``d == 1``); :func:`vecnorm_v2_moments` divides ``_loc`` and ``_var`` by the mass ``1 - d**c``.
* ``VecNorm`` (v1): ``_td[k + "_sum"] = Σ d**a x`` and ``_td[k + "_ssq"] = Σ d**a x**2`` (summed over
  the batch), ``_td[k + "_count"] = Σ d**a N`` (float32, shape ``(1,)``; ``N`` the batch numel).

**Decay.** With ``d < 1`` both transforms are exponentially weighted accumulators: a value seen
``a`` updates ago weighs ``d**a``. The converters return exactly those weights' ``W``, mean and
``m2``, and :func:`merge` is the weighted Chan merge (the moments of the union of the weighted
samples). A worker given ``base`` that then made ``n`` updates holds ``base.scaled(d**n) ⊕ new``,
so its delta is ``delta(current, base.scaled(d**n))``, and the sync ages the base by the same
factor: ``merge_rounds(base, deltas, base_factor=d**n)``. When every worker made the same ``n``
updates (a collector steps its envs in lockstep), the merged statistics are the weighted moments
of every value every worker saw, a value ``a`` (lockstep) updates old weighing ``d**a``.
``VecNormV2`` keeps ``n`` (:func:`vecnorm_v2_updates`). ``VecNorm``'s count determines it: each
update does ``count = d * count + N``, so the count tends to its *limit* ``K = N / (1 - d)``
and ``K - count = d**n * (K - c0)`` after ``n`` updates from ``c0``: the aging factor is
``d**n = (K - count) / (K - c0)``, with ``d`` the decay in float32 (the dtype of its counts):
its handler exports ``K`` (:data:`LIMIT`). That ratio is well determined while ``c0`` is away
from ``K``; near ``K`` the count's float32 rounding blurs ``n`` (``docs/statistics.md``).
``VecNormV2`` holds at most the weight ``1 / (1 - d)`` and only weights of a whole number of
updates: loading keeps the mean and the variance and rounds the weight, and the loaders return
the moments *as stored*, the base for the next delta. Each merge with ``d == 1`` is exact to
the precision of the transform's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from envsync.errors import ValidationError

NestedKey = str | tuple[str, ...]

# A delta whose weight is below this fraction of the total is treated as empty: float32 state
# leaves noise of about 1e-7 of the total weight, and dividing by that noise would blow up the mean.
_EMPTY = 1e-6


def _f64(value: torch.Tensor | float) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float64)


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` where ``den > 0``, else 0 (an empty accumulator has mean and m2 0)."""
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
        mean = _ratio((w * x).sum(dim), count)
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
        return _ratio(self.m2, self.count)

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
    share_b = _ratio(b.count, count)
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
    mean = new.mean + shift * _ratio(old.count, added)
    m2 = new.m2 - old.m2 - shift**2 * _ratio(old.count * new.count, added)
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


class VecNormV2Like(Protocol):
    """What the converters read of a ``torchrl.envs.VecNormV2``: its running statistics."""

    decay: float
    _loc: Any
    _var: Any
    _count: Any


class VecNormLike(Protocol):
    """What the converters read of a ``torchrl.envs.VecNorm`` (v1): its running statistics."""

    decay: float
    in_keys: Any
    _td: Any


def _v2_count(transform: VecNormV2Like, key: NestedKey) -> torch.Tensor:
    counts = transform._count
    return counts if isinstance(counts, torch.Tensor) else counts.get(key)


def _v2_mass_weight(updates: torch.Tensor, decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The mass ``1 - d**c`` that ``_loc``/``_var`` carry, and the weight it stands for."""
    if decay == 1.0:
        return (updates > 0).to(torch.float64), updates
    mass = -torch.expm1(updates * math.log(decay))
    return mass, mass / (1.0 - decay)


def _require_v2(transform: VecNormV2Like) -> None:
    if getattr(transform, "_loc", None) is None:
        raise ValidationError(f"{type(transform).__name__} has no statistics yet (stateless, or never called)")


def vecnorm_v2_moments(transform: VecNormV2Like) -> dict[NestedKey, Moments]:
    """The moments a ``VecNormV2`` holds, one per normalised key.

    Examples:
        >>> import warnings; warnings.filterwarnings("ignore")
        >>> from torchrl.envs import GymEnv, TransformedEnv, VecNormV2
        >>> env = TransformedEnv(GymEnv("Pendulum-v1"), VecNormV2(in_keys=["observation"], decay=1.0))
        >>> _ = env.rollout(3)  # a reset and 3 steps: 4 observations
        >>> vecnorm_v2_moments(env.transform)["observation"].count.item()
        4.0
    """
    _require_v2(transform)
    decay = float(transform.decay)
    result: dict[NestedKey, Moments] = {}
    for key in transform._loc.keys(True, True):
        mass, weight = _v2_mass_weight(_f64(_v2_count(transform, key)), decay)
        mean = _ratio(_f64(transform._loc.get(key)), mass)
        second = _ratio(_f64(transform._var.get(key)), mass)
        result[key] = Moments(weight, mean, weight * (second - mean**2).clamp_min(0))
    return result


def vecnorm_v2_updates(transform: VecNormV2Like) -> dict[NestedKey, int]:
    """How many updates a ``VecNormV2`` made per key: ``decay ** (now - then)`` ages a base.

    Examples:
        >>> import warnings; warnings.filterwarnings("ignore")
        >>> from torchrl.envs import GymEnv, TransformedEnv, VecNormV2
        >>> env = TransformedEnv(GymEnv("Pendulum-v1"), VecNormV2(in_keys=["observation", "reward"]))
        >>> _ = env.rollout(3)  # a reset updates the observation, not the reward
        >>> vecnorm_v2_updates(env.transform)
        {'observation': 4, 'reward': 3}
    """
    _require_v2(transform)
    return {key: int(_v2_count(transform, key).item()) for key in transform._loc.keys(True, True)}


def _single_count(moments: Moments, key: NestedKey) -> float:
    """The one weight a transform that keeps a single count per key can store."""
    flat = moments.count.reshape(-1)
    if flat.numel() == 0 or not bool((flat == flat[0]).all()):
        raise ValidationError(f"{key!r}: the transform keeps one count per key, got counts {moments.count}")
    return float(flat[0])


def _check_shape(moments: Moments, target: torch.Tensor, key: NestedKey) -> None:
    for name in ("mean", "m2"):
        shape = getattr(moments, name).shape
        try:
            fits = torch.broadcast_shapes(shape, target.shape) == target.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValidationError(f"{key!r}: {name} of shape {tuple(shape)} does not fit {tuple(target.shape)}")


def _v2_updates_for(weight: float, decay: float) -> int:
    """The whole number of updates whose weight is nearest ``weight`` (capped for ``decay < 1``)."""
    if decay == 1.0:
        return round(weight)
    most = math.ceil(math.log(2.0**-53) / math.log(decay))
    mass = (1.0 - decay) * weight
    if mass >= 1.0:
        return most
    return min(round(math.log1p(-mass) / math.log(decay)), most)


def load_vecnorm_v2_(transform: VecNormV2Like, moments: Mapping[NestedKey, Moments]) -> dict[NestedKey, Moments]:
    """Write ``moments`` into a ``VecNormV2``'s tensors in place (``copy_``; shared memory stays shared).

    Keys not in ``moments`` are left alone. The count is a whole number of updates, so the weight
    is rounded (and, with ``decay < 1``, capped at ``1 / (1 - decay)``); mean and variance are kept.

    Returns:
        The moments as stored, read back: the base for the next :func:`delta`.

    Examples:
        >>> import warnings; warnings.filterwarnings("ignore")
        >>> from torchrl.envs import GymEnv, TransformedEnv, VecNormV2
        >>> env = TransformedEnv(GymEnv("Pendulum-v1"), VecNormV2(in_keys=["observation"], decay=1.0))
        >>> _ = env.rollout(3)
        >>> merged = Moments(torch.tensor(10.0), torch.tensor([0.5, -0.5, 1.0]), torch.full((3,), 20.0))
        >>> stored = load_vecnorm_v2_(env.transform, {"observation": merged})["observation"]
        >>> stored.count.item(), env.transform._count["observation"].item(), stored.var.tolist()
        (10.0, 10, [2.0, 2.0, 2.0])
    """
    _require_v2(transform)
    decay = float(transform.decay)
    known = set(transform._loc.keys(True, True))
    for key, m in moments.items():
        if key not in known:
            raise ValidationError(f"{key!r} is not normalised by this VecNormV2 (it has {sorted(map(str, known))})")
        loc, second, count = transform._loc.get(key), transform._var.get(key), _v2_count(transform, key)
        _check_shape(m, loc, key)
        updates = _v2_updates_for(_single_count(m, key), decay)
        mass, _ = _v2_mass_weight(_f64(updates), decay)
        loc.copy_(m.mean * mass)
        second.copy_((m.var + m.mean**2) * mass)
        count.copy_(torch.as_tensor(updates))
    stored = vecnorm_v2_moments(transform)
    return {key: stored[key] for key in moments}


def _suffixed(key: NestedKey, suffix: str) -> NestedKey:
    if isinstance(key, str):
        return key + suffix
    return (*key[:-1], key[-1] + suffix)


def _v1_keys(transform: VecNormLike) -> list[NestedKey]:
    """The in_keys a ``VecNorm`` has statistics for (a key gets them when first seen)."""
    if transform._td is None:
        raise ValidationError("VecNorm has no statistics yet (never called)")
    present = set(transform._td.keys(True, True))
    keys = [k if isinstance(k, str) else tuple(k) for k in transform.in_keys]
    return [k for k in keys if _suffixed(k, "_sum") in present]


def vecnorm_moments(transform: VecNormLike) -> dict[NestedKey, Moments]:
    """The moments a ``VecNorm`` (v1) holds, one per normalised key it has seen.

    Examples:
        >>> import warnings; warnings.filterwarnings("ignore")
        >>> from torchrl.envs import GymEnv, TransformedEnv, VecNorm
        >>> env = TransformedEnv(GymEnv("Pendulum-v1"), VecNorm(in_keys=["observation"], decay=1.0))
        >>> _ = env.rollout(3)
        >>> vecnorm_moments(env.transform)["observation"].count.item()
        4.0
    """
    result: dict[NestedKey, Moments] = {}
    for key in _v1_keys(transform):
        total = _f64(transform._td.get(_suffixed(key, "_sum")))
        squares = _f64(transform._td.get(_suffixed(key, "_ssq")))
        weight = _f64(transform._td.get(_suffixed(key, "_count")))
        mean = _ratio(total, weight)
        result[key] = Moments(weight, mean, (squares - total * mean).clamp_min(0))
    return result


def load_vecnorm_(transform: VecNormLike, moments: Mapping[NestedKey, Moments]) -> dict[NestedKey, Moments]:
    """Write ``moments`` into a ``VecNorm``'s (v1) tensors in place (``copy_``); other keys stay.

    Returns:
        The moments as stored (float32), read back: the base for the next :func:`delta`.

    Examples:
        >>> import warnings; warnings.filterwarnings("ignore")
        >>> from torchrl.envs import GymEnv, TransformedEnv, VecNorm
        >>> env = TransformedEnv(GymEnv("Pendulum-v1"), VecNorm(in_keys=["observation"], decay=0.99))
        >>> _ = env.rollout(3)
        >>> merged = Moments(torch.tensor(2.5), torch.zeros(3), torch.full((3,), 5.0))
        >>> load_vecnorm_(env.transform, {"observation": merged})["observation"].var.tolist()
        [2.0, 2.0, 2.0]
    """
    present = _v1_keys(transform)
    for key, m in moments.items():
        if key not in present:
            raise ValidationError(f"{key!r} has no statistics in this VecNorm (it has {present})")
        total = transform._td.get(_suffixed(key, "_sum"))
        _check_shape(m, total, key)
        weight = _single_count(m, key)
        total.copy_(m.mean * weight)
        transform._td.get(_suffixed(key, "_ssq")).copy_(m.m2 + weight * m.mean**2)
        transform._td.get(_suffixed(key, "_count")).fill_(weight)
    stored = vecnorm_moments(transform)
    return {key: stored[key] for key in moments}


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
    updates = _v2_updates_for(float(merged.count.reshape(-1)[0]), decay)
    _, weight = _v2_mass_weight(_f64(updates), decay)
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
