"""The Ray link: one object-store put per push, one relay per node, shared memory below.

The main process holds a :class:`RayLink` to every worker of every remote collector (the
fleet is numbered collector by collector, then by worker). Per push it buffers each
worker's leaves (``write``), puts ``{worker: (version, undo, leaves)}`` into Ray's object
store *once* (``flush``) and posts the reference, numbered, to a small :class:`Mailbox` actor
that lives on the main process's node; relays get the posts in that order, once each
(:class:`Posts`).

In each remote collector's actor a :class:`Relay` runs two daemon threads (not actor
methods: a non-async actor runs one task at a time, and the collector keeps a ``next()``
pending):

* *down*: long-polls the mailbox, fetches each posted payload (one transfer per node) and
  writes its collector's workers into the node's own link (shared memory or in process),
  exactly as a local sender would;
* *up*: waits on that link's acknowledgements and reports them, failures with their
  traceback, and a heartbeat, to the mailbox.

The main process reads acknowledgements through one polling thread into a local table, so
``status``, ``alive`` and ``wait_acks`` cost what they cost on one machine. Death is
concluded only from evidence: a relay reports its own dead worker processes, and once a
collector's relay has been silent for :data:`QUIET_AFTER` seconds the link asks Ray about
its actor (a ping, which Ray fails at once for a killed actor or a lost node). Silence alone
is no proof: a loaded machine can delay reports by seconds, and a push then waits for them
(up to its timeout) instead of calling live workers dead.

Call order: main ``RayLink(...)`` -> :meth:`RayLink.handle` pickled into each actor ->
``handle.relay(collector, node_link).start()`` there -> per push ``write``... ``flush``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch

from envsync.errors import ValidationError
from envsync.links.base import Key, SenderLink
from envsync.protocol import NO_FAILURE, WorkerStatus, any_owes
from envsync.state import Leaf

HEARTBEAT = 0.5
"""Seconds between a relay's reports when nothing changes."""
QUIET_AFTER = 1.5
"""Seconds without a report after which the link asks Ray whether a collector's actor died."""
_POLL = 0.5

Payload = dict[int, tuple[int, int, dict[Key, Leaf]]]
"""What one push puts into the object store: link worker -> (version, undo mark, leaves)."""
Acks = tuple[int, int, int, bool]
"""One worker's report: ``(received, applied, failed, alive)``."""


class Posts:
    """Posts in sequence order, each once, however Ray delivers them.

    An async actor does not run its tasks in the order they were sent, and a retried task
    runs twice: a post is kept once per sequence number, and one that comes early waits until
    every number before it has come (a relay skipping one would miss that push's writes, and
    one applying them late would undo newer ones).

    Examples:
        >>> posts = Posts()
        >>> posts.add(2, ["b"]), posts.add(1, ["a"]), posts.add(1, ["a"])
        (False, True, False)
        >>> posts.after(0)
        [(1, ['a']), (2, ['b'])]
    """

    def __init__(self) -> None:
        self.last = 0
        self._ready: list[tuple[int, list[Any]]] = []
        self._early: dict[int, list[Any]] = {}

    def add(self, seq: int, ref: list[Any]) -> bool:
        """Keep post ``seq`` unless it came before; True when posts became ready."""
        if seq <= self.last or seq in self._early:
            return False
        self._early[seq] = ref
        while self.last + 1 in self._early:
            self.last += 1
            self._ready.append((self.last, self._early.pop(self.last)))
        return self.last >= seq

    def after(self, seq: int) -> list[tuple[int, list[Any]]]:
        """The ready posts after ``seq``, in order."""
        return [p for p in self._ready if p[0] > seq]

    def drop_through(self, seq: int) -> None:
        """Forget the ready posts up to ``seq`` (every relay has them)."""
        self._ready = self.after(seq)


