"""The mailbox: where the relays of a node with several remote collectors pick up the
object-store reference of a large share (see :mod:`envsync.links.ray`).

Posts and reports travel on each relay's direct connection
(:mod:`envsync.links.ray_channel`). An object reference cannot: Ray counts who holds one
only when it travels through Ray, and a reference pickled by hand is pinned for good. So
for a share that goes through the object store, the main process puts the node's rows
once and hands the reference to this small async actor (:meth:`Mailbox.hold`); the post on
each relay's connection says only that the share is held, and each relay with rows in it
takes the reference from here (:meth:`Mailbox.take`) and maps the one object from its
node's store. The mailbox drops the reference once every relay it was held for took it,
stopped, or was found dead (the main process forgets a collector whose actor Ray reports
dead).

It imports nothing heavy (no torch: what it holds is integers and object references), so
its actor starts in about a second.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray

if TYPE_CHECKING:
    import numpy as np

    from envsync.protocol import Request


@dataclass(frozen=True)
class Held:
    """A node's share as posted on a relay's connection when the mailbox holds it: take it
    with ``mailbox.take(seq, node, collector)``.

    Examples:
        >>> Held(2)
        Held(node=2)
    """

    node: int


@dataclass(frozen=True)
class Ask:
    """A request as posted: the link workers it is sent to (int64, one array for all of them:
    one post per request, whatever the number of worlds) and the request
    (:mod:`envsync.links.records` says how it travels)."""

    workers: np.ndarray
    request: Request


class Mailbox:
    """The holder of large shares' references, per post sequence number and node, each
    until the relays it is held for have taken it. Run it as an async Ray actor with no CPU
    (see :func:`start_mailbox`).

    Examples:
        >>> box = Mailbox()
        >>> box.hold(1, 0, ["ref"], [0, 1])
        >>> asyncio.run(box.take(1, 0, 0, 1.0)), asyncio.run(box.take(1, 0, 1, 1.0)), box.held()
        (['ref'], ['ref'], 0)
    """

    def __init__(self) -> None:
        self._held: dict[tuple[int, int], tuple[list[Any], set[int]]] = {}
        self._stopped: set[int] = set()
        self._arrived = asyncio.Event()

    def hold(self, seq: int, node: int, share: list[Any], takers: list[int]) -> None:
        """Hold ``share`` (a list around one object reference, which Ray then does not
        resolve) for the relays of collectors ``takers``."""
        waiting = set(takers) - self._stopped
        if waiting:
            self._held[(seq, node)] = (share, waiting)
        self._arrived.set()
        self._arrived = asyncio.Event()

    async def take(self, seq: int, node: int, collector: int, timeout: float) -> list[Any] | None:
        """The share held for post ``seq`` and ``node`` (waiting up to ``timeout`` seconds
        for it to arrive; ``None`` if it did not), taken by ``collector``'s relay."""
        deadline = asyncio.get_running_loop().time() + timeout
        while (seq, node) not in self._held:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return None
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), left)
        share, waiting = self._held[(seq, node)]
        waiting.discard(collector)
        if not waiting:
            del self._held[(seq, node)]
        return share

    def forget(self, collector: int) -> None:
        """A relay stops (its collector is shutting down), or its actor died: hold nothing
        more for it."""
        self._stopped.add(collector)
        for key, (_, waiting) in list(self._held.items()):
            waiting.discard(collector)
            if not waiting:
                del self._held[key]

    def held(self) -> int:
        """How many shares are held (read by tests)."""
        return len(self._held)


def start_mailbox() -> Any:
    """Start a :class:`Mailbox` actor on this process's node (no CPU, little memory)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    actor_class = ray.remote(num_cpus=0, memory=32 * 2**20, max_restarts=0)(Mailbox)
    return actor_class.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
