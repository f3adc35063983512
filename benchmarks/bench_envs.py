"""Envs and a transform used by the benchmarks (importable, so spawn workers can build them)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Bounded, Categorical, Composite, Unbounded
from torchrl.envs import Compose, EnvBase, Transform, TransformedEnv

from envsync.envs import MAX_EPISODE_STEPS, DriftEnv, make_drift_env


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

    def table_sum(self) -> float:
        """The sum of the config ``table`` the env was given last (see :func:`keep_table`)."""
        return float(self.table.sum())


def keep_table(env: Any, config: TensorDictBase) -> None:
    """A config method for :func:`make_buffer_env` that keeps the config's ``table`` (think a
    terrain height map the env samples from) on its :class:`BufferTransform`."""
    env.transform[0].table = config["table"]


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


class StampedDriftEnv(DriftEnv):
    """:class:`~envsync.envs.DriftEnv` that never terminates (every episode runs to its time
    limit, whatever the task, so every task resets at the same rate) and whose observation
    ``[x, difficulty, start]`` (float64) also shows when its episode began: ``start`` is
    ``time.monotonic()`` at its reset, one clock for every process of the machine.
    """

    def __init__(self, difficulty: float = 0.0) -> None:
        super().__init__(difficulty=difficulty)
        self.observation_space = spaces.Box(-np.inf, np.inf, shape=(3,), dtype=np.float64)
        self._start = 0.0

    def _obs(self) -> np.ndarray:
        return np.array([self._x, self.difficulty, self._start], dtype=np.float64)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        self._start = time.monotonic()
        return super().reset(seed=seed, options=options)

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        obs, reward, _, truncated, info = super().step(action)
        return obs, reward, False, truncated, info


def make_stamped_gym_env() -> gym.Env:
    """A :class:`StampedDriftEnv` with DriftEnv's time limit."""
    return gym.wrappers.TimeLimit(StampedDriftEnv(), MAX_EPISODE_STEPS)


def make_stamped_env() -> Any:
    """A torchrl ``GymWrapper`` of :func:`make_stamped_gym_env`."""
    from torchrl.envs import GymWrapper

    return GymWrapper(make_stamped_gym_env())


class DriftTasks(gym.Wrapper):
    """A gymnasium env's difficulty as a Syllabus task: the interface Syllabus's
    ``GymnasiumSyncWrapper`` calls (``reset(new_task=...)``, ``change_task``, ``task``), with
    task ``i`` meaning difficulty ``difficulties[i]``. ``info["task_completion"]`` is 1.0 at
    step ``complete_at`` of every episode (0: never): Syllabus then changes the task there,
    mid-episode, when its wrapper has ``change_task_on_completion=True``.
    """

    def __init__(self, env: gym.Env, difficulties: Sequence[float], complete_at: int = 0) -> None:
        super().__init__(env)
        self.difficulties = tuple(difficulties)
        self.complete_at = complete_at
        self.task = 0
        self.steps = 0

    def change_task(self, new_task: Any) -> None:
        self.task = int(new_task)
        self.env.unwrapped.set_difficulty(self.difficulties[self.task])  # type: ignore[attr-defined]

    def reset(self, *, new_task: Any = None, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        if new_task is not None:
            self.change_task(new_task)
        self.steps = 0
        obs, info = self.env.reset(**kwargs)
        info["task_completion"] = 0.0
        return obs, info

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.steps += 1
        info["task_completion"] = 1.0 if self.steps == self.complete_at else 0.0
        return obs, reward, terminated, truncated, info


class BigPolicy(torch.nn.Module):
    """A policy for the demo env whose weights hold ``numel`` float32 elements (a table it
    never reads): what torchrl's ``update_policy_weights_`` moves, the same bytes as a push."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.head = torch.nn.Linear(1, 1)
        self.table = torch.nn.Parameter(torch.zeros(numel), requires_grad=False)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.head(observation[..., :1]))


class WorldsEnv(EnvBase):
    """A natively batched env of ``n`` worlds (``batch_size=[n]``), as cheap as a vectorised
    step gets: world ``i`` observes ``difficulty_i + noise`` and is rewarded ``-|obs|``; its
    episodes run ``50 + i % 17`` steps, so worlds reset at different steps (partial resets,
    honouring the ``"_reset"`` mask). ``set_difficulty(difficulty, env_ids)`` is one indexed
    write, the way a GPU simulator takes per-world parameters."""

    def __init__(self, n: int = 1024, horizon: int = 50) -> None:
        super().__init__(batch_size=torch.Size([n]))
        self.difficulty = torch.zeros(n)
        self.steps = torch.zeros(n, dtype=torch.int64)
        self.horizons = horizon + torch.arange(n) % 17
        self.observation_spec = Composite(observation=Unbounded((n, 1)), shape=(n,))
        self.action_spec = Bounded(-1.0, 1.0, (n, 1))
        self.reward_spec = Unbounded((n, 1))
        flag = Categorical(2, (n, 1), dtype=torch.bool)
        self.done_spec = Composite(done=flag, terminated=flag.clone(), truncated=flag.clone(), shape=(n,))

    def set_difficulty(self, difficulty: torch.Tensor, env_ids: torch.Tensor) -> None:
        self.difficulty[env_ids] = difficulty

    def _observation(self) -> torch.Tensor:
        return (self.difficulty + 0.1 * torch.randn(self.difficulty.shape)).unsqueeze(-1)

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDict:
        mask = None if tensordict is None else tensordict.get("_reset", None)
        if mask is None:
            self.steps.zero_()
        else:
            self.steps[mask.reshape(-1)] = 0
        false = torch.zeros(*self.batch_size, 1, dtype=torch.bool)
        return TensorDict(
            observation=self._observation(),
            done=false,
            terminated=false.clone(),
            truncated=false.clone(),
            batch_size=self.batch_size,
        )

    def _step(self, tensordict: TensorDictBase) -> TensorDict:
        self.steps += 1
        observation = self._observation()
        truncated = (self.steps >= self.horizons).unsqueeze(-1)
        return TensorDict(
            observation=observation,
            reward=-observation.abs(),
            done=truncated.clone(),
            terminated=torch.zeros_like(truncated),
            truncated=truncated,
            batch_size=self.batch_size,
        )

    def _set_seed(self, seed: int | None) -> None:
        return None


def make_worlds_env(n: int = 1024) -> WorldsEnv:
    return WorldsEnv(n)


def make_mjlab_cartpole(n: int = 64) -> Any:
    """mjlab's ``Mjlab-Cartpole-Balance`` of ``n`` worlds through torchrl's ``MJLabEnv``, on
    Warp's CPU device (needs the mjlab venv; see docs/notes-mjlab.md)."""
    import mjlab.tasks  # noqa: F401  (registers the tasks)
    import warp as wp
    from torchrl.envs import MJLabEnv

    wp.config.log_level = wp.LOG_WARNING  # no line per Warp module loaded
    return MJLabEnv("Mjlab-Cartpole-Balance", num_envs=n, device="cpu")


def make_playground_cartpole(n: int = 64) -> Any:
    """MuJoCo Playground's ``CartpoleBalance`` of ``n`` worlds as envsync's ``PlaygroundWorlds``
    (MJX's JAX backend on the CPU; needs the playground venv)."""
    from envsync.integrations.torchrl.playground import PlaygroundWorlds

    return PlaygroundWorlds.from_name("CartpoleBalance", n, device="cpu")
