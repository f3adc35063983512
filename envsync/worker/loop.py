"""The worker loop: one thread per process and link that waits for a notice and serves every
env the process holds on that link.

A worker process holds one env (a plain env, a ``ParallelEnv``'s sub-env in its own process),
or many (a ``SerialEnv``'s sub-envs, a natively batched env's rows, a ``ParallelEnv``'s
group, which its sub-envs wake through their slots' relays). Each env's owner (its
:class:`~envsync.worker.receiver.EnvStateReceiver`, or the batched env's group for all of its envs)
joins the loop with its link ends (:func:`serve`); the ends' notices are routed to the
semaphore of the loop's first end (:meth:`~envsync.links.base.Notices.route_to`), so
one thread waits on one semaphore, as gymnasium's ``_async_worker`` waits on one pipe.
Woken by the sender (or every half second), the loop calls each member's ``on_wake``: it
acknowledges what reached its envs, and, when the collector does not drive them, applies
what is due while idle and answers requests.

On the in-process link (a ``Collector``'s env beside the sender) the sender's notice runs the
turn in the sender's thread (:meth:`WorkerLoop.turn_here`, :mod:`envsync.links.inline`): no
thread hop, no GIL passed back and forth; the loop's thread takes a notice only when that turn
cannot run at once (another thread holds an env, a turn already runs in the thread), and
does its periodic turn.

The loop holds its members by weakref and ends once none is left (when each is ``closed``
or gone), or when the interpreter shuts down (:mod:`envsync.shutdown`). It is the only place
that notices a dead sender: torchrl's workers never notice a killed main process, so a loop
whose sender is gone ends the worker.
"""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
import weakref
from collections.abc import Sequence
from typing import Protocol

from envsync.links.base import Notices
from envsync.shutdown import EXITING, on_shutdown
from envsync.worker.owner import Owner

PERIOD = 0.5
"""Longest wait for a notice before the sender's liveness is checked (and members woken)."""


class Member(Protocol):
    """An owner of envs the loop serves (a receiver, or a batched env's group)."""

    owner: Owner
    """Its envs' owner: a turn holds its lock for the member's ``on_wake``."""

    @property
    def closed(self) -> bool:
        """Whether the member left the loop."""

    def on_wake(self) -> None:
        """A notice came (or a period passed): acknowledge, and while idle apply and answer."""

    def on_error(self, text: str) -> None:
        """An error escaped :meth:`on_wake` (applies and answers report their own): report
        it as a failure of the versions pending on the member's envs."""


class WorkerLoop:
    """The loop of one link in this process (see the module docstring).

    Args:
        home: the end whose semaphore the loop waits on (the first end that joined).
    """

    def __init__(self, home: Notices) -> None:
        self.home = home
        self._members: list[weakref.ReferenceType[Member]] = []
        self.running = True
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name=f"envsync-loop-{home.worker}")

    def start(self) -> None:
        self._thread.start()

    def add(self, member: Member) -> None:
        """Serve ``member`` from the next turn on (caller holds the registry's lock)."""
        self._members.append(weakref.ref(member))

    def _live(self) -> list[Member] | None:
        """The members still served; ``None`` when there are none (the loop then ends)."""
        with _REGISTRY:
            live = [m for ref in self._members if (m := ref()) is not None and not m.closed]
            self._members = [weakref.ref(m) for m in live]
            if live and not EXITING.is_set():
                return live
            self.running = False
            if _LOOPS.get(self.home.link_name) is self:
                del _LOOPS[self.home.link_name]
            return None

    def turn_here(self) -> bool:
        """A turn in the calling thread (the sender's notice on an in-process link,
        :mod:`envsync.links.inline`); return whether it ran. It does not where it cannot run
        at once: the interpreter exits, the loop ended, a turn already runs in this thread (an
        apply that pushes), or another thread holds a member's envs (a collector stepping
        them in another thread); the loop's thread then takes the notice."""
        if not self.running or self._pid != os.getpid() or getattr(_HERE, "turn", False):
            return False
        return self._turn(blocking=False)

    def _turn(self, *, blocking: bool) -> bool:
        """Call each member's ``on_wake`` under its owner's lock (from the list the turn began
        with: one that closed meanwhile says so itself, and is dropped by the next look; none
        is woken once the interpreter exits). ``blocking=False`` (a turn in the sender's
        thread): stop at a member whose lock another thread holds, or that raises, and return
        ``False``: the loop's thread does every member again (each is idempotent) and reports
        what raised."""
        _HERE.turn = True
        try:
            for ref in self._members:
                member = ref()
                if EXITING.is_set():
                    return blocking
                if member is None or member.closed:
                    continue
                lock = member.owner.lock
                if not lock.acquire(blocking):
                    return False
                try:
                    member.on_wake()
                except Exception:
                    if not blocking:
                        return False
                    member.on_error(traceback.format_exc())
                finally:
                    lock.release()
            return True
        finally:
            _HERE.turn = False

    def _run(self) -> None:
        home = self.home
        while self._live() is not None:
            # a notice proves the sender alive: its liveness (a syscall and a /proc read) is
            # checked only after a quiet period
            if not home.wait_notice(PERIOD) and not home.owner_alive():
                # torchrl's workers never notice a killed main process (they hold its pipe
                # ends themselves and wait forever): without a sender, end the worker
                os._exit(1)
            self._turn(blocking=True)


_HERE = threading.local()
"""Whether a turn runs in this thread (:meth:`WorkerLoop.turn_here`)."""
_LOOPS: dict[str, WorkerLoop] = {}
"""This process's running loops, by link."""
_REGISTRY = threading.Lock()


def _forget_loops() -> None:
    _LOOPS.clear()  # a forked worker runs none of its parent's
    _REGISTRY.release()


# held across a fork (never forked half-way through a change of the registry), released in
# both processes after it; the child, with one thread, starts with no loop
os.register_at_fork(before=_REGISTRY.acquire, after_in_parent=_REGISTRY.release, after_in_child=_forget_loops)


def serve(member: Member, ends: Sequence[Notices]) -> None:
    """Serve ``member`` in this process's loop of the ends' link (started when there is none):
    every notice for ``ends`` wakes that loop from now on, and it calls ``member.on_wake``."""
    first = ends[0]
    with _REGISTRY:
        loop = _LOOPS.get(first.link_name)
        fresh = loop is None or not loop.running
        if fresh:
            loop = _LOOPS[first.link_name] = WorkerLoop(first)
            first.turns_here(loop.turn_here)
        assert loop is not None
        for end in ends:
            end.route_to(loop.home)
        loop.add(member)
    if fresh:
        loop.start()
    else:
        loop.home.poke()  # a turn for the new member


def _wake_loops() -> None:
    """Wake this process's loops when the interpreter shuts down, so that each ends at once
    (or after its current apply) instead of after a period."""
    for loop in list(_LOOPS.values()):
        with contextlib.suppress(Exception):
            loop.home.poke()


on_shutdown(_wake_loops)
