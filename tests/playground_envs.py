"""MuJoCo Playground's ``CartpoleBalance`` (MJX, JAX on the CPU) as :class:`PlaygroundWorlds`,
made to show its physics: every observation carries a ``"physics"`` entry computed by the step
(or reset) that produced it, from the model that world ran:

0. the hinge's diagonal of the joint-space inertia matrix ``M`` (the pole's inertia about its
   hinge), which the step's composite-rigid-body pass computes from the pole's mass and inertia;
1. the slider's diagonal of ``M`` (cart + pole mass), computed by the same pass;
2. the cart's subtree mass, a constant MuJoCo derives from the masses (right per world only
   if ``mj_setConst`` ran for that world);
3. the slider's ``dof_invweight0`` (another derived constant: ``1 / (cart + pole mass)`` at
   ``qpos0``, scaled by ``1 / factor`` when every mass is scaled);
4. the geoms' total sliding friction, read from the model the step ran with;
5. the pole's angle.

A pole that tilts past ``FALL`` radians ends the episode, as does a time-out after
``EPISODE_STEPS`` steps, so worlds reset at different steps (partial resets).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

TASK = "CartpoleBalance"
CART, POLE = 1, 2  # body indices: world, cart, pole_1
MASS, SUBTREE, FRICTION = 0.1, 1.1, 5.0  # as built: the pole's mass, the cart's subtree mass, total friction
FALL = 0.2
EPISODE_STEPS = 25
JAX_CACHE = Path(tempfile.gettempdir()) / "envsync-jax-cache"


def use_compilation_cache() -> None:
    """JAX's persistent compilation cache: a worker process whose step and reset are those
    another process compiled loads them instead of compiling them again (~15 s each here)."""
    import jax

    jax.config.update("jax_compilation_cache_dir", str(JAX_CACHE))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def falling_cartpole_class() -> type:
    """Playground's ``CartpoleBalance`` with the ``"physics"`` observation and episodes that
    end when the pole falls or after ``EPISODE_STEPS`` steps."""
    import jax.numpy as jp
    from mujoco import mjx
    from mujoco_playground import dm_control_suite

    class FallingCartpole(dm_control_suite.cartpole.Balance):  # type: ignore[misc, name-defined]
        def _get_obs(self, data: Any, info: Any) -> Any:
            model = self.mjx_model  # this world's, inside PlaygroundWorlds' step and reset
            inertia = mjx.full_m(model, data)
            physics = jp.stack(
                [
                    inertia[1, 1],
                    inertia[0, 0],
                    model.body_subtreemass[CART],
                    model.dof_invweight0[0],
                    model.geom_friction[:, 0].sum(),
                    data.qpos[1],
                ]
            )
            return {"state": super()._get_obs(data, info), "physics": physics}

        def reset(self, rng: Any) -> Any:
            state = super().reset(rng)
            return state.replace(info={**state.info, "steps": jp.zeros((), jp.int32)})

        def step(self, state: Any, action: Any) -> Any:
            out = super().step(state, action)
            steps = state.info["steps"] + 1
            done = (out.done > 0) | (jp.abs(out.data.qpos[1]) > FALL) | (steps >= EPISODE_STEPS)
            return out.replace(done=done.astype(jp.float32), info={**out.info, "steps": steps})

    return FallingCartpole


def make_cartpole(num_worlds: int = 8, **kwargs: Any) -> Any:
    """``num_worlds`` falling cartpoles as one :class:`PlaygroundWorlds` (MJX's JAX backend, CPU)."""
    from envsync.integrations.torchrl.playground import PlaygroundWorlds

    use_compilation_cache()
    env = falling_cartpole_class()(swing_up=False, sparse=False, config_overrides={"impl": "jax"})
    return PlaygroundWorlds(env, batch_size=[num_worlds], device="cpu", **kwargs)


def make_cartpoles_16() -> Any:
    return make_cartpole(16)


def make_cartpoles_32() -> Any:
    return make_cartpole(32)


def counted(make: Any) -> Any:
    """``make``'s worlds under a ``StepCounter`` with a horizon no episode reaches: torchrl's
    Playground wrapper gives no ``"truncated"`` entry, which ``apply_at="truncate"`` needs (it
    says so at attach), and a ``StepCounter`` adds one only with ``max_steps``."""
    from torchrl.envs import StepCounter, TransformedEnv

    return TransformedEnv(make(), StepCounter(max_steps=100 * EPISODE_STEPS))


def make_counted_cartpoles_16() -> Any:
    return counted(make_cartpoles_16)


def make_counted_cartpoles_32() -> Any:
    return counted(make_cartpoles_32)
