"""An env outside any collector (an evaluation env driven by ``env.rollout``) in the fleet.

:func:`attach_env` hooks the env as a wrapped factory would (its ``_step`` and ``_reset`` are
the safe points), joins it to the fleet after the envs attached so far through an in-process
link (it lives in the main process, like a single ``Collector``'s env), and binds a receiver
whose worker loop applies while no rollout runs. It wraps the env instance's ``rollout``,
which marks the env driven and writes the tags once per rollout (as a collector's rollout
does: the hot path stays one integer read a step), and its ``close``, which takes it out of
the fleet. It only receives: ``sync_stats`` does not read its statistics, and each merge
replaces them (an evaluation env normalises as the training fleet does, and what it sees
never shifts the training statistics).
"""

from __future__ import annotations

import types
import weakref
from typing import TYPE_CHECKING, Any

from torchrl.envs import EnvBase

from envsync import reinit
from envsync.configure import apply_config, env_state_dict
from envsync.errors import EnvSyncError, ValidationError
from envsync.integrations.torchrl.adapter import CollectorAdapter, EnvHooks
from envsync.integrations.torchrl.chain import chain_of
from envsync.integrations.torchrl.rollouts import drive
from envsync.links.base import Flat
from envsync.links.local import LocalLink
from envsync.spec import ApplySpec
from envsync.worker.receiver import EnvStateReceiver

if TYPE_CHECKING:
    from envsync.sender.sender import Sender

_ATTACHED = "_envsync_outside"
"""Where an attached env keeps its attachment and the sender's weakref (in its ``__dict__``)."""


class OutsideAdapter(CollectorAdapter):
    """The receiver's view of an env no collector drives: it resets the env itself, and it
    loads merged statistics as they are (its own observations are never counted into a
    merge, so nothing of them is kept on top of it)."""

    def __init__(self, env: EnvBase, spec: ApplySpec) -> None:
        super().__init__(None, env, spec)
        self._own = weakref.ref(env)

    def commit(self, written: dict[str, Any], *, version: int, restore: bool = False) -> None:
        super().commit(written, version=version, restore=True)

    def reset(self) -> None:
        env = self._own()
        if env is None:
            raise EnvSyncError("the env of this receiver is gone")
        env.reset()


def attach_env(sender: Sender, env: EnvBase) -> int:
    """Implementation of :meth:`envsync.EnvStateSender.attach_env`."""
    hooks = _hook(sender, env)
    _check_keys(sender, env)
    env_ref = weakref.ref(env)

    def make(leaves: Flat) -> LocalLink:
        return LocalLink(leaves, 1)

    attachment = sender.port.attach(1, make, detached=lambda: env_ref() is None, outside=True)
    try:
        receiver = EnvStateReceiver(
            link=attachment.link.handle().open(0),
            spec=hooks.spec,
            adapter=OutsideAdapter(env, hooks.spec),
            initial_config=hooks.initial_config,
            owner=hooks.owner,
        )
    except BaseException:
        sender.port.detach(attachment)
        raise
    hooks.bind(receiver, attachment.offset)
    attachment.on_close = _unbinder(env_ref, hooks, receiver)
    env.__dict__[_ATTACHED] = (weakref.ref(sender), attachment)
    _wrap(env, hooks, weakref.ref(receiver))
    receiver.start(loop=receiver.link)  # catch up with the latest desired state, then join the worker loop
    return attachment.offset


def detach_env(sender: Sender, env: EnvBase) -> None:
    """Implementation of :meth:`envsync.EnvStateSender.detach_env`."""
    attached = env.__dict__.get(_ATTACHED) if isinstance(env, EnvBase) else None
    if attached is None or attached[0]() is not sender:
        raise ValidationError(f"this {type(env).__name__} was not attached to this sender with attach_env")
    sender.port.detach(attached[1])


def _hook(sender: Sender, env: EnvBase) -> EnvHooks:
    """The env's hooks, installed with the template config if it has none.

    Raises:
        ValidationError: not an unbatched ``EnvBase``, already in a fleet, or hooked by a
            sender with other settings.
    """
    if not isinstance(env, EnvBase):
        raise ValidationError(f"attach_env takes a torchrl EnvBase, got {type(env).__name__}")
    if env.batch_size:
        raise ValidationError(
            f"attach_env takes an unbatched env; this one has batch_size={list(env.batch_size)} "
            "(attach a batched env through a collector: Collector(sender.env_fn(...)))"
        )
    hooks = env.__dict__.get("_envsync_hooks")
    if isinstance(hooks, EnvHooks):
        if hooks.receiver is not None:
            raise ValidationError("this env is in a fleet already (a collector's env, or attached before)")
        if hooks.spec != sender.spec:
            raise ValidationError("this env was hooked by a sender with other settings (apply, apply_at, reinit)")
        return hooks
    initial = sender.template.values.clone()
    hooks = EnvHooks.install(env, sender.spec, initial)
    apply_config(env, sender.spec.apply, initial)  # version 0 is the template, as on every env
    return hooks


def _check_keys(sender: Sender, env: EnvBase) -> None:
    """The env holds every env-state entry the fleet's envs do (a first reset creates those
    of lazy transforms such as ``VecNorm``).

    Raises:
        ValidationError: the env lacks entries (it is not built like the collectors' envs),
            or the sender knows no env yet.
    """
    try:
        wanted = sender.env_state_template().keys
    except ValidationError as err:
        raise ValidationError(
            f"attach_env joins an env to the fleet of the sender's collectors, and envsync knows their env "
            f"from sender.env_fn(make_env) (or env_state_template=): {err}"
        ) from err

    def missing() -> list[str]:
        held = {*env_state_dict(env), *reinit.stats_entries(chain_of(env), sender.spec.reinit)}
        return [k for k in wanted if k not in held]

    if missing():
        env.reset()
    if missing():
        raise ValidationError(
            f"attach_env: the env lacks the env-state entries {missing()} that the fleet's envs have; "
            "build it like them (the same transforms)"
        )


def _unbinder(env_ref: weakref.ReferenceType[EnvBase], hooks: EnvHooks, receiver: EnvStateReceiver) -> Any:
    """What ends the attachment: the receiver stops, and the env is a plain env again."""

    def unbind() -> None:
        receiver.close()
        if hooks.receiver is receiver:
            hooks.receiver = None
        env = env_ref()
        if env is not None:
            for name in ("rollout", "close", _ATTACHED):
                env.__dict__.pop(name, None)

    return unbind


def _wrap(env: EnvBase, hooks: EnvHooks, receiver_ref: weakref.ReferenceType[EnvStateReceiver]) -> None:
    """Wrap the env instance's ``rollout`` (driven, tagged once per rollout) and ``close``."""
    cls = type(env)

    def rollout(self: EnvBase, *args: Any, **kwargs: Any) -> Any:
        receiver = receiver_ref()
        if receiver is None:
            return cls.rollout(self, *args, **kwargs)
        return drive(receiver, hooks.begin, lambda: cls.rollout(self, *args, **kwargs), hooks.finish)

    def close(self: EnvBase, *args: Any, **kwargs: Any) -> Any:
        attached = self.__dict__.get(_ATTACHED)
        sender = attached[0]() if attached is not None else None
        if sender is not None:
            sender.port.detach(attached[1])
        return cls.close(self, *args, **kwargs)

    env.__dict__["rollout"] = types.MethodType(rollout, env)
    env.__dict__["close"] = types.MethodType(close, env)
