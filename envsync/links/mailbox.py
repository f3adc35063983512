"""The mailbox: the small async Ray actor that the main process and the relays meet at.
Pushes and gathers are posted to it in order (:class:`Posts`); relays long-poll it for
them, each push reduced to the relay's node's share; relays post their reports to it and
the main process long-polls them.

It imports nothing heavy (no torch: what it holds is integers, strings, object references
and numpy arrays), so its actor starts in about a second; see :mod:`envsync.links.ray`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray

if TYPE_CHECKING:
    from envsync.links.ray_wire import Acks, Reply


@dataclass(frozen=True)
class Push:
    """A push as posted: per node (numbered as :class:`~envsync.links.ray.RayLink` numbers
    them), that node's share: its rows (:data:`~envsync.links.ray_wire.Rows`, at most
    :data:`~envsync.links.ray_wire.INLINE` bytes of leaves), or the reference to them in the
    object store, or ``None`` where the push has no rows for that node. References inside a
    record are not resolved by Ray.

    Examples:
        >>> Push(({0: (1, 0, {})}, None)).only(1)
        Push(shares=(None, None))
    """

    shares: tuple[Any, ...]

    def only(self, node: int) -> Push:
        """This push as node ``node`` gets it: the other nodes' shares left out."""
        return Push(tuple(s if n == node else None for n, s in enumerate(self.shares)))


@dataclass(frozen=True)
class Ask:
    """A gather as posted: request ``request`` asks each link worker for these env-state
    names."""

    request: int
    names: dict[int, list[str]]


class Posts:
    """Posts in sequence order, each once, however Ray delivers them.

    An async actor does not run its tasks in the order they were sent, and a retried task
    runs twice: a post is kept once per sequence number, and one that comes early waits until
    every number before it has come (a relay skipping one would miss that push's writes, and
    one applying them late would undo newer ones).

    Examples:
        >>> posts = Posts()
        >>> posts.add(2, "b"), posts.add(1, "a"), posts.add(1, "a")
        (False, True, False)
        >>> posts.after(0)
        [(1, 'a'), (2, 'b')]
    """

    def __init__(self) -> None:
        self.last = 0
        self._ready: list[tuple[int, Any]] = []
        self._early: dict[int, Any] = {}

    def add(self, seq: int, body: Any) -> bool:
        """Keep post ``seq`` unless it came before; True when posts became ready."""
        if seq <= self.last or seq in self._early:
            return False
        self._early[seq] = body
        while self.last + 1 in self._early:
            self.last += 1
            self._ready.append((self.last, self._early.pop(self.last)))
        return self.last >= seq

    def after(self, seq: int) -> list[tuple[int, Any]]:
        """The ready posts after ``seq``, in order."""
        return [p for p in self._ready if p[0] > seq]

    def drop_through(self, seq: int) -> None:
        """Forget the ready posts up to ``seq`` (every relay has them)."""
        self._ready = self.after(seq)


@dataclass
class _Replies:
    """Gather answers waiting for the main process, each with the report that brought it."""

    held: dict[tuple[int, int], tuple[int, Reply]] = field(default_factory=dict)

    def add(self, seq: int, collector: int, replies: dict[int, Reply]) -> None:
        for worker, reply in replies.items():
            self.held[(collector, worker)] = (seq, reply)

    def after(self, seq: int) -> dict[tuple[int, int], Reply]:
        """The answers brought after report ``seq``; those up to it are forgotten (the main
        process asks from the last report it read, so it has them)."""
        self.held = {k: v for k, v in self.held.items() if v[0] > seq}
        return {k: reply for k, (_, reply) in self.held.items()}


class Mailbox:
    """The rendezvous actor: posts go down to relays, reports come up to the main process.

    It holds object references and shares of at most :data:`~envsync.links.ray_wire.INLINE` bytes (never a large
    payload), a few integers per worker, and the gather answers until the main process has
    read them. Run it as an async Ray actor with no CPU (see :func:`start_mailbox`).
    """

    def __init__(self, num_collectors: int) -> None:
        self._posts = Posts()
        self._consumed = [0] * num_collectors
        self._posted = asyncio.Event()
        self._reports: dict[int, tuple[float, list[Acks]]] = {}
        self._errors: dict[tuple[int, int], str] = {}
        self._replies = _Replies()
        self._report_seq = 0
        self._reported = asyncio.Event()

    def post(self, seq: int, body: Push | Ask) -> None:
        """Add post ``seq``; see :class:`Posts` for the order relays get them in."""
        if self._posts.add(seq, body):
            self._posted.set()
            self._posted = asyncio.Event()

    async def fetch(self, collector: int, node: int, after: int, timeout: float) -> list[tuple[int, Push | Ask]]:
        """The posts after ``after``, in order, each push holding only node ``node``'s share
        (waiting up to ``timeout`` for one); older ones are dropped once every collector has
        asked past them."""
        self._consumed[collector] = after
        self._posts.drop_through(min(self._consumed))
        if self._posts.last <= after and timeout > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._posted.wait(), timeout)
        return [(seq, body.only(node) if isinstance(body, Push) else body) for seq, body in self._posts.after(after)]

    def report(
        self, collector: int, statuses: list[Acks], errors: dict[int, str], replies: dict[int, Reply] | None = None
    ) -> None:
        """A relay's acknowledgements per worker (see :data:`Acks`), the failure texts that
        changed, and the gather answers that came since its last report."""
        self._reports[collector] = (time.monotonic(), statuses)
        for worker, text in errors.items():
            self._errors[(collector, worker)] = text
        self._report_seq += 1
        self._replies.add(self._report_seq, collector, replies or {})
        self._reported.set()
        self._reported = asyncio.Event()

    def forget(self, collector: int) -> None:
        """A relay stops (its collector is shutting down): stop waiting on its fetches."""
        self._consumed[collector] = 1 << 62

    async def acks(
        self, after: int, timeout: float
    ) -> tuple[
        int,
        dict[int, tuple[float, list[Acks]]],
        dict[tuple[int, int], str],
        dict[tuple[int, int], Reply],
    ]:
        """The reports, once there is one after ``after`` (or ``timeout`` passed): each
        collector's entry with the seconds since its last report, the failure texts, and the
        gather answers brought after report ``after``."""
        if self._report_seq <= after:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._reported.wait(), timeout)
        now = time.monotonic()
        table = {c: (now - at, statuses) for c, (at, statuses) in self._reports.items()}
        return self._report_seq, table, dict(self._errors), self._replies.after(after)


def start_mailbox(num_collectors: int) -> Any:
    """Start a :class:`Mailbox` actor on this process's node (no CPU, little memory)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    actor_class = ray.remote(num_cpus=0, memory=32 * 2**20, max_restarts=0)(Mailbox)
    return actor_class.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
        num_collectors
    )
