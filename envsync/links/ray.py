"""The Ray link: a direct connection from the main process to each remote collector's relay,
one share per node per push, shared memory below.

The main process holds a :class:`RayLink` to every worker of every remote collector (the
fleet is numbered collector by collector, then by worker). It listens on its node's address
(:class:`~envsync.links.ray_channel.Listener`); each remote collector's
:class:`~envsync.links.ray_relay.Relay` connects to it when torchrl starts envsync's scheme
in its actor, and is first sent every post it missed. Per push the link buffers each
worker's leaves (``write``); ``flush`` makes, for each node that has rows in the push, one
share holding only that node's rows (:func:`~envsync.links.ray_wire.encode`), and posts it,
numbered, on the connections of that node's relays that have rows in it: the rows
themselves, encoded once per node, unless the share is over
:data:`~envsync.links.ray_wire.INLINE` bytes and several relays of the node need it; then
it is put into the object store once and its reference is held by the
:class:`~envsync.links.mailbox.Mailbox`, from which each of those relays takes it, so that
the node receives it once. A gather is posted on every connection as one
:class:`~envsync.links.mailbox.Ask`.

The relay writes its collector's workers into the node's own link (shared memory or in
process), exactly as a local sender would, hands gather requests to its workers through the
same link, and reports acknowledgements, failures, gather answers (numpy arrays) and a
heartbeat back on its connection. A connection carries its posts in order and each once.

The main process reads every connection from one thread into a local table, so
``status``, ``alive``, ``answer`` and ``wait_acks`` cost what they cost on one machine.
Death is concluded only from evidence (:mod:`~envsync.links.ray_deaths`): a relay reports
its own dead worker processes; Ray's view in this process of each actor is read at every
push and every report (no round trip); and once a collector's relay has been silent for
:data:`QUIET_AFTER` seconds (at once when its connection closed) the link asks Ray about
its actor (a ping, which Ray fails at once for a killed actor or a lost node). From a
collector's death on, its reports are dropped and it is posted nothing: none of its
acknowledgements count, though its process may outlive the death a moment. Silence alone
is no proof: a loaded machine can delay reports by seconds, and a push then waits for them
(up to its timeout) instead of calling live workers dead.

Call order: main ``RayLink(...)`` -> :meth:`RayLink.handle` pickled into each actor ->
``handle.relay(collector, node_link).start()`` there -> per push ``write``... ``flush``;
per request ``send_request``, then ``replies`` (whose first call posts the requests) until
the worker's reply comes.
"""

from __future__ import annotations

import bisect
import contextlib
import selectors
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import ray
import torch

from envsync.errors import WireError
from envsync.links.base import Key
from envsync.links.mailbox import Ask, Held
from envsync.links.ray_channel import Channel, Listener, frames
from envsync.links.ray_deaths import Deaths
from envsync.links.ray_relay import RelayHandle
from envsync.links.ray_wire import (
    CAUGHT_UP,
    INLINE,
    Acks,
    Rows,
    Traffic,
    encode,
    leaf_bytes,
    post,
    read_report,
    share_id,
)
from envsync.links.records import as_rows
from envsync.protocol import NO_FAILURE, Counts, Reply, Request, Until, WorkerStatus, counts_of
from envsync.shutdown import EXITING
from envsync.state import Leaf

POLL = 0.5
"""Seconds the link's reading thread waits for a report before it looks at whether it should
stop."""
QUIET_AFTER = 1.5
"""Seconds without a report after which the link asks Ray whether a collector's actor died."""


