"""The Ray link: a direct connection from the main process to each remote collector's relay,
one share per node per push, shared memory below.

The main process holds a :class:`RayLink` to every worker of every remote collector (the
fleet is numbered collector by collector, then by worker). It listens on its node's address
(:class:`~envsync.links.ray_channel.Listener`); each remote collector's
:class:`~envsync.links.ray_relay.Relay` connects to it when torchrl starts envsync's scheme
in its actor, and is first sent every post it missed. Per push the link buffers each
write as the columns it is (:data:`~envsync.links.ray_wire.Chunk`: never an entry per
world); ``flush`` makes, for each node with rows in the push, one share of only that node's
rows (:func:`~envsync.links.ray_wire.coalesce`), posted, numbered, on the connections of
that node's relays that have rows in it, unless it is over
:data:`~envsync.links.ray_wire.INLINE` bytes and several relays of the node need it: then it
is put into the object store once, its reference held by the
:class:`~envsync.links.mailbox.Mailbox` until each of those relays took it. A gather is
posted on every connection as one :class:`~envsync.links.mailbox.Ask`.

The relay writes its collector's workers into the node's own link, as a local sender would,
hands gather requests to its workers through it, and reports acknowledgements (columns,
:data:`~envsync.links.ray_wire.ACKS`), failures, gather answers (replies of rows) and a
heartbeat back on its connection, which carries its posts in order and each once.

The main process reads every connection from one thread into a local table (``status``,
``alive_slots``, ``wait_acks`` cost what they cost on one machine). Death is concluded only
from evidence (:mod:`~envsync.links.ray_deaths`): a relay's report of its dead workers, Ray's
view in this process of each actor (read at every push and report), and, once a relay has
been silent for :data:`QUIET_AFTER` seconds, a ping that Ray fails at once for a killed
actor or a lost node. A dead collector's reports are dropped and it is posted nothing;
silence alone is no proof (a loaded machine delays reports: a push then waits, up to its
timeout).

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

from envsync.errors import WireError
from envsync.links.base import Key
from envsync.links.mailbox import Ask, Held
from envsync.links.ray_channel import Channel, Listener, frames
from envsync.links.ray_deaths import Deaths
from envsync.links.ray_relay import RelayHandle
from envsync.links.ray_wire import (
    ACKS,
    CAUGHT_UP,
    INLINE,
    Answer,
    Answers,
    Rows,
    Traffic,
    coalesce,
    encode,
    post,
    read_report,
    rows_bytes,
    share_id,
    take,
)
from envsync.protocol import NO_FAILURE, Counts, Reply, Request, WorkerStatus
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
        # the collector of each fleet worker, as a column (a push's rows split by node at once)
        self._collector = np.repeat(np.arange(len(self.workers)), self.workers)
        self._pending: Rows = [(np.arange(self.num_workers), 0, 0, dict(leaves), {})]
        self._target = np.zeros(self.num_workers, dtype=np.int64)
        self._acks = np.zeros((len(ACKS), self.num_workers), dtype=np.int64)  # the relays' reports, as columns
        self._acks[ACKS.index("failed")] = NO_FAILURE
        self._acks[ACKS.index("alive")] = 1
        self._errors: dict[int, str] = {}
        self._answers = Answers(self.num_workers)
        self._asking: Ask | None = None  # the workers of one request, posted together
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
        self.write_rows(np.array([worker], dtype=np.int64), version, entries, {}, undo=undo)

    def write_rows(
        self,
        slots: np.ndarray,
        version: int,
        shared: Mapping[Key, Leaf],
        rows: Mapping[Key, Leaf],
        *,
        undo: int = 0,
    ) -> None:
        """Buffer one chunk (:data:`~envsync.links.ray_wire.Chunk`): rows and values as they are."""
        if self._closed:
            raise RuntimeError("link is closed")
        workers = np.array(slots, dtype=np.int64)  # a copy: the caller's array may change
        self._pending.append((workers, version, undo, dict(shared), dict(rows)))
        self._target[workers] = version

    def notify(self, workers: Sequence[int] | np.ndarray, *, here: bool = False) -> None:
        return None  # the relay notifies the node's workers when it writes them

    def flush(self, version: int) -> None:
        """Post each node's buffered rows to its relays, one share per node that has any (see
        the module docstring for how it travels)."""
        if not self._pending or self._closed:
            return
        pending, self._pending = coalesce(encode(self._pending), self.num_workers), []
        seq = self._next_seq()
        posts: dict[int, list[Any]] = {}
        for node, collectors in enumerate(self._node_collectors):
            live = np.array([c in collectors and not self._deaths.known(c) for c in range(len(self.workers))])
            rows = [part for chunk in pending if (part := take(chunk, live[self._collector[chunk[0]]])) is not None]
            if not rows:
                continue
            has = np.zeros(len(self.workers), dtype=bool)
            for workers, *_ in rows:
                has[self._collector[workers]] = True
            takers = np.flatnonzero(has).tolist()
            nbytes = rows_bytes(rows)
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
        """Send ``request`` to ``workers``; the workers of one request go out together, as one
        post, at the first :meth:`replies` awaited."""
        chosen = np.asarray(workers, dtype=np.int64)
        held = self._asking
        if held is not None and held.request.id == request.id:
            chosen = np.union1d(held.workers, chosen)
        self._asking = Ask(chosen, request)

    def replies(self, workers: np.ndarray, request: int) -> list[tuple[np.ndarray, Reply]]:
        if self._asking is not None and not self._closed:
            asking, self._asking = self._asking, None
            message = frames(post(self._next_seq(), asking))
            self._post({c: message for c in range(len(self.workers))})
        with self._changed:
            return self._answers.of(np.asarray(workers, dtype=np.int64), request)

    def status(self, worker: int) -> WorkerStatus:
        with self._changed:
            received, applied, failed, _, _, reached = self._acks[:, worker].tolist()
            return WorkerStatus(worker, int(self._target[worker]), received, applied, failed, reached)

    def failed(self) -> np.ndarray:
        with self._changed:
            return self._acks[ACKS.index("failed")].copy()

    def error_text(self, worker: int) -> str:
        return self._errors.get(worker, "")

    def alive(self, worker: int) -> bool:
        """Whether ``worker`` can still answer: neither its relay nor Ray (here, or by a ping
        once the relay is silent for :data:`QUIET_AFTER` s) told of its death."""
        return bool(self._acks[ACKS.index("alive"), worker]) and self._collector_alive(self._collector_of(worker))

    def alive_slots(self, slots: np.ndarray) -> np.ndarray:
        """:meth:`alive` of each of ``slots``, Ray and the silence asked once per collector."""
        collectors = self._collector[slots]
        out = self._acks[ACKS.index("alive"), slots] != 0
        for collector in np.unique(collectors).tolist():
            if not self._collector_alive(collector):
                out[collectors == collector] = False
        return out

    def _collector_alive(self, collector: int) -> bool:
        quiet = time.monotonic() - self._seen[collector] >= QUIET_AFTER
        return not self._deaths.known(collector) and (not quiet or not self._deaths.pinged(collector))

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
        at = np.asarray(slots, dtype=np.int64)
        with self._changed:  # one report's columns, never half of one
            acked = self._acks[ACKS.index("applied" if applied else "received")]
            return self._target[at], acked[at], self._acks[ACKS.index("failed")][at]

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
        self, collector: int, acks: np.ndarray, errors: list[tuple[np.ndarray, str]], answers: list[Answer]
    ) -> None:
        first = self._starts[collector]
        with self._changed:
            if self._deaths.known(collector):  # its process outlives its death a moment: drop what it says
                return
            self._seen[collector] = time.monotonic()
            self._acks[:, first : first + self.workers[collector]] = acks
            for rows, text in errors:  # one text for every worker whose failure it is
                self._errors.update(dict.fromkeys((rows + first).tolist(), text))
            self._answers.add(first, answers)
            self._report_seq += 1
            self._changed.notify_all()
