"""Pendulum-v1 for the apply tests: the env, and its gravity read back from the frames.

gymnasium's pendulum steps ``thdot' = clip(thdot + (3 g / (2 l) sin(th) + 3 u / (m l^2)) dt,
±max_speed)`` with ``u = clip(action, ±max_torque)``, ``l = m = 1`` and ``dt = 0.05``; the
observation is ``[cos th, sin th, thdot]`` before the step. Over the unclipped steps of a
group of frames, a least-squares fit of ``(thdot' - thdot) / dt - 3 u`` on ``sin th`` gives
``3 g / 2``: the gravity those frames ran under, whatever the tags say.
"""

from __future__ import annotations

from tensordict import TensorDictBase
from torchrl.envs import GymEnv, ParallelEnv

DT, MAX_TORQUE, MAX_SPEED = 0.05, 2.0, 8.0
EPISODE_STEPS = 16  # short episodes: "reset" mode switches within a batch


def make_pendulum() -> GymEnv:
    return GymEnv("Pendulum-v1", max_episode_steps=EPISODE_STEPS)


def make_parallel_pendulums() -> ParallelEnv:
    return ParallelEnv(2, make_pendulum)


def measured_g(frames: TensorDictBase, min_frames: int = 8) -> float | None:
    """The gravity the steps in ``frames`` ran under (``None``: too few unclipped steps)."""
    frames = frames.reshape(-1)
    thdot = frames["observation"][:, 2].double()
    next_thdot = frames["next", "observation"][:, 2].double()
    free = next_thdot.abs() < MAX_SPEED - 1e-3
    if int(free.sum()) < min_frames:
        return None
    sin_th = frames["observation"][:, 1].double()[free]
    torque = frames["action"][:, 0].double().clamp(-MAX_TORQUE, MAX_TORQUE)[free]
    rhs = (next_thdot[free] - thdot[free]) / DT - 3 * torque
    a = float((sin_th * rhs).sum() / (sin_th * sin_th).sum())
    return 2 * a / 3


def g_by_version(batch: TensorDictBase) -> dict[int, float | None]:
    """The measured gravity of each version's steps in a batch (by ``("next", "env_version")``)."""
    frames = batch.reshape(-1)
    tags = frames["next", "env_version"].reshape(-1)
    return {int(v): measured_g(frames[tags == v]) for v in tags.unique().tolist()}
