"""envsync's reinit handlers for torchrl's stateful transforms. They reach into the
transforms' private fields, so they live with the integration; importing this module
registers them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchrl.envs.transforms import CatFrames, ObservationNorm, RewardSum, VecNorm, VecNormV2

from envsync import stats
from envsync.reinit import register

_CONSTANT = 1e-6
"""Below this standard deviation a feature counts as constant for ``recompute``."""


class ObservationNormHandler:
    """``reset``: back to the loc/scale the env was built with; ``recompute``: re-run the
    statistics although they are initialised, keeping the tensors' storage (features that do
    not vary in the gathered data get scale 1: they are only centred)."""

    def __init__(self) -> None:
        self._initial: tuple[torch.Tensor, torch.Tensor] | None = None

    def bind(self, transform: ObservationNorm) -> ObservationNormHandler:
        """A handler for ``transform`` that remembers its loc/scale as built."""
        bound = ObservationNormHandler()
        if not isinstance(transform.loc, nn.UninitializedBuffer):
            bound._initial = (transform.loc.detach().clone(), transform.scale.detach().clone())
        return bound

    def reset(self, transform: ObservationNorm) -> None:
        if self._initial is None:
            raise RuntimeError("ObservationNorm had no loc/scale when envsync bound it: nothing to reset to")
        loc, scale = self._initial
        transform.loc.copy_(loc)
        transform.scale.copy_(scale)

    def recompute(self, transform: ObservationNorm, num_iter: int) -> None:
        key = transform.in_keys[0]
        parent = transform.parent
        if parent is None:
            raise RuntimeError("ObservationNorm has no parent env to gather statistics from")
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
        if isinstance(transform, VecNormV2):
            for stats in (transform._loc, transform._var, transform._count):
                if stats is not None:
                    stats.zero_()
        elif isinstance(transform, VecNorm):
            if transform._td is not None:
                transform._td.zero_()
        else:
            for buffer in transform.buffers():
                if not isinstance(buffer, nn.UninitializedBuffer):
                    buffer.zero_()


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


class NormStatsHandler(ZeroStatsHandler):
    """``reset`` (zeros) plus ``export``/``load`` of running statistics as moments (count,
    mean, m2 per normalised key, float64), for ``sync_stats`` (see ``envsync.stats``)."""

    def export(self, transform: Any) -> dict[str, torch.Tensor]:
        if isinstance(transform, VecNormV2):
            out = _flat_moments(stats.vecnorm_v2_moments(transform))
            for key, updates in stats.vecnorm_v2_updates(transform).items():  # decay ages by these
                name = "-".join(key) if isinstance(key, tuple) else key
                out[f"{name}.updates"] = torch.tensor(float(updates), dtype=torch.float64)
            return out
        return _flat_moments(stats.vecnorm_moments(transform))

    def decay(self, transform: Any) -> float:
        """The transform's forgetting factor (1: none); ``sync_stats`` ages by it."""
        return float(transform.decay)

    def load(self, transform: Any, values: dict[str, torch.Tensor]) -> None:
        if isinstance(transform, VecNormV2):
            stats.load_vecnorm_v2_(transform, _moments(values, list(stats.vecnorm_v2_moments(transform))))
        else:
            stats.load_vecnorm_(transform, _moments(values, list(stats.vecnorm_moments(transform))))


class EpisodicHandler:
    """``reset`` for transforms whose state restarts with every episode (RewardSum)."""

    def reset(self, transform: Any) -> None:
        return None


register(ObservationNorm, ObservationNormHandler())
register(VecNorm, NormStatsHandler())
register(VecNormV2, NormStatsHandler())
register(CatFrames, ZeroStatsHandler())
register(RewardSum, EpisodicHandler())
