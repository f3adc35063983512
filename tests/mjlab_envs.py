"""mjlab's Cartpole as torchrl builds it from its task id (``MJLabEnv``), on Warp's CPU device,
made to show its physics: every observation carries, read from the simulator when it is
produced, the pole's mass, the cart's subtree mass (cart + pole, a constant MuJoCo derives:
right per world only if ``finish=`` recomputed it per world) and the pole's angle. A pole that
tilts past ``FALL`` radians ends the episode, so worlds reset at different steps (partial
resets); so does mjlab's time-out after ``EPISODE_STEPS`` steps."""

from __future__ import annotations

from typing import Any

import torch

TASK = "Mjlab-Cartpole-Balance"
CART, POLE = 3, 4  # body indices: world, terrain, mocap_base, cart, pole_1
FALL = 0.2
EPISODE_S = 1.0
EPISODE_STEPS = 20  # of 0.05 s each: mjlab's time-out


def pole_physics(env: Any) -> torch.Tensor:
    """``[pole mass, cart subtree mass]`` per world, read from the model."""
    model = env.sim.model
    return torch.stack([model.body_mass[:, POLE], model.body_subtreemass[:, CART]], dim=-1)


def pole_angle(env: Any) -> torch.Tensor:
    """The pole's angle per world (radians; the episode ends past ``FALL``)."""
    return env.scene["cartpole"].data.joint_pos[:, 1:2]


def pole_fallen(env: Any, limit: float = FALL) -> torch.Tensor:
    return env.scene["cartpole"].data.joint_pos[:, 1].abs() > limit


def make_cartpole(num_envs: int = 8) -> Any:
    """An ``MJLabEnv`` of ``num_envs`` Cartpole worlds on the CPU, with a ``"physics"``
    observation (:func:`pole_physics`, then :func:`pole_angle`) and episodes that end when the
    pole falls."""
    import mjlab.tasks  # noqa: F401  (registers the tasks)
    import warp as wp
    from mjlab.managers.observation_manager import ObservationGroupCfg, ObservationTermCfg
    from mjlab.managers.termination_manager import TerminationTermCfg
    from mjlab.tasks.registry import load_env_cfg
    from torchrl.envs import MJLabEnv

    wp.config.log_level = wp.LOG_WARNING  # no line per Warp module loaded (warp 1.19 ignores config.quiet)
    cfg = load_env_cfg(TASK)
    cfg.observations["physics"] = ObservationGroupCfg(
        {"masses": ObservationTermCfg(func=pole_physics), "angle": ObservationTermCfg(func=pole_angle)},
        enable_corruption=False,
    )
    cfg.terminations["fallen"] = TerminationTermCfg(func=pole_fallen)
    cfg.episode_length_s = EPISODE_S
    return MJLabEnv(TASK, cfg=cfg, num_envs=num_envs, device="cpu")


def make_cartpoles_32() -> Any:
    return make_cartpole(32)


def make_cartpoles_64() -> Any:
    return make_cartpole(64)
