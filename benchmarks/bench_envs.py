"""Envs and a transform used by the benchmarks (importable, so spawn workers can build them)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Bounded, Categorical, Composite, Unbounded
from torchrl.envs import Compose, EnvBase, Transform, TransformedEnv

from envsync.envs import DriftEnv, make_drift_env


class BusyDriftEnv(DriftEnv):
    """:class:`~envsync.envs.DriftEnv` whose step busy-waits ``step_us`` microseconds (a costly simulator)."""

    def __init__(self, difficulty: float = 0.0, step_us: float = 300.0) -> None:
        super().__init__(difficulty=difficulty)
        self.step_s = step_us * 1e-6

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        end = time.perf_counter() + self.step_s
        while time.perf_counter() < end:
            pass
        return super().step(action)


def make_busy_env(step_us: float = 300.0) -> Any:
    """A torchrl ``GymWrapper`` of :class:`BusyDriftEnv`."""
    from torchrl.envs import GymWrapper

    return GymWrapper(BusyDriftEnv(step_us=step_us))


class BufferTransform(Transform):
    """A stateful transform that only holds a float32 buffer ``buf`` of ``numel`` elements
    (think ``ObservationNorm`` statistics of a large observation)."""

    def __init__(self, numel: int) -> None:
        super().__init__(in_keys=[], out_keys=[])
        self.register_buffer("buf", torch.zeros(numel, dtype=torch.float32))

    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        return next_tensordict

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        return tensordict_reset

    def set_buf(self, value: torch.Tensor) -> None:
        """Copy ``value`` into the buffer (what a ``map_fn`` call would do)."""
        self.buf.copy_(value)


def apply_difficulty(env: Any, config: TensorDictBase) -> None:
    """A config method for :func:`make_buffer_env` that takes ``difficulty`` and ignores the
    rest (a ``"table"`` that only travels)."""
    env.base_env._env.unwrapped.set_difficulty(float(config["difficulty"]))


def make_buffer_env(numel: int) -> Any:
    """The demo env with a :class:`BufferTransform` of ``numel`` elements as ``transforms.0``."""
    return TransformedEnv(make_drift_env(), Compose(BufferTransform(numel)))


class TickEnv(EnvBase):
    """A torchrl-native env whose observation is ``[difficulty, label, tick]``.

    ``tick`` counts every step the env has ever taken (resets do not restart it), so a gap
    between two batches of one worker tells how many frames were thrown away.
    """

    def __init__(self, label: int = 0) -> None:
        super().__init__(batch_size=torch.Size([]))
        self.label = float(label)
        self.difficulty = 0.0
        self.tick = 0
        self.observation_spec = Composite(observation=Unbounded((3,), dtype=torch.float64))
        self.action_spec = Bounded(-1.0, 1.0, (1,))
        self.reward_spec = Unbounded((1,))
        self.done_spec = Composite(
            done=Categorical(2, (1,), dtype=torch.bool),
            terminated=Categorical(2, (1,), dtype=torch.bool),
            truncated=Categorical(2, (1,), dtype=torch.bool),
        )

    def set_difficulty(self, difficulty: float) -> None:
        self.difficulty = float(difficulty)

    def _obs(self) -> torch.Tensor:
        return torch.tensor([self.difficulty, self.label, float(self.tick)], dtype=torch.float64)

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDict:
        false = torch.zeros(1, dtype=torch.bool)
        return TensorDict(observation=self._obs(), done=false, terminated=false.clone(), truncated=false.clone())

    def _step(self, tensordict: TensorDictBase) -> TensorDict:
        self.tick += 1
        false = torch.zeros(1, dtype=torch.bool)
        return TensorDict(
            observation=self._obs(), reward=torch.ones(1), done=false, terminated=false.clone(), truncated=false.clone()
        )

    def _set_seed(self, seed: int | None) -> None:
        return None


def make_tick_env(label: int = 0) -> TickEnv:
    return TickEnv(label=label)


class WideNoiseEnv(EnvBase):
    """A never-ending env whose observation is ``numel`` float32 standard normals."""

    def __init__(self, numel: int) -> None:
        super().__init__(batch_size=torch.Size([]))
        self.numel = numel
        self.observation_spec = Composite(observation=Unbounded((numel,), dtype=torch.float32))
        self.action_spec = Bounded(-1.0, 1.0, (1,))
        self.reward_spec = Unbounded((1,))

    def _obs(self) -> TensorDictBase:
        false = torch.zeros(1, dtype=torch.bool)
        return TensorDict(observation=torch.randn(self.numel), done=false, terminated=false.clone())

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDictBase:
        return self._obs()

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        out = self._obs()
        out["reward"] = torch.ones(1)
        return out

    def _set_seed(self, seed: int | None) -> None:
        return None


def make_vecnorm_env(numel: int) -> Any:
    """:class:`WideNoiseEnv` normalised by a ``VecNormV2`` (decay 1: statistics never forget)."""
    from torchrl.envs import VecNormV2

    return TransformedEnv(WideNoiseEnv(numel), Compose(VecNormV2(in_keys=["observation"], decay=1.0)))