class Mailbox:
    """The rendezvous actor: posts go down to relays, reports come up to the main process.

    It holds object references (never payloads) and a few integers per worker. Run it as an
    async Ray actor with no CPU (see :func:`start_mailbox`).
    """

    def __init__(self, num_collectors: int) -> None:
        self._posts = Posts()
        self._consumed = [0] * num_collectors
        self._posted = asyncio.Event()
        self._reports: dict[int, tuple[float, list[Acks]]] = {}
        self._errors: dict[tuple[int, int], str] = {}
        self._report_seq = 0
        self._reported = asyncio.Event()

    def post(self, seq: int, ref: list[Any]) -> None:
        """Add push ``seq`` (the reference is wrapped in a list so Ray does not resolve it);
        see :class:`Posts` for the order relays get them in."""
        if self._posts.add(seq, ref):
            self._posted.set()
            self._posted = asyncio.Event()

    async def fetch(self, collector: int, after: int, timeout: float) -> list[tuple[int, list[Any]]]:
        """The posts after ``after``, in order (waiting up to ``timeout`` for one); older ones
        are dropped once every collector has asked past them."""
        self._consumed[collector] = after
        self._posts.drop_through(min(self._consumed))
        if self._posts.last <= after and timeout > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._posted.wait(), timeout)
        return self._posts.after(after)

    def report(self, collector: int, statuses: list[Acks], errors: dict[int, str]) -> None:
        """A relay's acknowledgements per worker: ``(received, applied, failed, alive)``."""
        self._reports[collector] = (time.monotonic(), statuses)
        for worker, text in errors.items():
            self._errors[(collector, worker)] = text
        self._report_seq += 1
        self._reported.set()
        self._reported = asyncio.Event()

    def forget(self, collector: int) -> None:
        """A relay stops (its collector is shutting down): stop waiting on its fetches."""
        self._consumed[collector] = 1 << 62

    async def acks(
        self, after: int, timeout: float
    ) -> tuple[int, dict[int, tuple[float, list[Acks]]], dict[tuple[int, int], str]]:
        """The reports, once there is one after ``after`` (or ``timeout`` passed); each
        collector's entry carries the seconds since its last report."""
        if self._report_seq <= after:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._reported.wait(), timeout)
        now = time.monotonic()
        table = {c: (now - at, statuses) for c, (at, statuses) in self._reports.items()}
        return self._report_seq, table, dict(self._errors)


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


