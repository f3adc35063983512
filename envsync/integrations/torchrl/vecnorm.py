"""torchrl's normalisers as accumulators of :class:`envsync.stats.Moments`: read the running
statistics of a ``VecNorm`` (v1) or a ``VecNormV2`` as moments, and write moments back in place.

What the transforms hold, as verified against torchrl 0.14.1 (``x`` a value seen, ``a`` the
number of updates since it was seen, ``d`` the transform's ``decay``, ``c`` its number of updates):

* ``VecNormV2``: ``loc[k] = (1 - d) * Σ d**a x`` and ``var[k] = (1 - d) * Σ d**a x**2`` (a raw
  second moment, *not* a variance), ``count[k]`` the integer ``c`` (int64, one per key: a reset
  updates the observation but not the reward). With ``d == 1`` they are the plain mean, the
  mean of squares and the number of values. It is an accumulator that counts whole updates
  (``envsync.stats``): its weight is ``(1 - d**c) / (1 - d)`` (``c`` if ``d == 1``), and
  :func:`vecnorm_v2_moments` divides ``loc`` and ``var`` by the mass ``1 - d**c``.
* ``VecNorm`` (v1): ``<k>_sum = Σ d**a x`` and ``<k>_ssq = Σ d**a x**2`` (summed over the
  batch), ``<k>_count = Σ d**a N`` (float32, shape ``(1,)``; ``N`` the batch numel): an
  accumulator that decays its count (its handler exports the count's limit, ``envsync.stats.LIMIT``).

Both are read and written through ``get_extra_state()``, the public hook of their
``state_dict()``: it hands out the transform's own tensors (not copies), so ``copy_`` into
them writes in place and statistics in shared memory stay shared. ``load_state_dict`` cannot
write them: ``VecNormV2``'s re-points its statistics at the tensors given (no longer shared
with the other workers of a node), and both load whole transforms, where a merge writes some
keys. One private member is still read: ``VecNorm._td is None`` tells that a ``VecNorm`` has
no statistics yet; its public readers (``get_extra_state``, ``state_dict``) warn in that case
and ``loc``/``scale`` raise an ``AttributeError`` (``VecNormV2`` has the public ``initialized``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torchrl.envs import VecNorm, VecNormV2

from envsync.errors import ValidationError
from envsync.stats import Moments, decayed_mass, ratio, whole_updates

NestedKey = str | tuple[str, ...]
Statistics = dict[NestedKey, torch.Tensor]


def _leaves(transform: VecNorm | VecNormV2) -> Statistics:
    """The tensors of ``get_extra_state()`` (the transform's own) by nested key."""
    leaves: Statistics = {}
    for flat, value in transform.get_extra_state().items():
        key = tuple(flat.split(transform.SEP))
        leaves[key[0] if len(key) == 1 else key] = value
    return leaves


def _group(leaves: Statistics, name: str) -> Statistics:
    """The leaves under ``name``, by the rest of their key."""
    out: Statistics = {}
    for key, value in leaves.items():
        if isinstance(key, tuple) and key[0] == name:
            out[key[1] if len(key) == 2 else key[1:]] = value
    return out


def _has_statistics(transform: VecNorm | VecNormV2) -> bool:
    if isinstance(transform, VecNormV2):
        return bool(getattr(transform, "initialized", False))  # a stateless one has the plain False
    return transform._td is not None  # see the module docstring: no public reader stays quiet here


def _v2_statistics(transform: VecNormV2) -> tuple[Statistics, Statistics, Statistics]:
    """``loc``, ``var`` and ``count`` by normalised key: the transform's own tensors."""
    if not _has_statistics(transform):
        raise ValidationError(f"{type(transform).__name__} has no statistics yet (stateless, or never called)")
    leaves = _leaves(transform)
    loc, var = _group(leaves, "loc"), _group(leaves, "var")
    count = leaves.get("count")  # one count for every key, or one per key
    return loc, var, _group(leaves, "count") if count is None else dict.fromkeys(loc, count)


def vecnorm_v2_moments(transform: VecNormV2) -> dict[NestedKey, Moments]:
    """The moments a ``VecNormV2`` holds, one per normalised key.

    Examples:
        >>> import warnings; warnings.filterwarnings("ignore")
        >>> from torchrl.envs import GymEnv, TransformedEnv, VecNormV2
        >>> env = TransformedEnv(GymEnv("Pendulum-v1"), VecNormV2(in_keys=["observation"], decay=1.0))
        >>> _ = env.rollout(3)  # a reset and 3 steps: 4 observations
        >>> vecnorm_v2_moments(env.transform)["observation"].count.item()
        4.0
    """
    loc, second, count = _v2_statistics(transform)
    decay = float(transform.decay)
    result: dict[NestedKey, Moments] = {}
    for key in loc:
        mass, weight = decayed_mass(count[key].double(), decay)
        mean = ratio(loc[key].double(), mass)
        squares = ratio(second[key].double(), mass)
        result[key] = Moments(weight, mean, weight * (squares - mean**2).clamp_min(0))
    return result


def vecnorm_v2_updates(transform: VecNormV2) -> dict[NestedKey, int]:
    """How many updates a ``VecNormV2`` made per key: ``decay ** (now - then)`` ages a base.

    Examples:
        >>> import warnings; warnings.filterwarnings("ignore")
        >>> from torchrl.envs import GymEnv, TransformedEnv, VecNormV2
        >>> env = TransformedEnv(GymEnv("Pendulum-v1"), VecNormV2(in_keys=["observation", "reward"]))
        >>> _ = env.rollout(3)  # a reset updates the observation, not the reward
        >>> vecnorm_v2_updates(env.transform)
        {'observation': 4, 'reward': 3}
    """
    loc, _, count = _v2_statistics(transform)
    return {key: int(count[key].item()) for key in loc}


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


def load_vecnorm_v2_(transform: VecNormV2, moments: Mapping[NestedKey, Moments]) -> dict[NestedKey, Moments]:
    """Write ``moments`` into a ``VecNormV2``'s tensors in place (``copy_``; shared memory stays shared).

    Keys not in ``moments`` are left alone. The count is a whole number of updates, so the weight
    is rounded (and, with ``decay < 1``, capped at ``1 / (1 - decay)``); mean and variance are kept.

    Returns:
        The moments as stored, read back: the base for the next :func:`envsync.stats.delta`.

    Examples:
        >>> import warnings; warnings.filterwarnings("ignore")
        >>> from torchrl.envs import GymEnv, TransformedEnv, VecNormV2
        >>> env = TransformedEnv(GymEnv("Pendulum-v1"), VecNormV2(in_keys=["observation"], decay=1.0))
        >>> _ = env.rollout(3)
        >>> merged = Moments(torch.tensor(10.0), torch.tensor([0.5, -0.5, 1.0]), torch.full((3,), 20.0))
        >>> stored = load_vecnorm_v2_(env.transform, {"observation": merged})["observation"]
        >>> stored.count.item(), vecnorm_v2_updates(env.transform)["observation"], stored.var.tolist()
        (10.0, 10, [2.0, 2.0, 2.0])
    """
    locs, seconds, counts = _v2_statistics(transform)
    decay = float(transform.decay)
    for key, m in moments.items():
        if key not in locs:
            raise ValidationError(f"{key!r} is not normalised by this VecNormV2 (it has {sorted(map(str, locs))})")
        _check_shape(m, locs[key], key)
        updates = whole_updates(_single_count(m, key), decay)
        mass, _ = decayed_mass(torch.tensor(updates, dtype=torch.float64), decay)
        locs[key].copy_(m.mean * mass)
        seconds[key].copy_((m.var + m.mean**2) * mass)
        counts[key].copy_(torch.as_tensor(updates))
    stored = vecnorm_v2_moments(transform)
    return {key: stored[key] for key in moments}


def _v1_statistics(transform: VecNorm) -> Statistics:
    """``<key>_sum``, ``<key>_ssq`` and ``<key>_count``: the transform's own tensors."""
    if not _has_statistics(transform):
        raise ValidationError("VecNorm has no statistics yet (never called)")
    return _leaves(transform)


def _suffixed(key: NestedKey, suffix: str) -> NestedKey:
    if isinstance(key, str):
        return key + suffix
    return (*key[:-1], key[-1] + suffix)


def _v1_keys(transform: VecNorm, statistics: Statistics) -> list[NestedKey]:
    """The in_keys a ``VecNorm`` has statistics for (a key gets them when first seen)."""
    present = set(statistics)
    keys = [k if isinstance(k, str) else tuple(k) for k in transform.in_keys]
    return [k for k in keys if _suffixed(k, "_sum") in present]


def vecnorm_moments(transform: VecNorm) -> dict[NestedKey, Moments]:
    """The moments a ``VecNorm`` (v1) holds, one per normalised key it has seen.

    Examples:
        >>> import warnings; warnings.filterwarnings("ignore")
        >>> from torchrl.envs import GymEnv, TransformedEnv, VecNorm
        >>> env = TransformedEnv(GymEnv("Pendulum-v1"), VecNorm(in_keys=["observation"], decay=1.0))
        >>> _ = env.rollout(3)
        >>> vecnorm_moments(env.transform)["observation"].count.item()
        4.0
    """
    statistics = _v1_statistics(transform)
    result: dict[NestedKey, Moments] = {}
    for key in _v1_keys(transform, statistics):
        total = statistics[_suffixed(key, "_sum")].double()
        squares = statistics[_suffixed(key, "_ssq")].double()
        weight = statistics[_suffixed(key, "_count")].double()
        mean = ratio(total, weight)
        result[key] = Moments(weight, mean, (squares - total * mean).clamp_min(0))
    return result


def load_vecnorm_(transform: VecNorm, moments: Mapping[NestedKey, Moments]) -> dict[NestedKey, Moments]:
    """Write ``moments`` into a ``VecNorm``'s (v1) tensors in place (``copy_``); other keys stay.

    Returns:
        The moments as stored (float32), read back: the base for the next :func:`envsync.stats.delta`.

    Examples:
        >>> import warnings; warnings.filterwarnings("ignore")
        >>> from torchrl.envs import GymEnv, TransformedEnv, VecNorm
        >>> env = TransformedEnv(GymEnv("Pendulum-v1"), VecNorm(in_keys=["observation"], decay=0.99))
        >>> _ = env.rollout(3)
        >>> merged = Moments(torch.tensor(2.5), torch.zeros(3), torch.full((3,), 5.0))
        >>> load_vecnorm_(env.transform, {"observation": merged})["observation"].var.tolist()
        [2.0, 2.0, 2.0]
    """
    statistics = _v1_statistics(transform)
    present = _v1_keys(transform, statistics)
    for key, m in moments.items():
        if key not in present:
            raise ValidationError(f"{key!r} has no statistics in this VecNorm (it has {present})")
        total = statistics[_suffixed(key, "_sum")]
        _check_shape(m, total, key)
        weight = _single_count(m, key)
        total.copy_(m.mean * weight)
        statistics[_suffixed(key, "_ssq")].copy_(m.m2 + weight * m.mean**2)
        statistics[_suffixed(key, "_count")].fill_(weight)
    stored = vecnorm_moments(transform)
    return {key: stored[key] for key in moments}


def zero_(transform: VecNorm | VecNormV2) -> None:
    """Put a normaliser's running statistics back to zeros, in place (none yet: nothing to do).

    Examples:
        >>> import warnings; warnings.filterwarnings("ignore")
        >>> from torchrl.envs import GymEnv, TransformedEnv, VecNormV2
        >>> env = TransformedEnv(GymEnv("Pendulum-v1"), VecNormV2(in_keys=["observation"]))
        >>> _ = env.rollout(3)
        >>> zero_(env.transform)
        >>> vecnorm_v2_updates(env.transform)
        {'observation': 0}
    """
    if _has_statistics(transform):
        for value in _leaves(transform).values():
            value.zero_()
