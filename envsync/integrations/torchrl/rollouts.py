"""One rollout's safe points, written once for every env kind.

A collector's rollout (and an env's own ``rollout`` outside any collector) is wrapped so
that, in order: the env is marked driven (the worker loop keeps off) -> the hooks start a
rollout -> torchrl rolls out -> the batch is tagged and, where a pending version must end
the episode, its last frame truncated -> the env is released -> what is due while idle is
applied and pending gathers are answered (:meth:`Driven.settle`). The owner is an env's
:class:`~envsync.worker.receiver.EnvStateReceiver` or a batched env's group.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

from tensordict import TensorDictBase

GUARDED = ("reset", "set_seed", "state_dict", "load_state_dict", "shutdown", "cascade_execute", "get_distant_attr")
"""The collector's worker commands that touch the env: run while the env is marked driven."""


class Driven(Protocol):
    """What a rollout's safe points call on the env's owner."""

    def busy(self) -> AbstractContextManager[None]:
        """Mark the env driven for the duration."""

    def settle(self, truncating: list[int]) -> None:
        """After a rollout (``truncating``: the envs whose last frame was truncated for a
        pending version): apply what is due while idle, answer pending gathers."""


Finish = Callable[[TensorDictBase, Any], list[int]]
"""Tags a rollout's batch for the owner that drove it; returns the envs whose episode it
truncated for a pending version."""


def drive(owner: Driven, begin: Callable[[], None], run: Callable[[], Any], finish: Finish) -> Any:
    """Run one rollout (``run``) between its safe points; ``finish(batch, owner)`` tags the
    batch and returns the envs whose episode it truncated."""
    truncating: list[int] = []
    with owner.busy():
        begin()
        out = run()
        if isinstance(out, TensorDictBase):
            truncating = finish(out, owner)
    owner.settle(truncating)
    return out


def wrap_rollout(
    collector: Any,
    owner_ref: weakref.ReferenceType[Any],
    begin: Callable[[], None],
    finish: Finish,
    set_aside: Callable[[Any], AbstractContextManager[None]],
) -> None:
    """Wrap ``collector``'s rollout with :func:`drive`, for as long as the owner lives
    (``set_aside(collector)`` holds the tags out of torchrl's rollout buffer meanwhile)."""
    collector_ref = weakref.ref(collector)
    rollout = type(collector).rollout

    def run() -> Any:
        with set_aside(collector_ref()):
            return rollout(collector_ref())

    def wrapped() -> Any:
        owner = owner_ref()
        if owner is None:
            return rollout(collector_ref())
        return drive(owner, begin, run, finish)

    collector.rollout = wrapped


@contextmanager
def _busy(ref: weakref.ReferenceType[Any]) -> Iterator[None]:
    owner = ref()
    if owner is None:
        yield
        return
    with owner.busy():
        yield


def guard_commands(collector: Any, ref: weakref.ReferenceType[Any]) -> None:
    """Mark ``ref``'s owner busy while torchrl's worker loop runs one of its :data:`GUARDED`
    commands on the env."""
    collector_ref = weakref.ref(collector)
    for name in GUARDED:
        method = getattr(type(collector), name, None)
        if method is None:
            continue

        def guarded(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
            with _busy(ref):
                return _method(collector_ref(), *args, **kwargs)

        setattr(collector, name, guarded)
