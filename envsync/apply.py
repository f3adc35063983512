"""Built-in ways for a worker's env to take a config: pass one as ``apply=``.

* :func:`attributes`: set each config name as an attribute path along the env's wrapper
  chain (Pendulum's ``g``, CartPole's ``gravity``, a MuJoCo model's ``model.body_mass``
  written in place): microseconds. ``finish=`` recomputes what the env derives from them.
* :func:`scales`: the same paths, each config value a factor relative to the env as built
  (domain randomisation of masses and friction): version 0, all ones, is the env as built.
* :func:`mj_set_const`: a ``finish=`` for MuJoCo envs (``mujoco.mj_setConst``).
* :func:`recompute_constants`: a ``finish=`` for mjlab (MuJoCo Warp) envs, one row per world.
* :func:`rebuild`: rebuild the gymnasium env inside torchrl's ``GymEnv`` with the config as
  constructor arguments (parameters an env takes only in ``gym.make``): milliseconds, seeded,
  and checked in the main process to keep the env's specs.

A method name (``apply="set_difficulty"``) and a callable ``fn(env, config)`` work as before.

Examples:
    >>> import envsync
    >>> sender = envsync.EnvStateSender(config={"g": 10.0}, apply=envsync.apply.attributes())
    >>> sender.close()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from envsync.integrations.torchrl.applies import Attributes, Finish, Rebuild, Scales
from envsync.integrations.torchrl.finishes import RecomputeConstants, mj_set_const


def attributes(*, finish: Finish | None = None) -> Attributes:
    """Set each config name as an attribute path: its first part on the first object along
    the env's wrapper chain that has it (the torchrl env, its base envs, ``GymEnv``'s
    gymnasium env, its wrappers, then the unwrapped env), the rest followed as attributes.

    A nested name (``{"model": {"body_mass": ...}}``; ``"model.body_mass"`` in
    ``EnvStateSender.from_env``) is such a path. An array at its end (numpy or tensor) is
    written in place, keeping its dtype and shape. A path that does not exist, or a value
    that does not fit, is a ``ValidationError`` naming the path, at attach.

    Args:
        finish: called after every apply with the innermost object along the chain (the
            unwrapped gymnasium env), to recompute what the env derives from the attributes
            set: CartPole computes ``polemass_length`` and ``total_mass`` from ``length``,
            ``masspole`` and ``masscart`` in its constructor only; MuJoCo's constants need
            :func:`mj_set_const`. Picklable with cloudpickle.

    Examples:
        >>> import gymnasium as gym
        >>> from torchrl.envs import GymWrapper
        >>> from envsync import EnvStateSender
        >>> def cartpole_finish(cartpole):
        ...     cartpole.polemass_length = cartpole.masspole * cartpole.length
        ...     cartpole.total_mass = cartpole.masspole + cartpole.masscart
        >>> env = GymWrapper(gym.make("CartPole-v1"))
        >>> sender = EnvStateSender(config={"length": 1.0}, apply=attributes(finish=cartpole_finish))
        >>> env = sender.env_fn(env)        # version 0: length 1.0, and its derived fields
        >>> attributes().read(env, ["length", "polemass_length"])
        {'length': 1.0, 'polemass_length': 0.1}
        >>> sender.close()

    Paths into a MuJoCo model (``pip install "envsync[mujoco]"``):

        >>> from torchrl.envs import GymEnv
        >>> from envsync import EnvStateSender
        >>> make_env = lambda: GymEnv("HalfCheetah-v5")
        >>> sender = EnvStateSender.from_env(make_env, config=["model.body_mass"], apply=attributes())
        >>> sender.desired_config()["model", "body_mass"].shape
        torch.Size([8])
        >>> sender.close()

    A plain name:

        >>> from torchrl.envs import GymEnv
        >>> from envsync import EnvStateSender
        >>> sender = EnvStateSender(config={"g": 2.0}, apply=attributes())
        >>> env = sender.env_fn(GymEnv("Pendulum-v1"))   # a built env takes the template at once
        >>> attributes().read(env, ["g"])
        {'g': 2.0}
        >>> sender.close()
    """
    return Attributes(finish)


def scales(targets: Mapping[str, str | Sequence[str]] | None = None, *, finish: Finish | None = None) -> Scales:
    """Scale attributes relative to their values as built: each config value is a factor and
    the attribute (an :func:`attributes` path) becomes *as built × factor*, in place. A
    template of ones (version 0) is the env as built.

    A factor's dims align with the attribute's leading dims: a 0-d factor scales every
    element (one mass scale for all bodies), one of shape ``(nbody,)`` each body (of
    ``model.body_mass``, and of each row of ``model.body_inertia``), one of shape
    ``(ngeom,)`` each geom's friction coefficients.

    Args:
        targets: config name -> the attribute path (or paths) it scales; a config name not
            in it scales the path of its own name.
        finish: as for :func:`attributes`.

    Examples:
        >>> from torchrl.envs import GymEnv
        >>> from envsync import EnvStateSender
        >>> apply = scales({"mass": ["model.body_mass", "model.body_inertia"], "friction": "model.geom_friction"},
        ...                finish=mj_set_const)
        >>> sender = EnvStateSender(config={"mass": 1.0, "friction": 1.0}, apply=apply)
        >>> make_env = sender.env_fn(lambda: GymEnv("HalfCheetah-v5"))   # what collectors get
        >>> env = GymEnv("HalfCheetah-v5")
        >>> sender.attach_env(env)   # an env run by its own rollouts
        0
        >>> version = sender.push(config={"mass": 1.5})
        >>> env.rollout(2)["next", "env_version"].flatten().tolist()   # reset mode: at the rollout's reset
        [1, 1]
        >>> round(float(attributes().read(env, ["model.body_mass"])["model.body_mass"].sum()), 3)
        21.0
        >>> sender.close()
    """
    return Scales(targets, finish)


def recompute_constants(level: str = "set_const") -> RecomputeConstants:
    """A ``finish=`` for mjlab envs (torchrl's ``MJLabWrapper``/``MJLabEnv``, MuJoCo Warp):
    ``env.sim.recompute_constants(level)`` after every apply, what ``mj_set_const`` is for
    MuJoCo on CPU. The first call (when envsync binds) also expands the constants that
    ``level`` recomputes to one copy per world (``body_subtreemass``, the ``*_invweight0``,
    ``actuator_acc0``): MuJoCo Warp recomputes as many worlds as they hold, so a shared copy
    would give every world world 0's constants.

    In a natively batched mjlab env each config row is one world: ``attributes()`` and
    ``scales()`` paths such as ``sim.model.body_mass`` are written at the rows being changed,
    one indexed write per field for all of them, and a field still shared by every world
    (MuJoCo Warp's storage until it is expanded) is expanded to per-world memory when envsync
    binds (see docs/domain_randomization.md, "Batched simulators").

    Args:
        level: ``"set_const"`` after ``body_mass`` or ``body_ipos``; ``"set_const_0"`` after
            ``body_inertia``, ``dof_armature``, ``body_pos``/``body_quat`` or ``qpos0``;
            ``"set_const_fixed"`` after ``body_gravcomp``. Friction, damping and actuator
            gains need no finish.

    Examples:
        >>> recompute_constants("set_const_0")
        envsync.apply.recompute_constants('set_const_0')
        >>> apply = scales({"mass": "sim.model.body_mass"}, finish=recompute_constants())
    """
    return RecomputeConstants(level)


def rebuild() -> Rebuild:
    """Rebuild the gymnasium env inside torchrl's ``GymEnv`` with the whole config as
    constructor keyword arguments (``GymEnv.rebuild_with_kwargs``), seeded from the env it
    replaces; a push that would change the env's specs is refused in the main process, and
    so is ``apply_at="step"`` (a rebuilt env starts a new episode).

    Examples:
        >>> from torchrl.envs import GymEnv
        >>> from envsync import EnvStateSender
        >>> sender = EnvStateSender(config={"g": 2.0}, apply=rebuild())
        >>> env = sender.env_fn(GymEnv("Pendulum-v1"))
        >>> rebuild().read(env, ["g"])
        {'g': 2.0}
        >>> sender.close()
    """
    return Rebuild()


__all__ = ["attributes", "mj_set_const", "rebuild", "recompute_constants", "scales"]
