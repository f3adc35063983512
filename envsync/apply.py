"""Built-in ways for a worker's env to take a config: pass one as ``apply=``.

* :func:`attributes`: set each config name as an attribute of the first object along the
  env's wrapper chain that has it (Pendulum's ``g``, CartPole's ``gravity``): microseconds.
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

from envsync.integrations.torchrl.applies import Attributes, Rebuild


def attributes() -> Attributes:
    """Set each config name as an attribute of the first object along the env's wrapper chain
    that has it: the torchrl env, its base envs, ``GymEnv``'s gymnasium env, its wrappers,
    then the unwrapped env. A name found nowhere is a ``ValidationError`` at attach.

    Examples:
        >>> from torchrl.envs import GymEnv
        >>> from envsync import EnvStateSender
        >>> sender = EnvStateSender(config={"g": 2.0}, apply=attributes())
        >>> env = sender.env_fn(GymEnv("Pendulum-v1"))   # a built env takes the template at once
        >>> attributes().read(env, ["g"])
        {'g': 2.0}
        >>> sender.close()
    """
    return Attributes()


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


__all__ = ["attributes", "rebuild"]
