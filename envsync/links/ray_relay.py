"""The relay in each remote collector's actor: copies pushes from the object store into its
node's link, hands gather requests to its workers, and reports acknowledgements, failures,
gather answers and a heartbeat back to the mailbox (see :mod:`envsync.links.ray`)."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray

from envsync.links.base import SenderLink
from envsync.links.mailbox import Ask, Push
from envsync.links.ray_wire import Acks, Reply, Rows, Traffic, leaf_bytes, share_id, wire
from envsync.protocol import NO_FAILURE

HEARTBEAT = 0.5
"""Seconds between a relay's reports when nothing changes."""
POLL = 0.5
"""Seconds a long poll of the mailbox waits."""


@dataclass
class RelayHandle:
    """What a remote collector's actor needs to relay pushes: the mailbox and the layout
    (each collector's worker count, and the number of the node it runs on)."""

    mailbox: Any
    workers: list[int]
    nodes: list[int]

    def open(self, worker: int) -> Any:
        raise RuntimeError("a Ray link is read by relays (RelayHandle.relay), not opened by workers")

    def relay(self, collector: int, node_link: SenderLink) -> Relay:
        """The relay of remote collector ``collector``, writing into ``node_link``."""
        return Relay(self, collector, node_link)


class Relay:
    """Copies pushes (from the post, or from the object store) into one collector's link
    and reports back.

    It runs daemon threads (not actor methods: a non-async actor runs one task at a time,
    and the collector keeps a ``next()`` pending):

    * *down*: long-polls the mailbox; per push it takes its node's share (each node gets
      one, holding only its workers' rows: in the post when small, else one object that the
      relays of the node map from its object store) and writes its own workers into the
      link; per gather it asks its workers;
    * *up*: woken by two watchers, one per kind of acknowledgement semaphore of the link
      (a thread waits on one), it reports acknowledgements, failures with their traceback,
      gather answers, and a heartbeat, to the mailbox.

    Args:
        handle: the mailbox and layout.
        collector: this remote collector's index.
        node_link: the link to this collector's own workers.
    """

    def __init__(self, handle: RelayHandle, collector: int, node_link: SenderLink) -> None:
        self.mailbox = handle.mailbox
        self.collector = collector
        self.node = handle.nodes[collector]
        self.first = sum(handle.workers[:collector])
        self.count = handle.workers[collector]
        self.link = node_link
        self.traffic = Traffic()
        self._after = 0
        self._reported: list[Acks] | None = None
        self._sent_failures = [NO_FAILURE] * self.count
        self._asked: dict[int, tuple[int, list[str]]] = {}
        self._replied = [0] * self.count
        self._stopped = False
        self._woken = threading.Event()

    def start(self) -> None:
        """Deliver what is posted already (before the collector's first batch), then relay
        from daemon threads."""
        self._deliver(ray.get(self.mailbox.fetch.remote(self.collector, self.node, self._after, 0.0)))
        self._report()
        threading.Thread(target=self._down, name=f"envsync-relay-down-{self.collector}", daemon=True).start()
        threading.Thread(target=self._up, name=f"envsync-relay-up-{self.collector}", daemon=True).start()
        for kind in ("received", "applied"):
            name = f"envsync-relay-{kind}-{self.collector}"
            threading.Thread(target=self._watch, args=(kind == "applied",), name=name, daemon=True).start()

    def stop(self) -> None:
        self._stopped = True
        self._woken.set()  # the up thread ends now, without another report
        with contextlib.suppress(Exception):
            self.mailbox.forget.remote(self.collector)

    def _deliver(self, posts: list[tuple[int, Push | Ask]]) -> None:
        for seq, body in posts:
            if seq != self._after + 1:  # a fetch answered twice, or out of turn
                continue
            if isinstance(body, Ask):
                self._ask(body)
            elif (share := body.shares[self.node]) is not None:
                self._write(share, share_id(seq, self.node, share))
            self._after = seq

    def _write(self, share: Any, object_id: str) -> None:
        rows: Rows = share if isinstance(share, dict) else ray.get(share)
        mine = [w for w in range(self.first, self.first + self.count) if w in rows]
        for worker in mine:
            version, undo, entries = rows[worker]
            self.link.write(worker - self.first, version, entries, undo=undo)
            self.link.notify(worker - self.first)
        if mine:
            self.link.flush(rows[mine[-1]][0])
        self.traffic.add(object_id, sum(leaf_bytes(rows[w][2]) for w in mine))

    def _ask(self, ask: Ask) -> None:
        for worker, names in ask.names.items():
            local = worker - self.first
            if 0 <= local < self.count:
                self._asked[local] = (ask.request, names)  # before the worker can answer
                self.link.ask(local, ask.request, names)
                self.link.notify(local)

    def _down(self) -> None:
        while not self._stopped:
            try:
                self._deliver(ray.get(self.mailbox.fetch.remote(self.collector, self.node, self._after, POLL)))
            except Exception:
                if self._stopped:
                    return
                time.sleep(POLL)

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
            if self._changed() or now - last >= HEARTBEAT:
                with contextlib.suppress(Exception):
                    self._report()
                last = now

    def _statuses(self) -> list[Acks]:
        out = []
        for w in range(self.count):
            s = self.link.status(w)
            out.append((s.received, s.applied, s.failed, self.link.alive(w), self.link.answered(w)))
        return out

    def _changed(self) -> bool:
        return self._statuses() != self._reported

    def _replies(self, statuses: list[Acks]) -> dict[int, Reply]:
        """The answers to the requests workers answered since the last report."""
        out = {}
        for w, status in enumerate(statuses):
            request, names = self._asked.get(w, (0, []))
            if status[4] > self._replied[w] and status[4] == request:
                out[w] = (request, wire(self.link.read_reply(w, names)))
        return out

    def _report(self) -> None:
        statuses = self._statuses()
        errors = {}
        for w, (_, _, failed, _, _) in enumerate(statuses):
            if failed != self._sent_failures[w]:
                errors[w] = self.link.error_text(w)
                self._sent_failures[w] = failed
        replies = self._replies(statuses)
        self.mailbox.report.remote(self.collector, statuses, errors, replies)
        for w, (request, _) in replies.items():
            self._replied[w] = request
        self._reported = statuses
