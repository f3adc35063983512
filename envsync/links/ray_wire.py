"""What moves between the main process and the relays (on their connections,
:mod:`envsync.links.ray_channel`, and through the object store): one node's rows and their
encoding (:func:`encode`), the posts as they travel (:func:`post`, :func:`read_post`), the
relays' reports (:data:`ACKS`, :func:`read_report`) and the count of what
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
import torch

from envsync.errors import WireError
from envsync.links.base import Key
from envsync.links.mailbox import Ask, Held
from envsync.links.records import as_numpy, plain, reply_of, request_of
from envsync.protocol import Reply
from envsync.state import Leaf

Chunk = tuple[np.ndarray, int, int, dict[Key, Leaf], dict[Key, Leaf]]
"""The rows of one write, as columns: the link workers written (int64, distinct), the
version, the undo mark, the leaves every one of them gets (one value each), and the leaves
with one row per worker (leading dim: the workers)."""
Rows = list[Chunk]
"""One node's share of a push: its chunks, in the order they were written (a later chunk
writes over an earlier one's leaves where both hold a worker)."""
ACKS = ("received", "applied", "failed", "alive", "answered", "reached")
"""The rows of a relay's acknowledgement columns, per local worker: what it received,
applied and failed last, whether its process lives (1 or 0), the latest request it answered
and the version it reached."""
Answer = tuple[np.ndarray, Reply]
"""A reply of rows: the local workers it answers (int64, distinct) and one reply whose
values hold one row per worker, in order (a failure: every worker's)."""
Report = tuple[np.ndarray, list[tuple[np.ndarray, str]], list[Answer]]
"""A relay's report: its acknowledgement columns (:data:`ACKS` x its workers, int64), the
tracebacks of new failures (each once, with the local workers whose failure it is) and its
answers to requests (their values as numpy arrays on the connection,
:func:`envsync.links.records.plain`)."""


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


class Answers:
    """The main process's store of answers to requests: each worker's latest, kept as the
    reply of rows it came in (one per relay per report, not one per worker), with each
    worker's row in it.

    Examples:
        >>> import torch
        >>> answers = Answers(4)
        >>> answers.add(2, [(np.array([0, 1]), Reply(7, {"x": torch.tensor([5.0, 6.0])}))])
        >>> [(rows.tolist(), reply.result["x"].tolist()) for rows, reply in answers.of(np.array([3, 0]), 7)]
        [([3], [6.0])]
    """

    def __init__(self, workers: int) -> None:
        self._kept: dict[int, Reply] = {}  # by number, while some worker's latest answer is in it
        self._number = np.full(workers, -1, dtype=np.int64)  # per worker, the number of its latest answer
        self._row = np.zeros(workers, dtype=np.int64)  # and its row in that answer
        self._count = 0

    def add(self, first: int, answers: list[Answer]) -> None:
        """Keep the answers of a report whose local worker 0 is link worker ``first``."""
        for rows, reply in answers:
            self._count += 1
            self._kept[self._count] = reply
            self._number[rows + first] = self._count
            self._row[rows + first] = np.arange(len(rows))
        if answers:  # an answer that is no worker's latest any more is dropped
            latest = set(np.unique(self._number).tolist())
            self._kept = {n: reply for n, reply in self._kept.items() if n in latest}

    def of(self, workers: np.ndarray, request: int) -> list[tuple[np.ndarray, Reply]]:
        """The replies of rows of ``workers`` (int64) that answered ``request`` (those that did not
        yet are left out): per answer they came in, the workers and their rows of it."""
        out = []
        numbers = self._number[workers]
        for number in np.unique(numbers[numbers >= 0]).tolist():
            reply = self._kept[number]
            if reply.id != request:
                continue
            mine = workers[numbers == number]
            if reply.failed:
                out.append((mine, reply))
                continue
            at = torch.from_numpy(self._row[mine])
            out.append((mine, Reply(reply.id, {k: v.index_select(0, at) for k, v in reply.result.items()})))
        return out


