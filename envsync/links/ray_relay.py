"""The relay in each remote collector's actor: takes the posts of its direct connection to
the main process, writes its workers' rows into its node's link, hands gather requests to
its workers, and reports acknowledgements, failures, gather answers and a heartbeat back on
the same connection (see :mod:`envsync.links.ray`)."""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from envsync.errors import WireError
from envsync.links.mailbox import Ask, Held
from envsync.links.ray_channel import Channel, connect
from envsync.links.ray_wire import ACKS, CAUGHT_UP, Answer, Rows, Traffic, read_post, rows_bytes, share_id, take
from envsync.links.records import plain
from envsync.links.slots import SlotWriter
from envsync.protocol import NO_FAILURE

HEARTBEAT = 0.5
"""Seconds between a relay's reports when nothing changes."""
TAKE_WAIT = 0.5
"""Seconds one ask of the mailbox for a held share waits."""
TAKE_GIVE_UP = 30.0
"""Seconds after which a relay gives up on a held share the mailbox never got (that post is
lost: its workers never acknowledge it; the later posts go on)."""


@dataclass
class RelayHandle:
    """What a remote collector's actor needs to relay pushes: the main process's address and
    token (:class:`~envsync.links.ray_channel.Listener`), the mailbox (``None`` when no node
    has several remote collectors) and the layout (each collector's worker count, and the
    number of the node it runs on)."""

    address: tuple[str, int]
    token: bytes
    mailbox: Any
    workers: list[int]
    nodes: list[int]

    def open(self, worker: int, *, claim: bool = True) -> Any:
        raise RuntimeError("a Ray link is read by relays (RelayHandle.relay), not opened by workers")

    def open_rows(self, first: int, count: int, *, gated: bool = False, claim: bool = True) -> Any:
        raise RuntimeError("a Ray link is read by relays (RelayHandle.relay), not opened by workers")

    def relay(self, collector: int, node_link: SlotWriter) -> Relay:
        """The relay of remote collector ``collector``, writing into ``node_link``."""
        return Relay(self, collector, node_link)


