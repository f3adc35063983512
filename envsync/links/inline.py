"""Wake-ups of the in-process link: a notice runs the worker loop's turn in the thread that
sends it, when it can, instead of waking the loop's thread.

Across processes a notice must wake the worker's loop thread (a semaphore). In one process
(a ``Collector``'s env lives beside the sender) that hop costs a thread switch each way and
the GIL passed between the sender, the loop and the collector: a push of 410 rows to
"applied" spent ~0.1 ms of its ~0.5 ms in the hops. An :class:`InlineWake` holds the turn
its loop installs (:meth:`~envsync.worker.loop.WorkerLoop.turn_here`): the notice of a
sender that waits for it (a push with ``wait=``, a gather: :meth:`InlineWake.deliver`) runs it
in the sender's thread, and releases the semaphore for the loop's thread only when the turn
cannot run there (another thread holds one of the
loop's envs, a turn already runs in this thread, the interpreter exits). Pokes and relays
(:meth:`InlineWake.release`) always wake the thread, and so does a push with ``wait=None``,
which returns at once.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any


def semaphore() -> Any:
    """A semaphore for threads of this process, in C (a POSIX semaphore, unlinked at once:
    no name, no file, nothing to clean up): ``threading.Semaphore`` is a condition variable
    in Python, and a push takes and gives these several times over its two threads."""
    return multiprocessing.get_context("fork").Semaphore(0)


class InlineWake:
    """A wake-up of the in-process link (see the module docstring).

    Examples:
        >>> wake = InlineWake()
        >>> wake.deliver(); wake.acquire(False)  # no turn installed: the thread is woken
        True
        >>> wake.turn = lambda: True
        >>> wake.deliver(); wake.acquire(False)  # the turn ran here
        False
    """

    __slots__ = ("_semaphore", "turn")

    def __init__(self) -> None:
        self._semaphore = semaphore()
        self.turn: Callable[[], bool] | None = None
        """The loop's turn in the caller's thread; returns whether it ran."""

    def deliver(self) -> None:
        """A notice from the sender: the loop's turn here, or its thread woken."""
        turn = self.turn
        if turn is None or not turn():
            self._semaphore.release()

    def release(self) -> None:
        """Wake the loop's thread (a poke, a relay)."""
        self._semaphore.release()

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        return bool(self._semaphore.acquire(block, timeout))
