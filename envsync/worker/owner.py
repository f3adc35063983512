"""One owner per env: who may touch an env now (idle, driven by its collector, or applying),
and for how long.

Two kinds of code touch an env: the thread that *drives* it (torchrl's collector loop in a
worker, or a ``ParallelEnv`` sub-process's main thread, stepping and resetting it) and
envsync's worker loop in the same process (applying a version, answering a request).
Exactly one thread touches an env at a time; ownership passes through the env's
:class:`Owner`, which lives in the process where the env lives. Its three states:

- **idle**: nothing drives the env; the worker loop may apply a version or answer a request
  at once (holding :attr:`Owner.lock` meanwhile);
- **driven** (:meth:`Owner.driving`): a collector's rollout, or one of torchrl's commands on
  the env (reset, seed, state dicts), is under way; the worker loop leaves the version to the
  env's next safe point instead of applying between two steps of a rollout (its own lock
  hold is then a few µs). Entering and leaving it marks the env busy in its link slot (the
  owner's ``mark``), for the loops of other processes (a ``ParallelEnv``'s sub-envs);
- **applying** (:meth:`Owner.applying`): a receiver applies a version (config method -> env
  state -> re-initialisation -> the reset that follows); the steps the apply takes itself
  (``reinit.recompute`` rolls out) pass the safe points untouched.

The owner also holds the hooks' *fast path* (:attr:`Owner.settled`, :attr:`Owner.handled`,
:attr:`Owner.depth`): a step with nothing pending costs one integer read, compared with the
latest target the step path handled, while the env is settled; anything that changes the env
outside a step (an idle apply, a version noted elsewhere) unsettles it
(:meth:`Owner.unsettle`), so the next step takes the slow path and looks. ``depth`` counts
the batched hooks' nested calls (a ``step_and_maybe_reset`` that steps and resets through
them), so only the outermost call runs the safe points.

The lock is held for every step and every reset (the hooks' ``step``/``reset`` take it
around the whole call, so a version is never applied while the env steps, and a step never
reads a half-applied config), for a whole apply and for a reply. It is re-entrant: an apply
that steps the env takes the steps' lock again in the same thread. Sub-envs of a
``SerialEnv`` have one owner each, in the worker; those of a ``ParallelEnv`` one each in
their own sub-process. A batched env has one owner for itself (its own transforms, its
group's idle work, and every row of a natively batched env, whose rows are one env object:
their receivers share it); marking it driven marks every env under it busy in its slot, and
a sub-env in another process reads that mark before an idle apply
(:class:`~envsync.worker.places.SubEnv`). The mark is set where another process reads it: by the
binder of a collector's unbatched env (its link end) and by a batched env's group (every
env under it), through :meth:`Owner.marks_with`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def _unmarked(busy: bool) -> None:
    return None


class Owner:
    """The owner of one env (see the module docstring for its states, and who takes it).

    Args:
        mark: tells the env's link slot whether the env is driven (called on the first
            entry into :meth:`driving` and the last exit); see :meth:`marks_with`.

    Examples:
        >>> owner = Owner()
        >>> owner.state
        'idle'
        >>> with owner.driving():
        ...     owner.state
        'driven'
        >>> with owner.lock, owner.applying():  # an apply
        ...     owner.state
        'applying'
    """

    def __init__(self, mark: Callable[[bool], None] = _unmarked) -> None:
        self.lock = threading.RLock()
        self._driven = 0
        self._applying = False
        self._mark = mark
        self.settled = False
        """Whether the env's steps may take the fast path (nothing changed outside a step)."""
        self.handled = 0
        """The latest target the step path itself has seen (the fast path compares with it)."""
        self.depth = 0
        """How deep the batched hooks are in nested calls of one step or reset."""

    def __reduce__(self) -> tuple[type[Owner], tuple[()]]:
        """A copy of an env (torchrl deep-copies transforms with their parent) is another env:
        its owner starts idle, unmarked and unsettled."""
        return (Owner, ())

    def unsettle(self) -> None:
        """Make the env's next step take the slow path (a version was applied outside one)."""
        self.settled = False

    def marks_with(self, mark: Callable[[bool], None]) -> None:
        """Mark the env busy through ``mark`` from now on (an env bound to a link end, or a
        batched env's group marking every env under it)."""
        self._mark = mark

    @property
    def driven(self) -> bool:
        """Whether a rollout or a collector command is under way (read under ``lock``)."""
        return self._driven > 0

    @property
    def is_applying(self) -> bool:
        """Whether a receiver is applying a version (read by the thread that holds ``lock``)."""
        return self._applying

    @property
    def state(self) -> str:
        """``"applying"``, ``"driven"`` or ``"idle"``."""
        return "applying" if self._applying else "driven" if self._driven else "idle"

    @contextmanager
    def driving(self) -> Iterator[None]:
        """The collector drives the env for the block (marked busy in its slot on the
        first entry, unmarked on the last exit)."""
        with self.lock:
            self._driven += 1
            if self._driven == 1:
                self._mark(True)
        try:
            yield
        finally:
            with self.lock:
                self._driven -= 1
                if not self._driven:
                    self._mark(False)

    @contextmanager
    def applying(self) -> Iterator[None]:
        """A receiver applies a version for the block (the caller holds ``lock``; the
        receivers of a batched env's rows and level share one owner, one apply at a time)."""
        before, self._applying = self._applying, True
        try:
            yield
        finally:
            self._applying = before
