"""Environments that ship with envsync, for the demo, the examples and the tests.

``DriftEnv`` is a one-dimensional balance task: the agent keeps a point near 0 while a drift
pushes it away. Its *difficulty* scales the drift, and the observation carries the
difficulty itself, so every frame proves which config produced it.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

ENV_ID = "envsync/Drift-v0"
MAX_EPISODE_STEPS = 50


@contextmanager
def start_method(method: str) -> Iterator[None]:
    """Build collectors under ``method`` (``"spawn"`` or ``"fork"``; torchrl reads the global
    multiprocessing start method when it starts workers), then restore the previous one."""
    previous = mp.get_start_method(allow_none=True)
    mp.set_start_method(method, force=True)
    try:
        yield
    finally:
        mp.set_start_method(previous or "spawn", force=True)


class DriftEnv(gym.Env[np.ndarray, np.ndarray]):
    """Keep ``x`` near 0 against a drift of strength ``difficulty``.

    Observation ``[x, difficulty]``; action in ``[-1, 1]``; reward ``1 - |x|``; the episode
    terminates when ``|x| > 1`` (and is truncated after ``MAX_EPISODE_STEPS`` steps when made
    through ``gymnasium.make``).

    Examples:
        >>> env = DriftEnv(difficulty=0.3)
        >>> obs, _ = env.reset(seed=0)
        >>> float(obs[1])
        0.30000001192092896
        >>> env.set_difficulty(0.7)
        >>> float(env.step(np.zeros(1, dtype=np.float32))[0][1])
        0.699999988079071
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, difficulty: float = 0.0) -> None:
        self.observation_space = spaces.Box(-np.inf, np.inf, shape=(2,), dtype=np.float32)
        self.action_space = spaces.Box(-1.0, 1.0, shape=(1,), dtype=np.float32)
        self.difficulty = float(difficulty)
        self._x = 0.0

    def set_difficulty(self, difficulty: float) -> None:
        """Change the drift strength; takes effect at the next step."""
        self.difficulty = float(difficulty)

    def _obs(self) -> np.ndarray:
        return np.array([self._x, self.difficulty], dtype=np.float32)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._x = float(self.np_random.uniform(-0.1, 0.1))
        return self._obs(), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        push = float(np.clip(np.asarray(action, dtype=np.float32).reshape(-1)[0], -1.0, 1.0))
        drift = self.difficulty * (0.05 + 0.05 * float(self.np_random.standard_normal()))
        self._x += 0.1 * push + drift
        terminated = abs(self._x) > 1.0
        return self._obs(), 1.0 - min(abs(self._x), 1.0), terminated, False, {}


if ENV_ID not in gym.registry:
    gym.register(id=ENV_ID, entry_point="envsync.envs:DriftEnv", max_episode_steps=MAX_EPISODE_STEPS)


def make_drift_env(difficulty: float = 0.0) -> Any:
    """A torchrl ``GymEnv`` of :class:`DriftEnv` (importable, so spawn workers can build it)."""
    from torchrl.envs import GymEnv

    return GymEnv(ENV_ID, difficulty=difficulty)
