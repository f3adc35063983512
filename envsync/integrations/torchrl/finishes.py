"""Built-in ``finish=`` functions: recompute what a simulator derives from the fields an apply
wrote, as compiling a model with the new values would.

* :func:`mj_set_const`: MuJoCo on CPU (gymnasium's MuJoCo envs), ``mujoco.mj_setConst``.
* :class:`RecomputeConstants`: mjlab (MuJoCo Warp, torchrl's ``MJLabWrapper``), one set of
  constants per world through ``Simulation.recompute_constants``. It reaches two of mjlab's
  public names: ``RecomputeLevel`` and ``requires_model_fields``, whose ``model_fields`` list
  the derived fields of a level (the list mjlab's own DR expands). The derived fields are
  expanded first: mujoco_warp's ``set_const`` computes as many worlds as they hold, so a
  shared copy would give every world world 0's constants.
"""

from __future__ import annotations

import weakref
from typing import Any

from envsync.errors import ValidationError

_SCRATCH: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
"""Per MuJoCo model, the spare ``MjData`` that :func:`mj_set_const` computes on."""


def mj_set_const(env: Any) -> None:
    """A ``finish=`` for MuJoCo envs: ``mujoco.mj_setConst`` on the env's model, which
    recomputes the constants MuJoCo derives from the model (``body_subtreemass``, the
    ``*_invweight0`` the constraint solver scales by, ``actuator_acc0``) as compiling a model
    with the new values would. It computes on a spare ``MjData`` (``mj_setConst`` moves the
    ``qpos`` of the data it is given), so the episode in progress is untouched.

    Args:
        env: an object with ``model`` (``mujoco.MjModel``): gymnasium's ``MujocoEnv``, as
            ``finish`` receives it.

    Examples:
        >>> import gymnasium as gym
        >>> cheetah = gym.make("HalfCheetah-v5").unwrapped
        >>> cheetah.model.body_mass[1] *= 2
        >>> mj_set_const(cheetah)
        >>> round(float(cheetah.model.body_subtreemass[0]), 2)
        20.25
    """
    import mujoco

    model = env.model
    scratch = _SCRATCH.get(model)
    if scratch is None:
        scratch = _SCRATCH[model] = mujoco.MjData(model)
    mujoco.mj_setConst(model, scratch)


LEVELS = ("set_const_fixed", "set_const_0", "set_const")
"""mjlab's ``RecomputeLevel`` names, cheapest first (``none`` needs no finish)."""


_EXPANDED: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


class RecomputeConstants:
    """A ``finish=`` for mjlab envs: ``env.sim.recompute_constants(level)`` after every apply,
    the derived fields of ``level`` first expanded to per-world memory (once per simulation).

    Args:
        level: an mjlab ``RecomputeLevel`` name: ``"set_const"`` after ``body_mass`` or
            ``body_ipos``; ``"set_const_0"`` after ``body_inertia``, ``dof_armature``,
            ``body_pos``/``body_quat``, ``qpos0``; ``"set_const_fixed"`` after
            ``body_gravcomp``. Friction, damping and actuator gains need none.

    Examples:
        >>> RecomputeConstants("set_const")
        envsync.apply.recompute_constants('set_const')
    """

    def __init__(self, level: str = "set_const") -> None:
        if level not in LEVELS:
            raise ValidationError(f"recompute_constants(): level must be one of {LEVELS}, got {level!r}")
        self.level = level

    def __call__(self, env: Any) -> None:
        from mjlab.managers.event_manager import RecomputeLevel, requires_model_fields

        sim = env.sim
        level = RecomputeLevel[self.level]
        done = _EXPANDED.setdefault(sim, set())
        if self.level not in done:
            # mjlab's public list of the fields a level recomputes: the one its own DR expands
            derived = requires_model_fields(recompute=level)(_no_event).model_fields
            sim.expand_model_fields(tuple(f for f in derived if hasattr(sim.mj_model, f)))
            done.add(self.level)
        sim.recompute_constants(level)

    def __repr__(self) -> str:
        return f"envsync.apply.recompute_constants({self.level!r})"


def _no_event() -> None:
    """What ``requires_model_fields`` decorates to tell its derived fields."""


__all__ = ["LEVELS", "RecomputeConstants", "mj_set_const"]