class RayLink:
    """The main process's end of the Ray link, over every remote collector's workers.

    Args:
        leaves: one worker's starting leaves; every worker gets them with the first flush.
        workers: how many workers each remote collector has (in collector order).
        mailbox: the :class:`~envsync.links.mailbox.Mailbox` actor handle; needed only when
            a node runs several remote collectors (``None`` otherwise).
        actors: the remote collectors' actor handles (in collector order), whose death
            Ray reports (:class:`~envsync.links.ray_deaths.Deaths`); without them only the
            relays' reports tell of a death, and silence never counts as one.
        nodes: the Ray node id each remote collector runs on (in collector order); one
            share per node per push. Default: each collector on a node of its own.
        host: the address relays connect to (default: this process's Ray node address).

    Examples:
        >>> RayLink.__name__
        'RayLink'
    """

    def __init__(
        self,
        leaves: Mapping[Key, Leaf],
        workers: Sequence[int],
        mailbox: Any = None,
        actors: Sequence[Any] = (),
        nodes: Sequence[str] = (),
        host: str | None = None,
    ) -> None:
        self.num_workers = sum(workers)
        self.workers = list(workers)
        self.mailbox = mailbox
        ids = list(nodes) or [str(c) for c in range(len(self.workers))]
        order = list(dict.fromkeys(ids))
        self.nodes = [order.index(n) for n in ids]  # each collector's node number
        if mailbox is None and len(order) < len(ids):
            raise ValueError("a node with several remote collectors needs the mailbox")
        self._starts = [sum(self.workers[:c]) for c in range(len(self.workers))]
        self._node_collectors = [[c for c in range(len(ids)) if self.nodes[c] == node] for node in range(len(order))]
        self.traffic = [Traffic() for _ in order]  # per node: objects made, bytes of rows
        self._seq = 0
        self._pending: Rows = {w: (0, 0, dict(leaves)) for w in range(self.num_workers)}
        self._target = [0] * self.num_workers
        self._acks: list[Acks] = [(0, 0, NO_FAILURE, True, 0, 0)] * self.num_workers
        self._errors: dict[int, str] = {}
        self._replies: dict[int, Reply] = {}
        self._asking: dict[int, Request] = {}  # the requests of one id, posted together
        self._seen = [time.monotonic()] * len(self.workers)
        self._deaths = Deaths(actors, len(self.workers), on_death=self._lose)
        self._report_seq = 0
        self._changed = threading.Condition()
        self._closed = False
        self._listener = Listener(host or ray.util.get_node_ip_address())
        self._channels: dict[int, Channel] = {}
        self._joined: set[int] = set()  # collectors whose relay connected once
        self._backlog: list[dict[int, list[Any]]] = []  # posts, per collector, until every relay joined
        self._posting = threading.Lock()  # a post reaches each connection whole; seq numbers, once each
        # not a daemon: it ends at shutdown, a poll at most after EXITING is set (envsync.shutdown)
        self._thread = threading.Thread(target=self._serve, name="envsync-ray-link")
        self._thread.start()

    def _collector_of(self, worker: int) -> int:
        """The remote collector whose workers include fleet worker ``worker``."""
        return bisect.bisect_right(self._starts, worker) - 1

    def write(self, worker: int, version: int, entries: Mapping[Key, Leaf], *, undo: int = 0) -> None:
        if self._closed:
            raise RuntimeError("link is closed")
        _, _, held = self._pending.get(worker, (0, 0, {}))
        held.update(entries)
        self._pending[worker] = (version, undo, held)
        self._target[worker] = version

    def write_rows(
        self,
        slots: np.ndarray,
        version: int,
        shared: Mapping[Key, Leaf],
        rows: Mapping[Key, torch.Tensor],
        *,
        undo: int = 0,
    ) -> None:
        # a shared tensor stays one array in each node's object (see encode)
        for position, worker in enumerate(slots.tolist()):
            self.write(worker, version, {**shared, **{k: v[position] for k, v in rows.items()}}, undo=undo)

    def notify(self, workers: Sequence[int] | np.ndarray) -> None:
        return None  # the relay notifies the node's workers when it writes them

    def flush(self, version: int) -> None:
        """Post each node's buffered rows to its relays, one share per node that has any (see
        the module docstring for how it travels)."""
        if not self._pending or self._closed:
            return
        pending, self._pending = self._pending, {}
        seq = self._next_seq()
        posts: dict[int, list[Any]] = {}
        for node, collectors in enumerate(self._node_collectors):
            takers = [
                c for c in collectors if any(w in pending for w in self._members(c)) and not self._deaths.known(c)
            ]
            if not takers:
                continue
            rows = encode({w: pending[w] for c in takers for w in self._members(c) if w in pending})
            nbytes = sum(leaf_bytes(leaves) for _, _, leaves in rows.values())
            share: Any = rows
            if nbytes > INLINE and len(takers) > 1:  # one object for the node's relays to map
                ref = ray.put(rows)
                self.mailbox.hold.remote(seq, node, [ref], takers)
                self.traffic[node].add(share_id(seq, node, ref), nbytes)
                share = Held(node)
            else:
                self.traffic[node].add(share_id(seq, node, rows), nbytes)
            message = frames(post(seq, share))
            posts.update({c: message for c in takers})
        self._post(posts)

    def _members(self, collector: int) -> range:
        return range(self._starts[collector], self._starts[collector] + self.workers[collector])

    def _next_seq(self) -> int:
        with self._posting:
            self._seq += 1
            return self._seq

    def _post(self, posts: dict[int, list[Any]]) -> None:
        """Send a post (per collector, the frames of its message) on every connection it is
        for; a copy is kept for the relays that have not connected yet (the frames view the
        pushed tensors, which the sender reuses for later pushes)."""
        with self._posting:
            if len(self._joined) < len(self.workers):
                copies: dict[int, list[bytes]] = {}  # one per message: relays of a node share theirs
                for message in posts.values():
                    if id(message) not in copies:
                        copies[id(message)] = [bytes(part) for part in message]
                self._backlog.append({c: copies[id(m)] for c, m in posts.items()})
            for collector, message in posts.items():
                channel = self._channels.get(collector)
                if channel is not None:
                    self._send(collector, channel, message)

    def _send(self, collector: int, channel: Channel, message: list[Any]) -> None:
        try:
            channel.send_frames(message)
        except OSError:  # gone, or reading nothing for SEND_TIMEOUT: its collector is asked about
            self._drop(collector, channel)

    def _drop(self, collector: int, channel: Channel) -> None:
        with contextlib.suppress(Exception):
            channel.close()
        if self._channels.get(collector) is channel:
            del self._channels[collector]
            self._seen[collector] = 0.0  # silent from now: the next alive() pings its actor

    def send_request(self, workers: Sequence[int] | np.ndarray, request: Request) -> None:
        """Send ``request`` to ``workers``; the requests of one id go out together, as one
        post, at the first :meth:`replies` awaited."""
        if any(held.id != request.id for held in self._asking.values()):
            self._asking = {}
        for worker in np.asarray(workers, dtype=np.int64).tolist():
            self._asking[worker] = request

    def replies(self, workers: np.ndarray, request: int) -> list[tuple[np.ndarray, Reply]]:
        if self._asking and not self._closed:
            asking, self._asking = self._asking, {}
            message = frames(post(self._next_seq(), Ask(asking)))
            self._post({c: message for c in range(len(self.workers))})
        out = []
        with self._changed:
            for worker in np.asarray(workers, dtype=np.int64).tolist():
                reply = self._replies.get(worker)
                if reply is not None and reply.id == request:
                    out.append(as_rows(worker, reply))
        return out

    def status(self, worker: int) -> WorkerStatus:
        received, applied, failed, _, _, reached = self._acks[worker]
        target = self._target[worker]
        return WorkerStatus(worker, target, received, applied, failed, reached)

    def failed(self) -> np.ndarray:
        return np.array([acks[2] for acks in self._acks], dtype=np.int64)

    def error_text(self, worker: int) -> str:
        return self._errors.get(worker, "")

    def alive(self, worker: int) -> bool:
        """Whether ``worker`` can still answer: its relay did not report its process dead,
        Ray did not report its collector's actor dead here, nor fail a ping to it (sent once
        the relay falls silent for :data:`QUIET_AFTER` seconds)."""
        collector = self._collector_of(worker)
        if not self._acks[worker][3] or self._deaths.known(collector):
            return False
        return time.monotonic() - self._seen[collector] < QUIET_AFTER or not self._deaths.pinged(collector)

    def _lose(self, collector: int) -> None:
        """A collector's actor died: hold nothing more for its relay, and wake the waits
        (its workers owe what they owe for good)."""
        if self.mailbox is not None:
            with contextlib.suppress(Exception):
                self.mailbox.forget.remote(collector)
        with self._changed:
            self._report_seq += 1
            self._changed.notify_all()

    def counts(self, slots: Sequence[int] | np.ndarray, *, applied: bool) -> Counts:
        statuses = [self.status(s) for s in np.asarray(slots).tolist()]
        return counts_of(statuses, Until.APPLIED if applied else Until.RECEIVED)

    def wait_acks(self, timeout: float, *, applied: bool, done: Callable[[], bool] | None = None) -> bool:
        if self._closed:
            raise RuntimeError("link is closed")
        with self._changed:
            if done is not None and done():
                return True
            seq = self._report_seq
            return self._changed.wait_for(lambda: self._report_seq != seq or self._closed, timeout=max(timeout, 0.0))

    def handle(self) -> RelayHandle:
        return RelayHandle(
            address=self._listener.address,
            token=self._listener.token,
            mailbox=self.mailbox,
            workers=self.workers,
            nodes=self.nodes,
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._changed:
            self._changed.notify_all()
        with self._posting:
            for channel in self._channels.values():
                with contextlib.suppress(Exception):
                    channel.close()
        if self.mailbox is not None:
            with contextlib.suppress(Exception):
                ray.kill(self.mailbox)

    def _serve(self) -> None:
        """Accept the relays' connections and keep the local table of their reports up to
        date, until the link closes or the interpreter exits."""
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ, None)
        try:
            while not self._closed and not EXITING.is_set():
                for key, _ in selector.select(POLL):
                    if key.data is None:
                        self._join(selector)
                    else:
                        self._read(selector, *key.data)
        finally:
            selector.close()
            self._listener.close()

    def _join(self, selector: selectors.BaseSelector) -> None:
        """A relay connects: send it the posts it missed, then read its reports."""
        with contextlib.suppress(OSError):
            joined = self._listener.accept()
            if joined is None or not 0 <= joined[0] < len(self.workers) or self._closed:
                return
            collector, channel = joined
            with self._posting:
                if collector in self._joined:  # one connection per relay, ever
                    channel.close()
                    return
                for posts in self._backlog:
                    if collector in posts:
                        self._send(collector, channel, posts[collector])
                self._send(collector, channel, frames(CAUGHT_UP))
                self._joined.add(collector)
                if len(self._joined) == len(self.workers):
                    self._backlog.clear()
                self._channels[collector] = channel
            with contextlib.suppress(KeyError, ValueError, OSError):  # a dropped channel's fd, reused
                selector.unregister(channel.fileno())
            selector.register(channel, selectors.EVENT_READ, (collector, channel))

    def _read(self, selector: selectors.BaseSelector, collector: int, channel: Channel) -> None:
        try:
            report = read_report(channel.recv(), self.workers[collector])
        except (OSError, EOFError, WireError):  # its relay stopped, its process is gone, or it sent garbage
            with contextlib.suppress(Exception):
                selector.unregister(channel)
            with self._posting:
                self._drop(collector, channel)
            return
        self._take(collector, *report)

    def _take(
        self,
        collector: int,
        statuses: list[Acks],
        errors: Mapping[int, str],
        replies: Mapping[int, Reply],
    ) -> None:
        first = self._starts[collector]
        with self._changed:
            if self._deaths.known(collector):  # its process outlives its death a moment: drop what it says
                return
            self._seen[collector] = time.monotonic()
            for local, status in enumerate(statuses):
                self._acks[first + local] = status
            for local, text in errors.items():
                self._errors[first + local] = text
            for local, reply in replies.items():
                self._replies[first + local] = reply
            self._report_seq += 1
            self._changed.notify_all()
