"""Which remote collectors' actors died, as the main process learns it (see :mod:`envsync.links.ray`).

Two kinds of evidence, both Ray's own word:

* what Ray has already told this process: once it reports an actor dead here (a call to the
  actor then fails at once with ``ActorDiedError``), its local view of the actor says
  ``DEAD``. Reading that view is a lookup in this process, no round trip, so the link reads
  it at every push and every report. It must: ``ray.kill`` marks the actor dead before its
  process has exited, and for a few tens of milliseconds its relay still takes posts and
  reports its workers' acknowledgements;
* a ping to the actor of a collector whose relay fell silent, which Ray fails when the actor
  was killed or its node was lost (the view above may not know yet: this process called
  nothing on the actor since).

A death is final: from then on none of the collector's acknowledgements count.

Examples:
    >>> deaths = Deaths([], 2, on_death=print)  # no actors: only the relays' evidence counts
    >>> deaths.known(0), deaths.pinged(1)
    (False, False)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.core.generated import gcs_pb2

_DEAD = gcs_pb2.ActorTableData.ActorState.DEAD  # type: ignore[attr-defined]  # protobuf-made, no stubs


def _pong(actor: Any) -> int:
    """The ping a silent collector's actor answers (run on the actor by ``__ray_call__``)."""
    return 0


def _died(ping: Any) -> bool:
    """Whether an answered ping says its actor died (unavailable for now is not dead: a
    restart, a network hiccup)."""
    try:
        ray.get(ping)
    except ray.exceptions.ActorDiedError:
        return True
    except ray.exceptions.RayError:
        pass
    return False


def _reported_dead(actor: Any) -> bool:
    """Whether Ray has reported ``actor`` dead to this process (its local view; unknown, or
    Ray no longer connected here, is not dead).

    A reach into Ray's handle (``ActorHandle._get_local_state``), confined here, because
    Ray 2.60 has no public API for it: the public ``ray.util.state.get_actor`` asks the
    dashboard's state server over HTTP, which runs only where the dashboard does (a
    ``ray[default]`` install: the ``ray`` that ``envsync[ray]`` installs has no aiohttp, so
    no dashboard) and costs a round trip per check, while a push must see a death within 2 s
    of Ray reporting it and checks every remote collector each time; ``ray.get`` of a ping
    (:func:`_pong`, read by :func:`_died`) is public but waits for a live actor's next free
    slot. Ray Data reads the local view the same way. If the method goes, the ``AttributeError`` reads as "not
    known dead" and the relays' own reports and the ping still tell."""
    try:
        return bool(actor._get_local_state() == _DEAD)
    except (AttributeError, ray.exceptions.RayError):
        return False


class Deaths:
    """The remote collectors whose actor Ray reported dead.

    Args:
        actors: the remote collectors' actor handles (in collector order); without them
            only the relays' own reports tell of a death.
        collectors: how many remote collectors there are.
        on_death: called once per collector, with its index, when its death is concluded
            (from the thread that concluded it).
    """

    def __init__(self, actors: Sequence[Any], collectors: int, on_death: Callable[[int], None]) -> None:
        self._actors = list(actors)
        self._dead = [False] * collectors
        self._pings: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._on_death = on_death

    def known(self, collector: int) -> bool:
        """Whether ``collector``'s actor is dead as far as this process knows, without asking
        anyone (concluded before, or Ray reported it dead here)."""
        if self._dead[collector]:
            return True
        if collector < len(self._actors) and _reported_dead(self._actors[collector]):
            self._conclude(collector)
        return self._dead[collector]

    def pinged(self, collector: int) -> bool:
        """:meth:`known`, or else ping the actor of a silent collector (one ping at a time);
        True once Ray fails the ping as dead. A live actor answers when its current task
        ends; an unanswered ping is no evidence."""
        if self.known(collector) or collector >= len(self._actors):
            return self._dead[collector]
        with self._lock:
            ping = self._pings.get(collector)
            if ping is None:
                ping = self._pings[collector] = self._actors[collector].__ray_call__.remote(_pong)
            ready, _ = ray.wait([ping], timeout=0)
            if not ready:
                return False
            del self._pings[collector]
            died = _died(ping)
        if died:
            self._conclude(collector)
        return died

    def _conclude(self, collector: int) -> None:
        with self._lock:
            if self._dead[collector]:
                return
            self._dead[collector] = True
        self._on_death(collector)
