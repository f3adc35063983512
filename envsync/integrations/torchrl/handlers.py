"""envsync's reinit handlers for torchrl's stateful transforms; importing this module
registers them (:func:`envsync.reinit.register`).

The normalisers' statistics are read and written by :mod:`.vecnorm`. One reach into torchrl's
private members is left here: ``recompute`` feeds a normaliser fresh data through
``Transform._reset`` and ``Transform._step``, the hooks its ``TransformedEnv`` calls on a reset
and a step. torchrl has no public way to update a transform as its env would: ``forward`` is
``_call`` (``VecNormV2`` updates in ``_step``, and neither sees the reset), and rolling out the
transformed env would also run every transform above it and step envsync's own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchrl.envs.transforms import CatFrames, ObservationNorm, RewardSum, VecNorm, VecNormV2

from envsync import stats
from envsync.errors import EnvSyncError
from envsync.integrations.torchrl import vecnorm
from envsync.reinit import register

_CONSTANT = 1e-6
"""Below this standard deviation a feature counts as constant for ``recompute``."""


class ObservationNormHandler:
    """``reset``: back to the loc/scale the env was built with; ``recompute``: re-run the
    statistics although they are initialised, keeping the tensors' storage (features that do
    not vary in the gathered data get scale 1: they are only centred).

    Args:
        initial: the loc and scale to reset to (:meth:`bind` reads them from a transform).
    """

    def __init__(self, initial: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self._initial = initial

    def bind(self, transform: ObservationNorm) -> ObservationNormHandler:
        """A handler for ``transform`` that remembers its loc/scale as built."""
        if isinstance(transform.loc, nn.UninitializedBuffer):
            return ObservationNormHandler()
        return ObservationNormHandler((transform.loc.detach().clone(), transform.scale.detach().clone()))

    def reset(self, transform: ObservationNorm) -> None:
        if self._initial is None:
            raise EnvSyncError("ObservationNorm had no loc/scale when envsync bound it: nothing to reset to")
        loc, scale = self._initial
        transform.loc.copy_(loc)
        transform.scale.copy_(scale)

    def recompute(self, transform: ObservationNorm, num_iter: int) -> None:
        key = transform.in_keys[0]
        parent = transform.parent
        if parent is None:
            raise EnvSyncError("ObservationNorm has no parent env to gather statistics from")
        data, frames = [], 0
        while frames < num_iter:
            rollout = parent.rollout(max_steps=num_iter)
            frames += rollout.numel()
            data.append(rollout.get(key))
        samples = torch.cat([d.reshape(-1, *d.shape[rollout.ndim :]) for d in data])
        shape = samples.shape[1:] if isinstance(transform.loc, nn.UninitializedBuffer) else transform.loc.shape
        samples = samples.reshape(-1, *shape)
        loc, std = samples.mean(0), samples.std(0)
        # a feature that does not vary under the new config (a config value shown in the
        # observation, say) is only centred: dividing by eps would turn rounding into noise
        scale = torch.where(std > _CONSTANT, std, torch.ones_like(std))
        if not transform.standard_normal:
            scale = 1 / scale
            loc = -loc * scale
        for buffer, value in ((transform.loc, loc), (transform.scale, scale)):
            if isinstance(buffer, nn.UninitializedBuffer):
                buffer.materialize(shape=value.shape, dtype=value.dtype)
            buffer.copy_(value)


class ZeroStatsHandler:
    """``reset`` for transforms whose initial statistics are zeros (VecNorm, VecNormV2,
    CatFrames): zero them in place, so shared statistics stay shared."""

    def reset(self, transform: Any) -> None:
        if isinstance(transform, VecNorm | VecNormV2):
            vecnorm.zero_(transform)
        else:
            for buffer in transform.buffers():
                if not isinstance(buffer, nn.UninitializedBuffer):
                    buffer.zero_()


def _name(key: Any) -> str:
    return "-".join(key) if isinstance(key, tuple) else key


def _flat_moments(moments: dict[Any, stats.Moments]) -> dict[str, torch.Tensor]:
    out = {}
    for key, m in moments.items():
        name = "-".join(key) if isinstance(key, tuple) else key
        out.update({f"{name}.count": m.count, f"{name}.mean": m.mean, f"{name}.m2": m.m2})
    return out


def _moments(values: dict[str, torch.Tensor], keys: list[Any]) -> dict[Any, stats.Moments]:
    out = {}
    for key in keys:
        name = "-".join(key) if isinstance(key, tuple) else key
        out[key] = stats.Moments(values[f"{name}.count"], values[f"{name}.mean"], values[f"{name}.m2"])
    return out


def _v1_decay(transform: VecNorm) -> float:
    """The decay a ``VecNorm`` applies to its float32 counts (``count *= decay`` multiplies by
    ``float32(decay)``: 0.99999 is 0.9999899864 there)."""
    return float(torch.tensor(float(transform.decay), dtype=torch.float32))


def _v1_limits(transform: VecNorm) -> dict[str, torch.Tensor]:
    """``<key>.limit`` per key: the weight ``N / (1 - d)`` a ``VecNorm``'s count tends to, ``N``
    the values per update (the numel of its env's batch; see ``envsync.stats``)."""
    env = transform.container
    elements = max(1, env.batch_size.numel()) if env is not None else 1
    limit = elements / (1.0 - _v1_decay(transform))
    keys = vecnorm.vecnorm_moments(transform)
    return {f"{_name(key)}.{stats.LIMIT}": torch.tensor(limit, dtype=torch.float64) for key in keys}


def _replay(transform: Any, rollout: Any) -> None:
    """Feed a rollout's observations to ``transform`` as its env would: the reset, then each step."""
    first = rollout[..., 0].exclude("next")
    transform._reset(first, first.clone())
    for t in range(rollout.shape[-1]):
        step = rollout[..., t]
        transform._step(step.exclude("next"), step.get("next").clone())


class NormStatsHandler(ZeroStatsHandler):
    """``reset`` (zeros), ``recompute`` (zeros, then fresh observations), and
    ``export``/``load`` of running statistics as moments (count, mean, m2 per normalised key,
    float64), for ``sync_stats`` (see ``envsync.stats``)."""

    def recompute(self, transform: Any, num_iter: int) -> None:
        """Statistics of fresh observations only: zeros, then ``num_iter`` steps of random
        actions on the env below the transform (under the config just applied), fed to the
        transform the way its env would feed them (each rollout's reset, then every step)."""
        parent = transform.parent
        if parent is None:
            raise EnvSyncError(f"{type(transform).__name__} has no parent env to gather statistics from")
        frozen, transform.frozen = transform.frozen, False  # asked to recompute: it must update
        try:
            self.reset(transform)
            frames = 0
            while frames < num_iter:
                rollout = parent.rollout(max_steps=num_iter)
                frames += rollout.numel()
                _replay(transform, rollout)
        finally:
            transform.frozen = frozen

    def export(self, transform: Any) -> dict[str, torch.Tensor]:
        if isinstance(transform, VecNormV2):
            out = _flat_moments(vecnorm.vecnorm_v2_moments(transform))
            for key, updates in vecnorm.vecnorm_v2_updates(transform).items():  # decay ages by these
                name = "-".join(key) if isinstance(key, tuple) else key
                out[f"{name}.updates"] = torch.tensor(float(updates), dtype=torch.float64)
            return out
        out = _flat_moments(vecnorm.vecnorm_moments(transform))
        if _v1_decay(transform) < 1.0:  # its counts tell its updates, given their limit
            out.update(_v1_limits(transform))
        return out

    def decay(self, transform: Any) -> float:
        """The forgetting factor the transform applies (1: none); ``sync_stats`` ages by it."""
        return _v1_decay(transform) if isinstance(transform, VecNorm) else float(transform.decay)

    def load(self, transform: Any, values: dict[str, torch.Tensor]) -> None:
        if isinstance(transform, VecNormV2):
            vecnorm.load_vecnorm_v2_(transform, _moments(values, list(vecnorm.vecnorm_v2_moments(transform))))
        else:
            vecnorm.load_vecnorm_(transform, _moments(values, list(vecnorm.vecnorm_moments(transform))))


class EpisodicHandler:
    """``reset`` for transforms whose state restarts with every episode (RewardSum)."""

    def reset(self, transform: Any) -> None:
        return None


register(ObservationNorm, ObservationNormHandler())
register(VecNorm, NormStatsHandler())
register(VecNormV2, NormStatsHandler())
register(CatFrames, ZeroStatsHandler())
register(RewardSum, EpisodicHandler())
