"""What moves over Ray between the main process and the relays: the records posted (a
:class:`Push`, an :class:`Ask`), the order relays get them in (:class:`Posts`), the
:class:`Mailbox` actor that holds them and the relays' reports, and the encoding of one
node's rows (:func:`encode`).

Everything here is tensors, numpy arrays, integers and strings: no user code is pickled.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch

from envsync.links.base import Key
from envsync.state import Leaf, numpy_view

Rows = dict[int, tuple[int, int, dict[Key, Leaf]]]
"""One node's share of a push: link worker -> (version, undo mark, leaves)."""
Acks = tuple[int, int, int, bool, int]
"""One worker's report: ``(received, applied, failed, alive, answered)``."""
Reply = tuple[int, dict[str, torch.Tensor]]
"""One worker's answer to a gather: ``(request, values by env-state name)``."""


@dataclass(frozen=True)
class Push:
    """A push as posted: per node (numbered as :class:`~envsync.links.ray.RayLink` numbers
    them), the reference to that node's rows in the object store, ``None`` where the push
    has no rows for that node. References inside a record are not resolved by Ray."""

    refs: tuple[Any, ...]


@dataclass(frozen=True)
class Ask:
    """A gather as posted: request ``request`` asks each link worker for these env-state
    names."""

    request: int
    names: dict[int, list[str]]


@dataclass
class Traffic:
    """What one end of the Ray link moved (read by tests and ``bench_ray.py``).

    On the main process's side, per node: the objects put and the bytes of the leaves they
    hold (counted per worker). On a relay's side: the objects it fetched, the bytes of its own
    workers' leaves it decoded into its node's link, and the id of the latest object.

    Examples:
        >>> t = Traffic()
        >>> t.add("00ff", 12); t.add("01ff", 4)
        >>> t.objects, t.nbytes, t.last
        (2, 16, '01ff')
    """

    objects: int = 0
    nbytes: int = 0
    last: str = ""

    def add(self, object_id: str, nbytes: int) -> None:
        """Count one object of ``nbytes`` bytes."""
        self.objects += 1
        self.nbytes += nbytes
        self.last = object_id


def encode(rows: Rows) -> Rows:
    """``rows`` with every tensor as a numpy view where numpy has its dtype.

    Ray stores numpy arrays out of band, and every process of a node that gets the object
    maps them from that node's object store instead of copying them (it copies torch
    tensors): the node receives the object once, and each relay copies only its own
    workers' leaves out of it. A tensor given to several workers stays one array, stored
    once.

    Examples:
        >>> shared = torch.ones(2)
        >>> out = encode({0: (1, 0, {("env_state", "x"): shared}), 1: (1, 0, {("env_state", "x"): shared})})
        >>> type(out[0][2]["env_state", "x"]).__name__, out[0][2]["env_state", "x"] is out[1][2]["env_state", "x"]
        ('ndarray', True)
    """
    memo: dict[int, Leaf] = {}

    def one(value: Leaf) -> Leaf:
        if isinstance(value, np.ndarray):
            return value
        if id(value) not in memo:
            view = numpy_view(value.detach())
            memo[id(value)] = value if view is None else view
        return memo[id(value)]

    return {w: (version, undo, {k: one(v) for k, v in leaves.items()}) for w, (version, undo, leaves) in rows.items()}


def leaf_bytes(leaves: dict[Key, Leaf]) -> int:
    """The bytes of one worker's leaves."""
    return sum(int(v.nbytes) for v in leaves.values())


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

    It holds object references (never pushed payloads), a few integers per worker, and the
    gather answers until the main process has read them. Run it as an async Ray actor with
    no CPU (see :func:`start_mailbox`).
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

    async def fetch(self, collector: int, after: int, timeout: float) -> list[tuple[int, Push | Ask]]:
        """The posts after ``after``, in order (waiting up to ``timeout`` for one); older ones
        are dropped once every collector has asked past them."""
        self._consumed[collector] = after
        self._posts.drop_through(min(self._consumed))
        if self._posts.last <= after and timeout > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._posted.wait(), timeout)
        return self._posts.after(after)

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