def start_mailbox(num_collectors: int) -> Any:
    """Start a :class:`Mailbox` actor on this process's node (no CPU, little memory)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    actor_class = ray.remote(num_cpus=0, memory=32 * 2**20, max_restarts=0)(Mailbox)
    return actor_class.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
        num_collectors
    )


class RayLink:
    """The main process's end of the Ray link, over every remote collector's workers.

    Args:
        leaves: one worker's starting leaves; every worker gets them with the first flush.
        workers: how many workers each remote collector has (in collector order).
        mailbox: the :class:`Mailbox` actor handle.
        actors: the remote collectors' actor handles (in collector order), pinged when
            their relay falls silent; without them silence never counts as death.

    Examples:
        >>> RayLink.__name__
        'RayLink'
    """

    def __init__(
        self, leaves: Mapping[Key, Leaf], workers: Sequence[int], mailbox: Any, actors: Sequence[Any] = ()
    ) -> None:
        self.num_workers = sum(workers)
        self.workers = list(workers)
        self.mailbox = mailbox
        self.puts = 0
        self._seq = 0
        self._posted: Any = None
        self._pending: Payload = {w: (0, 0, dict(leaves)) for w in range(self.num_workers)}
        self._target = [0] * self.num_workers
        self._acks: list[Acks] = [(0, 0, NO_FAILURE, True)] * self.num_workers
        self._errors: dict[int, str] = {}
        self._seen = [time.monotonic()] * len(self.workers)
        self._actors = list(actors)
        self._pings: dict[int, Any] = {}
        self._lost = [False] * len(self.workers)
        self._ping_lock = threading.Lock()
        self._report_seq = 0
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._poll, name="envsync-ray-acks", daemon=True)
        self._thread.start()

    def _collector_of(self, worker: int) -> tuple[int, int]:
        for collector, count in enumerate(self.workers):
            if worker < count:
                return collector, worker
            worker -= count
        raise IndexError(worker)

    def write(self, worker: int, version: int, entries: Mapping[Key, Leaf], *, undo: int = 0) -> None:
        if self._closed:
            raise RuntimeError("link is closed")
        _, _, held = self._pending.get(worker, (0, 0, {}))
        held.update(entries)
        self._pending[worker] = (version, undo, held)
        self._target[worker] = version

    def broadcast(
        self, version: int, shared: Mapping[str, torch.Tensor], entries: Mapping[int, Mapping[Key, Leaf]]
    ) -> None:
        # one object-store put per push carries it all anyway (see flush)
        for worker, own in entries.items():
            self.write(worker, version, {**own, **{("env_state", k): v for k, v in shared.items()}})

    def notify(self, worker: int) -> None:
        return None  # the relay notifies the node's workers when it writes them

    def flush(self, version: int) -> None:
        """Put every buffered write into the object store at once and tell the relays."""
        if not self._pending or self._closed:
            return
        payload, self._pending = self._pending, {}
        ref = ray.put(payload)
        self.puts += 1
        self._seq += 1
        self._posted = self.mailbox.post.remote(self._seq, [ref])

    def ask(self, worker: int, request: int, names: list[str]) -> None:
        raise ValidationError("gather and sync_stats do not reach workers over Ray yet (see docs/ray.md)")

    def answered(self, worker: int) -> int:
        return 0

    def read_reply(self, worker: int, names: list[str]) -> dict[str, torch.Tensor]:
        raise ValidationError("gather and sync_stats do not reach workers over Ray yet (see docs/ray.md)")

    def settle(self, timeout: float = 30.0) -> None:
        """Block until the mailbox holds the latest flush (before relays first fetch)."""
        if self._posted is not None:
            ray.get(self._posted, timeout=timeout)

    def status(self, worker: int) -> WorkerStatus:
        received, applied, failed, _ = self._acks[worker]
        target = self._target[worker]
        return WorkerStatus(worker=worker, target=target, received=received, applied=applied, failed=failed)

    def failed(self) -> list[int]:
        return [acks[2] for acks in self._acks]

    def error_text(self, worker: int) -> str:
        return self._errors.get(worker, "")

    def alive(self, worker: int) -> bool:
        """Whether ``worker`` can still answer: its relay did not report its process dead,
        and Ray did not fail a ping to its collector's actor (sent once the relay falls
        silent for :data:`QUIET_AFTER` seconds; an unanswered ping is no evidence)."""
        collector, _ = self._collector_of(worker)
        if not self._acks[worker][3] or self._lost[collector]:
            return False
        return time.monotonic() - self._seen[collector] < QUIET_AFTER or not self._actor_died(collector)

    def _actor_died(self, collector: int) -> bool:
        """Ping the actor of a silent collector (one ping at a time); True once Ray says it
        died. A live actor answers when its current task ends."""
        if collector >= len(self._actors):
            return False
        with self._ping_lock:
            ping = self._pings.get(collector)
            if ping is None:
                ping = self._pings[collector] = self._actors[collector].__ray_call__.remote(_pong)
            ready, _ = ray.wait([ping], timeout=0)
            if not ready:
                return False
            del self._pings[collector]
            self._lost[collector] = _died(ping)
            return self._lost[collector]

    def wait_acks(self, timeout: float, *, applied: bool, version: int = 0, slots: Sequence[int] = ()) -> bool:
        if self._closed:
            raise RuntimeError("link is closed")
        with self._changed:
            if slots and not any_owes((self.status(s) for s in slots), version, applied):
                return True
            seq = self._report_seq
            return self._changed.wait_for(lambda: self._report_seq != seq or self._closed, timeout=max(timeout, 0.0))

    def handle(self) -> RelayHandle:
        return RelayHandle(mailbox=self.mailbox, workers=self.workers)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._changed:
            self._changed.notify_all()
        with contextlib.suppress(Exception):
            ray.kill(self.mailbox)

    def _poll(self) -> None:
        """Keep the local table of acknowledgements up to date (one long poll at a time)."""
        seq = 0
        while not self._closed:
            try:
                seq, table, errors = ray.get(self.mailbox.acks.remote(seq, _POLL), timeout=_POLL + 5.0)
            except Exception:
                if self._closed:
                    return
                time.sleep(_POLL)  # the mailbox is slow or gone: reports age until workers count as dead
                continue
            self._take(table, errors)

    def _take(self, table: Mapping[int, tuple[float, list[Acks]]], errors: Mapping[tuple[int, int], str]) -> None:
        now = time.monotonic()
        offsets = [sum(self.workers[:c]) for c in range(len(self.workers))]
        with self._changed:
            for collector, (age, statuses) in table.items():
                self._seen[collector] = max(self._seen[collector], now - age)
                for local, status in enumerate(statuses):
                    self._acks[offsets[collector] + local] = status
            for (collector, local), text in errors.items():
                self._errors[offsets[collector] + local] = text
            self._report_seq += 1
            self._changed.notify_all()


@dataclass
class RelayHandle:
    """What a remote collector's actor needs to relay pushes: the mailbox and the layout."""

    mailbox: Any
    workers: list[int]

    def open(self, worker: int) -> Any:
        raise RuntimeError("a Ray link is read by relays (RelayHandle.relay), not opened by workers")

    def relay(self, collector: int, node_link: SenderLink) -> Relay:
        """The relay of remote collector ``collector``, writing into ``node_link``."""
        return Relay(self, collector, node_link)


