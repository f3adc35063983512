"""The Ray link: one share per node per push (small ones in the post, large ones one
object-store put each), a relay in each remote collector, shared memory below.

The main process holds a :class:`RayLink` to every worker of every remote collector (the
fleet is numbered collector by collector, then by worker). Per push it buffers each
worker's leaves (``write``); ``flush`` makes, for each node that has rows in the push, one
share holding only that node's rows (:func:`~envsync.links.ray_wire.encode`): the rows
themselves up to :data:`~envsync.links.ray_wire.INLINE` bytes, else the reference to one
object put into the object store. It posts the shares, numbered, as one
:class:`~envsync.links.mailbox.Push` to a small :class:`~envsync.links.mailbox.Mailbox`
actor on the main process's node; relays get the posts in that order, once each
(:class:`~envsync.links.mailbox.Posts`), each push holding only their node's share. A
gather is posted the same way, as one :class:`~envsync.links.mailbox.Ask` for every worker
asked.

In each remote collector's actor a :class:`~envsync.links.ray_relay.Relay` takes its
node's share of each push and writes its collector's workers into the node's own link
(shared memory or in process), exactly as a local sender would; the relays of one node map
a large share's one object from the node's object store (numpy arrays are not copied on
``ray.get``), so the node receives each push once and each byte is decoded once, into its
worker's slot. The relay hands gather requests to its workers through the same link, and
reports acknowledgements, failures, gather answers (numpy arrays) and a heartbeat back to
the mailbox.

The main process reads reports through one polling thread into a local table, so
``status``, ``alive``, ``answered`` and ``wait_acks`` cost what they cost on one machine.
Death is concluded only from evidence: a relay reports its own dead worker processes, and
once a collector's relay has been silent for :data:`QUIET_AFTER` seconds the link asks Ray
about its actor (a ping, which Ray fails at once for a killed actor or a lost node). Silence
alone is no proof: a loaded machine can delay reports by seconds, and a push then waits for
them (up to its timeout) instead of calling live workers dead.

Call order: main ``RayLink(...)`` -> :meth:`RayLink.handle` pickled into each actor ->
``handle.relay(collector, node_link).start()`` there -> per push ``write``... ``flush``;
per gather ``ask``... then ``answered`` (which posts the asks) until it reaches the request
-> ``read_reply``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch

from envsync.errors import EnvSyncError
from envsync.links.base import Key
from envsync.links.mailbox import Ask, Push
from envsync.links.ray_relay import POLL, RelayHandle
from envsync.links.ray_wire import INLINE, Acks, Reply, Rows, Traffic, encode, leaf_bytes, share_id, unwire
from envsync.protocol import NO_FAILURE, Until, WorkerStatus, all_settled, any_owing, counts_of
from envsync.shutdown import EXITING
from envsync.state import Leaf

QUIET_AFTER = 1.5
"""Seconds without a report after which the link asks Ray whether a collector's actor died."""


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


