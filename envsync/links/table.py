"""The slot table both links lay out in one block of bytes: per worker (slot), twenty int64
counters and one view per leaf of the desired state, and for every config name a write
count (a worker copies out only the names written since it last read); per group of slots
(the rows of one natively batched env in one process; a slot alone otherwise) one mailbox: an
error area, a request area and a reply area (a request and its reply as sealed records,
:mod:`envsync.links.records`: the link never reads their kind). The rows that failed one
apply share one error text (each row's ``error_at`` names where it lies: a mailbox keeps its
latest failures' texts one after the other); a request to rows is written once (each row's
``ask_at`` names the slot that holds it), and the rows answer it with one reply for all of
them (each row's ``reply_at`` names the slot whose mailbox holds it): no area per world, so a
group's mailbox is sized for its rows (:func:`reply_bytes` for the first,
:func:`row_reply_bytes` for each other). After the slots, one broadcast region per config
name and env-state entry: a value pushed to every worker of the link is written there once,
and each worker's "source" mark tells it to read that name from the region (config and env
state take the same path).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from envsync.links.base import BROADCAST, Key
from envsync.protocol import WorkerStatus
from envsync.state import Leaf, numpy_view, tensor_of

ERROR_BYTES = 16384
"""The most of a failure's traceback text kept (its end, with its length)."""
ERROR_AREA = 2 * ERROR_BYTES
"""Bytes of a mailbox's error area: the texts of its latest failures, one after the other
(each a length and the text; wrapping to the start when the next does not fit)."""
REQUEST_BYTES = 16384
"""Bytes of a sealed request (its kind and payload: names, paths)."""
COUNTERS = (
    "target",
    "received",
    "applied",
    "failed",
    "error_end",
    "pid",
    "busy",
    "undo",
    "ask",
    "ask_len",
    "answered",
    "ran",
    "obs",
    "reply_len",
    "reached",
    "wake_to",
    "relay_to",
    "reply_at",
    "ask_at",
    "error_at",
)
ALIGN = 64
_LENGTH = 4
"""Bytes of an error text's length, before it in a mailbox's error area."""
MARKS = ("source", "config_source", "writes")
"""The sections of per-worker int64 marks (beside the leaves of the desired state)."""


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` (on this machine) still runs: it exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc: existence is all we can tell


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Field:
    """One array of the table: a counter, the error buffer, or a leaf (with a worker dim)."""

    key: tuple[str, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * torch.empty((), dtype=self.dtype).element_size()


def plan(leaves: Mapping[Key, Leaf], num_workers: int, group: int = 1) -> tuple[list[Field], int]:
    """Lay out counters, mailboxes (one per ``group`` consecutive slots) and leaves, each
    64-byte aligned; return fields and size.

    Examples:
        >>> fields, size = plan({("config", "x"): torch.zeros(2)}, 3)
        >>> [f.key for f in fields][-3:], size % 64
        ([('leaf', 'writes', 'x'), ('leaf', 'config_source', 'x'), ('broadcast', 'config', 'x')], 0)
        >>> _, alone = plan({("config", "x"): torch.zeros(())}, 4096)
        >>> _, rows = plan({("config", "x"): torch.zeros(())}, 4096, group=4096)
        >>> alone // 4096 > 100_000, rows // 4096 < 2_000   # bytes a slot: a mailbox each, or one for all
        (True, True)
    """
    fields = [
        Field(("pushed",), torch.int64, (1,), 0),  # the latest version written to any slot
        Field(("asked",), torch.int64, (1,), 8),  # how many requests were written to any slots
    ]
    offset = ALIGN
    for name in COUNTERS:
        fields.append(Field((name,), torch.int64, (num_workers,), offset))
        offset = align(offset + 8 * num_workers)
    groups = -(-num_workers // group)
    reply = reply_bytes(leaves) + (group - 1) * row_reply_bytes(leaves)
    for text, size in (("error", ERROR_AREA), ("request", REQUEST_BYTES), ("reply", reply)):
        fields.append(Field((text,), torch.uint8, (groups, size), offset))
        offset = align(offset + groups * size)
    mark = torch.zeros((), dtype=torch.int64)
    marks = {("source", k[1]): mark for k in leaves if k[0] == "env_state"}
    marks |= {(kind, k[1]): mark for k in leaves if k[0] == "config" for kind in ("writes", "config_source")}
    for key, leaf in {**leaves, **marks}.items():
        value = tensor_of(leaf)
        field = Field(("leaf", *key), value.dtype, (num_workers, *value.shape), offset)
        fields.append(field)
        offset = align(offset + field.nbytes)
    for key, leaf in leaves.items():  # the broadcast region: one copy for every worker
        if key[0] in BROADCAST:
            value = tensor_of(leaf)
            field = Field(("broadcast", *key), value.dtype, tuple(value.shape), offset)
            fields.append(field)
            offset = align(offset + field.nbytes)
    return fields, max(offset, ALIGN)


ATTRIBUTE_BYTES = 65536
"""Room in a reply beyond an env's entries: what it holds at attribute paths (one world's
masses, a gravity), with their names."""


ROW_ATTRIBUTE_BYTES = 1024
"""Room in a rows reply for each row beyond the first, beyond its env-state entries: its
values at attribute paths (a world's masses and inertias, say); a read of more a world is
answered with a failure that says so (ask for fewer paths, or fewer envs, at a time)."""


def row_reply_bytes(leaves: Mapping[Key, Leaf]) -> int:
    """Bytes a rows reply may take for each row beyond the first: its index, its env-state
    entries and :data:`ROW_ATTRIBUTE_BYTES` of values at attribute paths (the names and the
    record's header are the reply's once, in :func:`reply_bytes`' room).

    Examples:
        >>> row_reply_bytes({("env_state", "loc"): torch.zeros(4)})
        1048
    """
    return 8 + ROW_ATTRIBUTE_BYTES + sum(tensor_of(v).nbytes for k, v in leaves.items() if k[0] == "env_state")


def reply_bytes(leaves: Mapping[Key, Leaf]) -> int:
    """Bytes of a slot's reply area: room for every env-state entry with its name, or for
    :data:`ATTRIBUTE_BYTES` of values at attribute paths, or a traceback.

    Examples:
        >>> reply_bytes({("env_state", "loc"): torch.zeros(4)}) > ERROR_BYTES + ATTRIBUTE_BYTES
        True
    """
    entries = sum(tensor_of(v).nbytes + 128 + len(k[1]) for k, v in leaves.items() if k[0] == "env_state")
    return align(ERROR_BYTES + ATTRIBUTE_BYTES + entries)


class Table:
    """Typed views of the block: numpy counters, the error buffer, and every leaf as a column
    of all slots (``leaf_columns``, tensors; ``numpy_columns``, ``None`` where numpy lacks the
    dtype). A slot's views are made when asked for (:meth:`slot`, :meth:`array`), never one
    set per slot up front: a natively batched env of 65,536 worlds has as many slots. Small
    leaves and marks move through numpy, which costs far less than a torch call when the
    caches are cold."""

    def __init__(
        self, raw: torch.Tensor, fields: list[Field], num_workers: int, *, group: int = 1, name: str = ""
    ) -> None:
        self.raw = raw
        self.name = name or f"memory-{id(self)}"  # the link's, the same in every process that maps it
        self.num_workers = num_workers
        self.group = group
        """Consecutive slots that share one mailbox (:func:`plan`'s ``group``)."""
        arrays = {f.key: raw[f.offset : f.offset + f.nbytes].view(f.dtype).view(f.shape) for f in fields}
        self.counters = {name: arrays[(name,)].numpy() for name in COUNTERS}
        self.pushed = arrays[("pushed",)].numpy()
        """The latest version written to any slot (one integer: whether anything was pushed
        to a worker's envs since it last looked costs one read, whatever their number)."""
        self.asked = arrays[("asked",)].numpy()
        """How many requests were written to any slots (one integer: whether a gather came to a
        worker's envs since they last found none asked costs one read)."""
        self.error = arrays[("error",)].numpy()
        self.areas = {area: arrays[(area,)].numpy() for area in ("request", "reply")}
        leaves = {(k[1], k[2]): v for k, v in arrays.items() if k[0] == "leaf"}
        # every slot's value of a leaf at once (a push to all workers sets a mark in one write;
        # a natively batched env's rows read theirs together)
        self.leaf_columns: dict[Key, torch.Tensor] = leaves
        self.numpy_columns = {k: numpy_view(v) for k, v in leaves.items()}
        self.columns = {k: v for k, v in self.numpy_columns.items() if k[0] in MARKS and v is not None}
        self.broadcast: dict[Key, torch.Tensor] = {(k[1], k[2]): v for k, v in arrays.items() if k[0] == "broadcast"}
        self.broadcast_arrays = {k: numpy_view(v) for k, v in self.broadcast.items()}

    @staticmethod
    def source(key: Key) -> Key:
        """The mark of a leaf that tells where its worker reads it: 0 its slot, else (the
        version that wrote it) the broadcast region."""
        return ("source", key[1]) if key[0] == "env_state" else ("config_source", key[1])

    def slot(self, worker: int) -> dict[Key, torch.Tensor]:
        """Views of every leaf of ``worker``'s slot (made now: a one-slot end keeps them)."""
        return {k: v[worker] for k, v in self.leaf_columns.items()}

    def columns_of(self, key: Key) -> np.ndarray:
        """Every slot's value of an int64 leaf (a stamp) at once, as a numpy view."""
        return self.leaf_columns[key].numpy()

    def numpy_row(self, worker: int, key: Key) -> np.ndarray | None:
        """The numpy view of ``worker``'s value of a leaf (``None`` where numpy lacks its dtype)."""
        column = self.numpy_columns[key]
        return None if column is None else column[worker, ...]

    def array(self, worker: int, key: Key) -> np.ndarray:
        """The numpy view of a leaf whose dtype numpy has (every stamp and mark)."""
        view = self.numpy_row(worker, key)
        if view is None:
            raise TypeError(f"leaf {key} has a dtype numpy lacks")
        return view

    def status(self, worker: int) -> WorkerStatus:
        c = self.counters
        target, received, applied = int(c["target"][worker]), int(c["received"][worker]), int(c["applied"][worker])
        return WorkerStatus(worker, target, received, applied, int(c["failed"][worker]), int(c["reached"][worker]))

    def box(self, slots: Any) -> Any:
        """The mailbox of ``slots`` (an int, or an int64 array): its group's number."""
        return slots // self.group

    def area(self, kind: str, slot: int) -> np.ndarray:
        """The ``"request"`` or ``"reply"`` area of ``slot``'s mailbox (a view)."""
        return self.areas[kind][self.box(slot)]

    def reply_span(self, first: int, last: int) -> np.ndarray:
        """The reply areas of the mailboxes of slots ``first`` to ``last`` (included) as one
        byte buffer (a view: a rows reply spans them; one mailbox for the rows of a group)."""
        return self.areas["reply"][self.box(first) : self.box(last) + 1].reshape(-1)

    def write_error(self, workers: int | np.ndarray, text: str) -> None:
        """Write ``text``'s end as the error of ``workers`` (one, or many: the rows of a
        natively batched env that failed one apply): once, after the latest text in the first
        one's mailbox, every one's ``error_at`` naming where (a failure of 65,536 rows touches
        one page, not 65,536; the earlier failures of the mailbox's other rows keep their texts
        until :data:`ERROR_AREA` bytes of newer ones have come after them)."""
        data = text.encode("utf-8", errors="replace")[-(ERROR_BYTES - _LENGTH) :]
        rows = np.atleast_1d(np.asarray(workers, dtype=np.int64))
        box = self.box(int(rows[0]))
        first = box * self.group  # the mailbox's cursor is its first slot's counter
        start = int(self.counters["error_end"][first])
        if start + _LENGTH + len(data) > ERROR_AREA:
            start = 0
        record = len(data).to_bytes(_LENGTH, "little") + data
        self.error[box, start : start + len(record)] = np.frombuffer(record, dtype=np.uint8)
        self.counters["error_end"][first] = start + len(record)
        self.counters["error_at"][rows] = box * ERROR_AREA + start + 1

    def error_text(self, worker: int) -> str:
        """The error text of ``worker`` (where its ``error_at`` names; none before a failure)."""
        at = int(self.counters["error_at"][worker])
        if at == 0:
            return ""
        area = self.error.reshape(-1)
        start = at - 1
        length = int.from_bytes(bytes(area[start : start + _LENGTH]), "little")
        return bytes(area[start + _LENGTH : start + _LENGTH + length]).decode("utf-8", errors="replace")