def encode(rows: Rows) -> Rows:
    """``rows`` with every tensor as a numpy view where numpy has its dtype.

    Ray stores numpy arrays out of band, and every process of a node that gets the object
    maps them from that node's object store instead of copying them (it copies torch
    tensors): the node receives the object once, and each relay copies only its own
    workers' rows out of it. A tensor in several chunks stays one array, stored once.

    Examples:
        >>> import torch
        >>> shared, workers = {("env_state", "x"): torch.ones(2)}, np.arange(2)
        >>> out = encode([(workers, 1, 0, shared, {}), (workers, 2, 0, shared, {})])
        >>> type(out[0][3]["env_state", "x"]).__name__, out[0][3]["env_state", "x"] is out[1][3]["env_state", "x"]
        ('ndarray', True)
    """
    memo: dict[int, Leaf] = {}

    def one(value: Leaf) -> Leaf:
        if isinstance(value, np.ndarray):
            return value
        if id(value) not in memo:
            memo[id(value)] = as_numpy(value)
        return memo[id(value)]

    return [
        (workers, version, undo, {k: one(v) for k, v in shared.items()}, {k: one(v) for k, v in rows.items()})
        for workers, version, undo, shared, rows in rows
    ]


def coalesce(rows: Rows, workers: int) -> Rows:
    """``rows`` (encoded, of a link of ``workers`` workers) as chunks that each hold a worker
    once: where chunks overlap (a starting state and the writes on top of it before the first
    post), each worker gets one write, at its latest chunk's version, of every leaf its
    chunks hold (a later chunk's value over an earlier's), as a sender that buffered each
    worker's leaves would write it; the workers that are in the same chunks stay one chunk,
    and the chunks go in the order of their versions.

    Examples:
        >>> x, y = ("config", "x"), ("config", "y")
        >>> start = (np.arange(3), 0, 0, {x: np.zeros(()), y: np.zeros(())}, {})
        >>> out = coalesce([start, (np.array([2, 0]), 4, 0, {}, {y: np.array([2.0, 0.5])})], 3)
        >>> [(c[0].tolist(), c[1], sorted(c[3]), c[4].get(y, np.zeros(0)).tolist()) for c in out]
        [([1], 0, [('config', 'x'), ('config', 'y')], []), ([0, 2], 4, [('config', 'x')], [0.5, 2.0])]
    """
    if len(rows) < 2:
        return rows
    member = np.zeros((workers, len(rows)), dtype=bool)
    for at, (chunk_workers, *_) in enumerate(rows):
        member[chunk_workers, at] = True
    if member.sum(axis=1).max() <= 1:  # each worker in one chunk at most: as they are
        return rows
    positions = []
    for chunk_workers, *_ in rows:
        position = np.full(workers, -1, dtype=np.int64)
        position[chunk_workers] = np.arange(len(chunk_workers))
        positions.append(position)
    patterns, group = np.unique(member, axis=0, return_inverse=True)
    out: Rows = []
    for number, pattern in enumerate(patterns):
        chosen = np.flatnonzero(pattern)
        if not chosen.size:
            continue
        ids = np.flatnonzero(group.ravel() == number)
        shared: dict[Key, Leaf] = {}
        per_row: dict[Key, Leaf] = {}
        for at in chosen.tolist():
            _, _, _, chunk_shared, chunk_rows = rows[at]
            for key, value in chunk_shared.items():
                per_row.pop(key, None)
                shared[key] = value
            for key, value in chunk_rows.items():
                shared.pop(key, None)
                per_row[key] = value[positions[at][ids]]
        _, version, undo, _, _ = rows[int(chosen[-1])]
        out.append((ids, version, undo, shared, per_row))
    # in the order of their versions: the latest is written last (a link's count of the
    # latest version written never goes back)
    return sorted(out, key=lambda chunk: chunk[1])


def take(chunk: Chunk, mask: np.ndarray) -> Chunk | None:
    """The part of ``chunk`` (encoded) for the workers where ``mask`` (a bool per worker of
    the chunk) holds; ``None`` for none of them.

    Examples:
        >>> chunk = (np.arange(3), 1, 0, {}, {("config", "x"): np.arange(3.0)})
        >>> part = take(chunk, np.array([False, True, True]))
        >>> part[0].tolist(), part[4]["config", "x"].tolist(), take(chunk, np.zeros(3, dtype=bool))
        ([1, 2], [1.0, 2.0], None)
    """
    if mask.all():
        return chunk
    if not mask.any():
        return None
    workers, version, undo, shared, rows = chunk
    return workers[mask], version, undo, shared, {k: v[mask] for k, v in rows.items()}


def rows_bytes(rows: Rows) -> int:
    """The bytes of the leaves of a share, counted per worker (a leaf every worker of a chunk
    gets counts once for each of them, as if each held its own copy)."""
    return sum(
        len(workers) * sum(int(v.nbytes) for v in shared.values()) + sum(int(v.nbytes) for v in per_row.values())
        for workers, _, _, shared, per_row in rows
    )