class RayLink:
    """The main process's end of the Ray link, over every remote collector's workers.

    Args:
        leaves: one worker's starting leaves; every worker gets them with the first flush.
        workers: how many workers each remote collector has (in collector order).
        mailbox: the :class:`~envsync.links.mailbox.Mailbox` actor handle.
        actors: the remote collectors' actor handles (in collector order), pinged when
            their relay falls silent; without them silence never counts as death.
        nodes: the Ray node id each remote collector runs on (in collector order); one
            object per node per push. Default: each collector on a node of its own.

    Examples:
        >>> RayLink.__name__
        'RayLink'
    """

    def __init__(
        self,
        leaves: Mapping[Key, Leaf],
        workers: Sequence[int],
        mailbox: Any,
        actors: Sequence[Any] = (),
        nodes: Sequence[str] = (),
    ) -> None:
        self.num_workers = sum(workers)
        self.workers = list(workers)
        self.mailbox = mailbox
        ids = list(nodes) or [str(c) for c in range(len(self.workers))]
        order = list(dict.fromkeys(ids))
        self.nodes = [order.index(n) for n in ids]  # each collector's node number
        starts = [sum(self.workers[:c]) for c in range(len(self.workers))]
        self._node_workers = [
            [w for c, first in enumerate(starts) if self.nodes[c] == node for w in range(first, first + workers[c])]
            for node in range(len(order))
        ]
        self.traffic = [Traffic() for _ in order]  # per node: objects put, bytes of rows
        self._seq = 0
        self._posted: Any = None
        self._pending: Rows = {w: (0, 0, dict(leaves)) for w in range(self.num_workers)}
        self._target = [0] * self.num_workers
        self._acks: list[Acks] = [(0, 0, NO_FAILURE, True, 0)] * self.num_workers
        self._errors: dict[int, str] = {}
        self._replies: dict[int, Reply] = {}
        self._asking: Ask | None = None
        self._seen = [time.monotonic()] * len(self.workers)
        self._actors = list(actors)
        self._pings: dict[int, Any] = {}
        self._lost = [False] * len(self.workers)
        self._ping_lock = threading.Lock()
        self._report_seq = 0
        self._changed = threading.Condition()
        self._closed = False
        # not a daemon: it ends at shutdown, a long poll at most after EXITING is set (envsync.shutdown)
        self._thread = threading.Thread(target=self._poll, name="envsync-ray-acks")
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

    def broadcast(self, version: int, shared: Mapping[Key, Leaf], entries: Mapping[int, Mapping[Key, Leaf]]) -> None:
        # a shared tensor stays one array in each node's object (see encode)
        for worker, own in entries.items():
            self.write(worker, version, {**own, **shared})

    def notify(self, worker: int) -> None:
        return None  # the relay notifies the node's workers when it writes them

    def flush(self, version: int) -> None:
        """Post each node's buffered rows to the relays, one share per node that has any: in
        the post itself up to :data:`~envsync.links.ray_wire.INLINE` bytes, else as the
        reference to one object put into the object store."""
        if not self._pending or self._closed:
            return
        pending, self._pending = self._pending, {}
        shares: list[Any] = []
        for node, members in enumerate(self._node_workers):
            rows = encode({w: pending[w] for w in members if w in pending})
            nbytes = sum(leaf_bytes(leaves) for _, _, leaves in rows.values())
            share = (rows if nbytes <= INLINE else ray.put(rows)) if rows else None
            if share is not None:
                self.traffic[node].add(share_id(self._seq + 1, node, share), nbytes)
            shares.append(share)
        self._post(Push(tuple(shares)))

    def _post(self, body: Push | Ask) -> None:
        self._seq += 1
        self._posted = self.mailbox.post.remote(self._seq, body)

    def ask(self, worker: int, request: int, names: list[str]) -> None:
        """Ask ``worker`` for these entries; the asks of one request go out together, as one
        post, when the first answer is awaited (:meth:`answered`)."""
        if self._asking is None or self._asking.request != request:
            self._asking = Ask(request, {})
        self._asking.names[worker] = list(names)

    def answered(self, worker: int) -> int:
        if self._asking is not None and not self._closed:
            asking, self._asking = self._asking, None
            self._post(asking)
        return self._acks[worker][4]

    def read_reply(self, worker: int, names: list[str]) -> dict[str, torch.Tensor]:
        with self._changed:
            _, values = self._replies.get(worker, (0, {}))
        missing = [n for n in names if n not in values]
        if missing:
            raise EnvSyncError(f"worker {worker}'s gather answer lacks {missing}")
        return {n: unwire(values[n]) for n in names}

    def settle(self, timeout: float = 30.0) -> None:
        """Block until the mailbox holds the latest post (before relays first fetch)."""
        if self._posted is not None:
            ray.get(self._posted, timeout=timeout)

    def status(self, worker: int) -> WorkerStatus:
        received, applied, failed, _, _ = self._acks[worker]
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

    def settled(self, slots: Sequence[int], version: int, *, applied: bool) -> bool:
        until = Until.APPLIED if applied else Until.RECEIVED
        return all_settled(counts_of((self.status(s) for s in slots), until), version)

    def wait_acks(self, timeout: float, *, applied: bool, version: int = 0, slots: Sequence[int] = ()) -> bool:
        if self._closed:
            raise RuntimeError("link is closed")
        with self._changed:
            until = Until.APPLIED if applied else Until.RECEIVED
            if slots and not any_owing(counts_of((self.status(s) for s in slots), until), version):
                return True
            seq = self._report_seq
            return self._changed.wait_for(lambda: self._report_seq != seq or self._closed, timeout=max(timeout, 0.0))

    def handle(self) -> RelayHandle:
        return RelayHandle(mailbox=self.mailbox, workers=self.workers, nodes=self.nodes)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._changed:
            self._changed.notify_all()
        with contextlib.suppress(Exception):
            ray.kill(self.mailbox)

    def _poll(self) -> None:
        """Keep the local table of reports up to date (one long poll at a time), until the
        link closes or the interpreter exits."""
        seq = 0
        while not self._closed and not EXITING.is_set():
            try:
                seq, *news = ray.get(self.mailbox.acks.remote(seq, POLL), timeout=POLL + 5.0)
            except Exception:
                if self._closed or EXITING.is_set():
                    return
                time.sleep(POLL)  # the mailbox is slow or gone: reports age until workers count as dead
                continue
            self._take(*news)

    def _take(
        self,
        table: Mapping[int, tuple[float, list[Acks]]],
        errors: Mapping[tuple[int, int], str],
        replies: Mapping[tuple[int, int], Reply],
    ) -> None:
        now = time.monotonic()
        offsets = [sum(self.workers[:c]) for c in range(len(self.workers))]
        with self._changed:
            for collector, (age, statuses) in table.items():
                self._seen[collector] = max(self._seen[collector], now - age)
                for local, status in enumerate(statuses):
                    self._acks[offsets[collector] + local] = status
            for (collector, local), text in errors.items():
                self._errors[offsets[collector] + local] = text
            for (collector, local), reply in replies.items():
                self._replies[offsets[collector] + local] = reply
            self._report_seq += 1
            self._changed.notify_all()
