"""One exclusion per env: who may touch an env, when, and for how long.

Two kinds of code touch an env: the thread that *drives* it (torchrl's collector loop in a
worker, or a ``ParallelEnv`` sub-process's main thread, stepping and resetting it) and
envsync's worker loop in the same process (applying a version, answering a ``gather``).
Exactly one thread touches an env at a time; ownership passes through the env's
:class:`Exclusion`, a re-entrant lock that lives in the process where the env lives:

- the driving thread holds it for every step and every reset of the env, safe-point work
  included (the hooks' ``step``/``reset`` take it around the whole call, so a version is
  never applied while the env steps, and a step never reads a half-applied config);
- the worker loop holds it for a whole apply (config method -> env state -> re-initialisation
  -> the reset that follows) and for a ``gather`` reply;
- a collector's rollout, and torchrl's commands on the env (reset, seed, state dicts),
  mark the env *driven* (:meth:`Exclusion.driving`) for their whole length: a loop
  that finds the env driven leaves the version to the env's next safe point instead of
  applying between two steps of a rollout (its own lock hold is then a few µs).

Holding the lock is re-entrant: an apply that steps the env itself (``reinit.recompute``
rolls out) takes the steps' lock again in the same thread. Sub-envs of a ``SerialEnv``
have one each, in the worker; those of a ``ParallelEnv`` one each in their own
sub-process. A natively batched env is one env object whose steps take no lock of their
own: its rows are applied while idle only by its group in the worker loop, under the group's
exclusion and only while no rollout or command drives the env (the driving mark).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Exclusion:
    """The exclusion of one env (see the module docstring for who takes it, and when).

    ``lock`` is held for a step, a reset, an apply or a gather reply; :meth:`driving`
    marks the collector as driving the env, across many steps.

    Examples:
        >>> ex = Exclusion()
        >>> with ex.driving():
        ...     ex.driven
        True
        >>> with ex.lock:  # an apply, a step or a reset
        ...     ex.driven
        False
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._driven = 0

    @property
    def driven(self) -> bool:
        """Whether a rollout or a collector command is under way (read under ``lock``)."""
        return self._driven > 0

    @contextmanager
    def driving(self, mark: Callable[[bool], None] = lambda driven: None) -> Iterator[None]:
        """Mark the env as driven by its collector for the block; ``mark(True)`` /
        ``mark(False)`` also tell other processes (a ``ParallelEnv``'s sub-envs), on the
        first entry and the last exit."""
        with self.lock:
            self._driven += 1
            if self._driven == 1:
                mark(True)
        try:
            yield
        finally:
            with self.lock:
                self._driven -= 1
                if not self._driven:
                    mark(False)