def share_id(seq: int, node: int, share: Any) -> str:
    """The id :class:`Traffic` counts a node's share of post ``seq`` under: its object's id,
    or, for a share carried in the post, one named after the post and node.

    Examples:
        >>> share_id(3, 1, [])
        'post-3-node-1'
    """
    return f"post-{seq}-node-{node}" if isinstance(share, list) else str(share.hex())


def post(seq: int, body: Rows | Held | Ask) -> tuple[int, Any]:
    """Post ``seq`` as it travels on a connection: rows as they are, a mailbox record as a
    tagged tuple of plain values (read back by :func:`read_post`).

    Examples:
        >>> from envsync.protocol import Kind, Request
        >>> post(3, Held(1)), post(4, Ask(np.array([0, 1]), Request(2, Kind.ENV_STATE, {"names": ["norm"]})))
        ((3, ('held', 1)), (4, ('ask', array([0, 1]), ('request', 2, 1, {'names': ['norm']}))))
    """
    if isinstance(body, Held):
        return seq, ("held", body.node)
    if isinstance(body, Ask):
        return seq, ("ask", body.workers, plain(body.request))
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
        case (int() as seq, list() as chunks):
            return seq, [_chunk(seq, chunk) for chunk in chunks]
        case (int() as seq, ("held", int() as node)):
            return seq, Held(node)
        case (int() as seq, ("ask", np.ndarray() as workers, value)) if workers.dtype == np.int64 and workers.ndim == 1:
            return seq, Ask(workers, request_of(value))
        case (int() as seq, body):
            raise WireError(f"post {seq} is neither rows nor a mailbox record: {_short(body)}")
    raise WireError(f"not a post: {_short(message)}")


def _chunk(seq: int, value: Any) -> Chunk:
    """A chunk of post ``seq`` checked for its shape (:data:`Chunk`); :class:`WireError` else."""
    match value:
        case (np.ndarray() as workers, int() as version, int() as undo, dict() as shared, dict() as rows) if (
            workers.dtype == np.int64
            and workers.ndim == 1
            and all(isinstance(k, tuple) for k in (*shared, *rows))
            and all(isinstance(v, np.ndarray | torch.Tensor) for v in (*shared.values(), *rows.values()))
            and all(v.ndim and len(v) == len(workers) for v in rows.values())
        ):
            return workers, version, undo, shared, rows
    raise WireError(f"post {seq} has a chunk that is not rows: {_short(value)}")


def read_report(message: Any, workers: int) -> Report:
    """A relay's report (:data:`Report`) for its ``workers`` workers, checked
    for its shape, so that no peer can write outside its own workers' entries;
    :class:`WireError` for anything else.

    Examples:
        >>> acks = np.array([[1], [1], [0], [1], [0], [1]])
        >>> read_report((acks, [], []), 1)[0].ravel().tolist()
        [1, 1, 0, 1, 0, 1]
        >>> read_report((acks, [(np.array([5]), "boom")], []), 1)
        Traceback (most recent call last):
        ...
        envsync.errors.WireError: a report of 1 workers has an error (array([5]), 'boom')
    """
    match message:
        case (np.ndarray() as acks, list() as errors, list() as answers):
            pass
        case _:
            raise WireError(f"not a report: {_short(message)}")
    if acks.shape != (len(ACKS), workers) or acks.dtype != np.int64:
        raise WireError(f"a report of {workers} workers has acknowledgements of shape {acks.shape} ({acks.dtype})")
    for error in errors:
        match error:
            case (np.ndarray() as rows, str()) if _local(rows, workers):
                pass
            case _:
                raise WireError(f"a report of {workers} workers has an error {_short(error)}")
    out = []
    for answer in answers:
        match answer:
            case (np.ndarray() as rows, value) if _local(rows, workers):
                reply = reply_of(value)
                if not reply.failed and any(v.ndim == 0 or len(v) != len(rows) for v in reply.result.values()):
                    raise WireError(f"an answer of {len(rows)} workers has values of other lengths")
                out.append((rows, reply))
            case _:
                raise WireError(f"a report of {workers} workers has an answer {_short(answer)}")
    return acks, errors, out


def _local(rows: np.ndarray, workers: int) -> bool:
    """Whether ``rows`` are local workers of a relay of ``workers``: int64, 1-D, some, in range."""
    return bool(rows.dtype == np.int64 and rows.ndim == 1 and len(rows) and rows.min() >= 0 and rows.max() < workers)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
