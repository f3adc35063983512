"""Where a receiver's env lives, and so what its receiver does besides applying
(:class:`Place`): an env its receiver owns (:class:`Standalone`), a sub-env of a batched
env, driven and reset by its group (:class:`SubEnv`), or a batched env's own transforms,
applied by its group once every env under them applied (:class:`BatchedLevel`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from envsync.levels import is_batched
from envsync.links.base import ReceiverLink
from envsync.spec import ApplySpec


class Applier(Protocol):
    """What a place asks of its receiver (:class:`~envsync.worker.receiver.EnvStateReceiver`)."""

    @property
    def spec(self) -> ApplySpec:
        """How versions are applied."""

    @property
    def link(self) -> ReceiverLink:
        """The receiver's end of its link."""

    def apply_latest(self, *, reset_after: bool) -> bool:
        """Apply the latest version published (then reset, ``reset_after``); whether it did."""


class Place(Protocol):
    """Where a receiver's env lives, and so what its receiver does besides applying: whether
    it resets the env itself, how it applies while the collector is idle, and whom it hands
    a request for the batched env's own entries."""

    @property
    def resets(self) -> bool:
        """Whether the receiver resets its env itself (after catching up, or an idle apply)."""

    def owns(self, name: str) -> bool:
        """Whether the env-state entry ``name`` (or, ``"batched"``, a request for the batched
        env's own entries) is this level's (:mod:`envsync.levels`)."""

    def idle_apply(self, receiver: Applier) -> None:
        """Apply ``receiver``'s pending ``"step"`` or ``"truncate"`` version while the
        collector is idle (called under the receiver's owner's lock)."""

    def hand_over(self) -> None:
        """A request asks for the batched env's own entries: its group answers."""


class Standalone:
    """An env its receiver owns: a plain env of a collector, or an env outside any collector.
    An idle apply happens at once, followed by a reset when the mode truncates.

    Examples:
        >>> Standalone().resets
        True
    """

    resets = True

    def owns(self, name: str) -> bool:
        return not is_batched(name)

    def idle_apply(self, receiver: Applier) -> None:
        receiver.apply_latest(reset_after=receiver.spec.idle_resets)

    def hand_over(self) -> None:
        return None  # a standalone env has no batched level


class SubEnv:
    """A sub-env of a batched env (a ``SerialEnv``'s, a ``ParallelEnv``'s, a row of a natively
    batched env): driven from its group's thread or process, which marks it busy through the
    link and resets it through the collector. It applies while idle only in plain ``"step"``
    mode; a truncating version waits for the group's reset.

    Args:
        before_idle_apply: makes the sub-env's next step note the version it runs under
            (called before an idle apply).
        wake_group: wakes the group, for what only it can do (answer for the batched env's
            own entries, reset while idle); a sub-env in its group's process needs nothing.

    Examples:
        >>> SubEnv(lambda: None).resets
        False
    """

    resets = False

    def owns(self, name: str) -> bool:
        return not is_batched(name)

    def __init__(self, before_idle_apply: Callable[[], None], wake_group: Callable[[], None] = lambda: None) -> None:
        self._before_idle_apply = before_idle_apply
        self._wake_group = wake_group

    def idle_apply(self, receiver: Applier) -> None:
        if receiver.spec.idle_resets:
            self._wake_group()  # the group resets the sub-env through its collector
            return
        # first make the sub-env's next step take the slow path, then look at "busy": a step
        # that saw the fast path was sent after the group marked the sub-env busy
        self._before_idle_apply()
        if not receiver.link.is_busy():
            receiver.apply_latest(reset_after=False)

    def hand_over(self) -> None:
        self._wake_group()


class BatchedLevel:
    """A batched env's own transforms: entries ``batched.*``, applied by its group (through
    :meth:`~envsync.worker.receiver.EnvStateReceiver.apply_pending`) once every env under them holds
    the version (its end is the gate, :class:`~envsync.worker.gate.GateEnd`); never reset by its
    receiver, it answers the requests for its entries itself.

    Examples:
        >>> BatchedLevel().owns("batched.transforms.0.loc"), BatchedLevel().owns("transforms.0.loc")
        (True, False)
    """

    resets = False

    def owns(self, name: str) -> bool:
        return is_batched(name)

    def idle_apply(self, receiver: Applier) -> None:
        receiver.apply_latest(reset_after=False)

    def hand_over(self) -> None:
        return None  # it answers for its entries itself