class Relay:
    """Copies pushes from the object store into one node's link and reports back.

    Args:
        handle: the mailbox and layout.
        collector: this remote collector's index.
        node_link: the link to this collector's own workers.
    """

    def __init__(self, handle: RelayHandle, collector: int, node_link: SenderLink) -> None:
        self.mailbox = handle.mailbox
        self.collector = collector
        self.first = sum(handle.workers[:collector])
        self.count = handle.workers[collector]
        self.link = node_link
        self._after = 0
        self._reported: list[Acks] | None = None
        self._sent_failures = [NO_FAILURE] * self.count
        self._stopped = False

    def start(self) -> None:
        """Deliver what is posted already (before the collector's first batch), then relay
        from two daemon threads."""
        self._deliver(ray.get(self.mailbox.fetch.remote(self.collector, self._after, 0.0)))
        self._report()
        threading.Thread(target=self._down, name=f"envsync-relay-down-{self.collector}", daemon=True).start()
        threading.Thread(target=self._up, name=f"envsync-relay-up-{self.collector}", daemon=True).start()

    def stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(Exception):
            self.mailbox.forget.remote(self.collector)

    def _deliver(self, posts: list[tuple[int, list[Any]]]) -> None:
        for seq, (ref,) in posts:
            if seq != self._after + 1:  # a fetch answered twice, or out of turn
                continue
            payload: Payload = ray.get(ref)
            version = 0
            for worker in range(self.first, self.first + self.count):
                if worker in payload:
                    version, undo, entries = payload[worker]
                    self.link.write(worker - self.first, version, entries, undo=undo)
                    self.link.notify(worker - self.first)
            self.link.flush(version)
            self._after = seq

    def _down(self) -> None:
        while not self._stopped:
            try:
                self._deliver(ray.get(self.mailbox.fetch.remote(self.collector, self._after, _POLL)))
            except Exception:
                if self._stopped:
                    return
                time.sleep(_POLL)

    def _up(self) -> None:
        last = 0.0
        while not self._stopped:
            self.link.wait_acks(0.02, applied=False)
            while self.link.wait_acks(0.0, applied=True):  # drained: statuses are compared below
                pass
            now = time.monotonic()
            if self._changed() or now - last >= HEARTBEAT:
                with contextlib.suppress(Exception):
                    self._report()
                last = now

    def _statuses(self) -> list[Acks]:
        out = []
        for w in range(self.count):
            s = self.link.status(w)
            out.append((s.received, s.applied, s.failed, self.link.alive(w)))
        return out

    def _changed(self) -> bool:
        return self._statuses() != self._reported

    def _report(self) -> None:
        statuses = self._statuses()
        errors = {}
        for w, (_, _, failed, _) in enumerate(statuses):
            if failed != self._sent_failures[w]:
                errors[w] = self.link.error_text(w)
                self._sent_failures[w] = failed
        self.mailbox.report.remote(self.collector, statuses, errors)
        self._reported = statuses