class Relay:
    """Copies pushes (from its connection, or from the object store) into one collector's
    link and reports back.

    It runs daemon threads (not actor methods: a non-async actor runs one task at a time,
    and the collector keeps a ``next()`` pending):

    * *down*: reads its connection; per push it takes its node's share (each node gets one,
      holding only its workers' rows: in the post, or, when the node's several relays share
      a large one, one object that they map from the node's object store) and writes its own
      workers into the link; per gather it asks its workers;
    * *up*: woken by two watchers, one per kind of acknowledgement semaphore of the link
      (a thread waits on one), it reports acknowledgements, failures with their traceback,
      gather answers, and a heartbeat, on the connection.

    Args:
        handle: the main process's address, the mailbox and the layout.
        collector: this remote collector's index.
        node_link: the link to this collector's own workers.
    """

    def __init__(self, handle: RelayHandle, collector: int, node_link: SlotWriter) -> None:
        self.handle = handle
        self.mailbox = handle.mailbox
        self.collector = collector
        self.node = handle.nodes[collector]
        self.first = sum(handle.workers[:collector])
        self.count = handle.workers[collector]
        self.link = node_link
        self.traffic = Traffic()
        self._channel: Channel | None = None
        self._reported: np.ndarray | None = None
        self._sent_failures = np.full(self.count, NO_FAILURE, dtype=np.int64)
        self._asked = np.zeros(self.count, dtype=np.int64)  # per local worker, the latest request sent it
        self._answered = np.zeros(self.count, dtype=np.int64)  # per local worker, the latest request it answered
        self._fresh: list[Answer] = []  # answers read, not reported yet
        self._stopped = False
        self._woken = threading.Event()

    def start(self) -> None:
        """Connect, deliver what is posted already (before the collector's first batch),
        then relay from daemon threads."""
        channel = self._channel = connect(self.handle.address, self.handle.token, self.collector)
        while (post := channel.recv()) != CAUGHT_UP:
            self._deliver(post)
        self._report(self._statuses())
        threading.Thread(target=self._down, name=f"envsync-relay-down-{self.collector}", daemon=True).start()
        threading.Thread(target=self._up, name=f"envsync-relay-up-{self.collector}", daemon=True).start()
        for kind in ("received", "applied"):
            name = f"envsync-relay-{kind}-{self.collector}"
            threading.Thread(target=self._watch, args=(kind == "applied",), name=name, daemon=True).start()

    def stop(self) -> None:
        self._stopped = True
        self._woken.set()  # the up thread ends now, without another report
        if self._channel is not None:
            self._channel.close()
        if self.mailbox is not None:
            with contextlib.suppress(Exception):
                self.mailbox.forget.remote(self.collector)

    def _deliver(self, post: Any) -> None:
        seq, body = read_post(post)
        if isinstance(body, Ask):
            self._ask(body)
        else:
            self._write(seq, body)

    def _write(self, seq: int, share: Rows | Held) -> None:
        if isinstance(share, Held):
            ref = self._take(seq, share.node)
            rows: Rows = ray.get(ref)
        else:
            ref, rows = share, share
        mine = [
            part
            for chunk in rows
            if (part := take(chunk, (chunk[0] >= self.first) & (chunk[0] < self.first + self.count))) is not None
        ]
        for workers, version, undo, shared, per_row in mine:
            local = workers - self.first
            self.link.write_rows(local, version, shared, per_row, undo=undo)
            self.link.notify(local)
        if mine:
            self.link.flush(mine[-1][1])
        self.traffic.add(share_id(seq, self.node, ref), rows_bytes(mine))

    def _take(self, seq: int, node: int) -> Any:
        """The reference the mailbox holds for post ``seq``'s share of ``node``."""
        deadline = time.monotonic() + TAKE_GIVE_UP
        while not self._stopped and time.monotonic() < deadline:
            share = ray.get(self.mailbox.take.remote(seq, node, self.collector, TAKE_WAIT))
            if share is not None:
                return share[0]
        raise TimeoutError(f"the mailbox never held post {seq}'s share of node {node}")

    def _ask(self, ask: Ask) -> None:
        """Hand the request to the local workers it goes to, in one write for all of them (the
        rows of a natively batched env share one mailbox: asked together, they answer with
        one reply; asked one by one, a row's reply would write over another's)."""
        local = ask.workers - self.first
        mine = local[(local >= 0) & (local < self.count)]
        if mine.size:
            self._asked[mine] = ask.request.id  # before the workers can answer
            self.link.send_request(mine, ask.request)
            self.link.notify(mine)

    def _down(self) -> None:
        assert self._channel is not None
        while not self._stopped:
            try:
                post = self._channel.recv()
            except (OSError, EOFError, WireError):  # the main process closed the link, is gone, or garbled it
                return
            try:
                self._deliver(post)
            except Exception:  # one post lost (its workers never acknowledge it), not the later ones
                if self._stopped:
                    return
                traceback.print_exc()  # into the actor's log

    def _watch(self, applied: bool) -> None:
        """Wake the *up* thread at each acknowledgement of one kind: received, or applied
        (which a failure and a gather answer release too)."""
        while not self._stopped:
            try:
                woken = self.link.wait_acks(HEARTBEAT, applied=applied)
            except Exception:  # the link closed under a collector shutting down
                return
            if woken:
                self._woken.set()

    def _up(self) -> None:
        last = 0.0
        while not self._stopped:
            self._woken.wait(HEARTBEAT)
            if self._stopped:
                return
            self._woken.clear()  # before reading statuses: an ack after this wakes us again
            now = time.monotonic()
            statuses = self._statuses()
            if self._reported is None or not np.array_equal(statuses, self._reported) or now - last >= HEARTBEAT:
                with contextlib.suppress(Exception):
                    self._report(statuses)
                last = now

    def _statuses(self) -> np.ndarray:
        """The acknowledgement columns of the workers (:data:`~envsync.links.ray_wire.ACKS`)."""
        self._read_replies()
        received, applied, failed, reached = self.link.acks_columns()
        alive = self.link.alive_slots(np.arange(self.count)).astype(np.int64)
        return np.stack([received, applied, failed, alive, self._answered, reached])

    def _read_replies(self) -> None:
        """Read the answers that came to the requests not reported yet: once per request for
        every worker that waits on it (a rows reply is decoded once, not once per row)."""
        waiting = (self._asked > self._answered) & (self._asked > 0)
        for asked in np.unique(self._asked[waiting]).tolist():
            workers = np.flatnonzero(waiting & (self._asked == asked))
            for rows, reply in self.link.replies(workers, asked):
                self._fresh.append((rows, reply))
                self._answered[rows] = reply.id

    def _report(self, statuses: np.ndarray) -> None:
        failed = statuses[ACKS.index("failed")]
        errors = self.link.error_texts(np.flatnonzero(failed != self._sent_failures))
        self._sent_failures = failed.copy()
        fresh, self._fresh = self._fresh, []
        assert self._channel is not None
        self._channel.send((statuses, errors, [(rows, plain(reply)) for rows, reply in fresh]))
        self._reported = statuses
