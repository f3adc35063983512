"""Syllabus's side of ``bench_curriculum.py``: a gymnasium ``AsyncVectorEnv`` whose envs take
their tasks from one ``make_multiprocessing_curriculum`` through ``GymnasiumSyncWrapper``, and
the task Syllabus credited each finished episode to.

Syllabus (``syllabus-rl``) is imported only when a run is built: without it, the benchmark
measures envsync alone.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import numpy as np
from bench_envs import DriftTasks, make_stamped_gym_env
from bench_tasks import DIFFICULTIES, HALVES, Decision, Ran, Tally, cpu_seconds


def syllabus_missing() -> bool:
    return importlib.util.find_spec("syllabus") is None


class SyllabusRun:
    """A gymnasium ``AsyncVectorEnv`` of ``n`` envs: plain (``prefetch=0``) or each env in a
    ``GymnasiumSyncWrapper`` holding ``prefetch`` tasks, fed by one multiprocessing curriculum."""

    def __init__(self, n: int, prefetch: int, window_frames: int, complete_at: int = 0) -> None:
        from gymnasium.vector import AsyncVectorEnv

        self.n, self.window_frames, self.tally = n, window_frames, Tally()
        self.curriculum, self.credits = (None, None) if prefetch == 0 else _syllabus_curriculum()
        components = None if self.curriculum is None else self.curriculum.components
        make = _syllabus_env_fn(components, prefetch, complete_at)
        self.envs = AsyncVectorEnv([make] * n, context="fork")
        self.ids = list(self.envs.get_attr("instance_id")) if components is not None else list(range(n))
        obs, _ = self.envs.reset(seed=0)
        self.observations, self.done = [obs], [np.zeros(n, dtype=bool)]
        self.action = np.zeros((n, 1), dtype=np.float32)

    def steps(self, count: int) -> None:
        for _ in range(count):
            obs, _, terminated, truncated, _ = self.envs.step(self.action)
            self.observations.append(obs)
            self.done.append(terminated | truncated)

    def window(self, decide: tuple[float, ...] | None) -> None:
        """Time ``window_frames`` frames (the workers' CPU and this process's), a decision in the middle."""
        steps = max(self.window_frames // self.n, 2)
        pids = [process.pid for process in self.envs.processes]
        start, cpu = time.perf_counter(), cpu_seconds(pids)
        self.steps(steps // 2)
        if decide is not None and self.curriculum is not None:
            begin = time.monotonic()
            self.curriculum.unwrapped.active = [DIFFICULTIES.index(d) for d in decide]
            self.tally.decisions.append(Decision(begin, time.monotonic(), decide))
        self.steps(steps - steps // 2)
        self.tally.window(steps * self.n, time.perf_counter() - start, cpu_seconds(pids) - cpu)

    def settle(self) -> list[Ran]:
        """The finished episodes as they ran, each with the task Syllabus credited it to
        (matched per env in order; unmatched ones are left out)."""
        if self.credits is None:
            return []
        time.sleep(0.2)  # Syllabus's update thread polls its queue every 10 ms
        obs, done = np.stack(self.observations), np.stack(self.done)
        credits: dict[int, list[tuple[int, int]]] = {}
        for env_id, task, length in list(self.credits):
            credits.setdefault(env_id, []).append((task, length))
        out = []
        for i, env_id in enumerate(self.ids):
            resets = [0] + [s + 1 for s in np.flatnonzero(done[:-1, i])]
            for k, (first, after) in enumerate(zip(resets, resets[1:], strict=False)):
                if k >= len(credits.get(env_id, [])):
                    break
                task, length = credits[env_id][k]
                shown = np.round(obs[first + 1 : after, i, 1], 6)
                if length != len(shown):
                    continue
                credited = DIFFICULTIES[task]
                right = int((shown == credited).sum())
                out.append(
                    Ran(
                        float(obs[first, i, 2]),
                        *map(float, (shown[0], shown.min(), shown.max())),
                        credited,
                        length,
                        right,
                    )
                )
        self.tally.ran = out
        return out

    def close(self) -> None:
        self.envs.close()
        if self.curriculum is not None:
            self.curriculum.stop()


def _syllabus_curriculum() -> tuple[Any, list[tuple[int, int, int]]]:
    """Syllabus's DomainRandomization over the ``active`` tasks, in its multiprocessing wrapper;
    and the list its episode updates are noted in (env id, credited task, length)."""
    from syllabus.core import make_multiprocessing_curriculum
    from syllabus.curricula import DomainRandomization as SyllabusDR
    from syllabus.task_space import DiscreteTaskSpace

    credits: list[tuple[int, int, int]] = []

    class Switching(SyllabusDR):  # type: ignore[misc]
        active = [DIFFICULTIES.index(d) for d in HALVES[0]]

        def _sample_distribution(self) -> list[float]:
            return [1.0 / len(self.active) if t in self.active else 0.0 for t in range(self.num_tasks)]

        def update_on_episode(
            self, episode_return: float, length: int, task: Any, progress: Any, env_id: int | None = None
        ) -> None:
            super().update_on_episode(episode_return, length, task, progress, env_id=env_id)
            credits.append((-1 if env_id is None else int(env_id), int(task), int(length)))

    return make_multiprocessing_curriculum(Switching(DiscreteTaskSpace(len(DIFFICULTIES)))), credits


def _syllabus_env_fn(components: Any, prefetch: int, complete_at: int) -> Any:
    def make() -> Any:
        env = DriftTasks(make_stamped_gym_env(), DIFFICULTIES, complete_at)
        if components is None:
            return env
        from syllabus.core import GymnasiumSyncWrapper
        from syllabus.task_space import DiscreteTaskSpace

        return GymnasiumSyncWrapper(
            env,
            DiscreteTaskSpace(len(DIFFICULTIES)),
            components,
            buffer_size=prefetch,
            change_task_on_completion=complete_at > 0,
        )

    return make
