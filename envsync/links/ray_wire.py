"""What moves between the main process and the relays (on their connections,
:mod:`envsync.links.ray_channel`, and through the object store): one node's rows and their
encoding (:func:`encode`), the posts as they travel (:func:`post`, :func:`read_post`), the
relays' reports (:data:`Acks`, :func:`read_report`) and the count of what
moved (:class:`Traffic`).

Everything here is tensors, numpy arrays, integers and strings: no user code is pickled. The
connection carries plain values and arrays only (:mod:`envsync.links.ray_codec`), so the
mailbox's records travel as tagged tuples, and what a relay reports is checked for its shape
before the main process reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from envsync.errors import WireError
from envsync.links.base import Key
from envsync.links.mailbox import Ask, Held
from envsync.links.records import as_numpy, plain, reply_of, request_of
from envsync.protocol import Reply
from envsync.state import Leaf

Rows = dict[int, tuple[int, int, dict[Key, Leaf]]]
"""One node's share of a push: link worker -> (version, undo mark, leaves)."""
Acks = tuple[int, int, int, bool, int, int]
"""One worker's report: ``(received, applied, failed, alive, answered, reached)``."""
Report = tuple[list[Acks], dict[int, str], dict[int, Reply]]
"""A relay's report, per local worker: its acks, the tracebacks of new failures and its
replies to requests (as :func:`envsync.links.records.plain` makes them on the connection:
their values numpy arrays, which the connection carries out of band)."""


INLINE = 64 * 1024
"""Bytes of leaves up to which a node's share of a push travels in the post itself to each
of the node's relays that has rows in it; a larger share does too when one relay of the node
has rows in it, and is otherwise put into the object store once for the node's relays to map
(which costs each of them one more round trip, to the mailbox)."""
CAUGHT_UP = "caught up"
"""What the main process sends a newly connected relay after the posts it missed."""


@dataclass
class Traffic:
    """What one end of the Ray link moved (read by tests and ``bench_ray.py``).

    An object is one node's share of one push (put into the object store, or carried in the
    post; see :data:`INLINE`). On the main process's side, per node: the objects
    made and the bytes of the leaves they hold (counted per worker). On a relay's side: the
    objects it took, the bytes of its own workers' leaves it decoded into its node's link,
    and the id of the latest object (:func:`share_id`).

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
        >>> import torch
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
            memo[id(value)] = as_numpy(value)
        return memo[id(value)]

    return {w: (version, undo, {k: one(v) for k, v in leaves.items()}) for w, (version, undo, leaves) in rows.items()}


def leaf_bytes(leaves: dict[Key, Leaf]) -> int:
    """The bytes of one worker's leaves."""
    return sum(int(v.nbytes) for v in leaves.values())


def share_id(seq: int, node: int, share: Any) -> str:
    """The id :class:`Traffic` counts a node's share of post ``seq`` under: its object's id,
    or, for a share carried in the post, one named after the post and node.

    Examples:
        >>> share_id(3, 1, {})
        'post-3-node-1'
    """
    return f"post-{seq}-node-{node}" if isinstance(share, dict) else str(share.hex())


def post(seq: int, body: Rows | Held | Ask) -> tuple[int, Any]:
    """Post ``seq`` as it travels on a connection: rows as they are, a mailbox record as a
    tagged tuple of plain values (read back by :func:`read_post`).

    Examples:
        >>> from envsync.protocol import Kind, Request
        >>> post(3, Held(1)), post(4, Ask({0: Request(2, Kind.ENV_STATE, {"names": ["norm"]})}))
        ((3, ('held', 1)), (4, ('ask', {0: ('request', 2, 1, {'names': ['norm']})})))
    """
    if isinstance(body, Held):
        return seq, ("held", body.node)
    if isinstance(body, Ask):
        return seq, ("ask", {worker: plain(request) for worker, request in body.requests.items()})
    return seq, body


def read_post(message: Any) -> tuple[int, Rows | Held | Ask]:
    """A received post (:func:`post`) with its mailbox record rebuilt; :class:`WireError` for
    anything else.

    Examples:
        >>> read_post((3, ("held", 1)))
        (3, Held(node=1))
        >>> read_post((4, "not rows"))
        Traceback (most recent call last):
        ...
        envsync.errors.WireError: post 4 is neither rows nor a mailbox record: 'not rows'
    """
    match message:
        case (int() as seq, dict() as rows):
            return seq, rows
        case (int() as seq, ("held", int() as node)):
            return seq, Held(node)
        case (int() as seq, ("ask", dict() as requests)) if all(isinstance(w, int) for w in requests):
            return seq, Ask({worker: request_of(value) for worker, value in requests.items()})
        case (int() as seq, body):
            raise WireError(f"post {seq} is neither rows nor a mailbox record: {_short(body)}")
    raise WireError(f"not a post: {_short(message)}")


def read_report(message: Any, workers: int) -> Report:
    """A relay's report (``(statuses, errors, replies)``) for its ``workers`` workers, checked
    for its shape, so that no peer can write outside its own workers' entries;
    :class:`WireError` for anything else.

    Examples:
        >>> read_report(([(1, 1, 0, True, 0, 1)], {}, {}), 1)
        ([(1, 1, 0, True, 0, 1)], {}, {})
        >>> read_report(([(1, 1, 0, True, 0, 1)], {5: "boom"}, {}), 1)
        Traceback (most recent call last):
        ...
        envsync.errors.WireError: a report of 1 workers names worker 5
    """
    match message:
        case (list() as statuses, dict() as errors, dict() as replies):
            pass
        case _:
            raise WireError(f"not a report: {_short(message)}")
    if len(statuses) != workers or not all(_is_acks(s) for s in statuses):
        raise WireError(f"a report of {workers} workers has statuses {_short(statuses)}")
    for entries in (errors, replies):
        for local in entries:
            if not (isinstance(local, int) and 0 <= local < workers):
                raise WireError(f"a report of {workers} workers names worker {_short(local)}")
    for local, text in errors.items():
        if not isinstance(text, str):
            raise WireError(f"a report's entry for worker {local} is {_short(text)}")
    return statuses, errors, {local: reply_of(value) for local, value in replies.items()}


def _is_acks(status: Any) -> bool:
    return isinstance(status, tuple) and len(status) == 6 and all(isinstance(n, int) for n in status)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
