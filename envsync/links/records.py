"""Requests and replies as they travel: plain tuples on a Ray connection, bytes in a slot's
request and reply areas, both by :mod:`envsync.links.ray_codec` (plain values and arrays,
never pickle).

A link moves records without reading their kind: adding a kind of request
(:class:`~envsync.protocol.Kind`) touches no link. What arrives is checked for its shape
(:func:`request_of`, :func:`reply_of`): anything else is a
:class:`~envsync.errors.WireError`.

Examples:
    >>> from envsync.protocol import Kind, Request, Reply
    >>> request_of(unseal(seal(plain(Request(3, Kind.ENV_STATE, {"names": ["a"]})))))
    Request(id=3, kind=<Kind.ENV_STATE: 1>, payload={'names': ['a']})
    >>> reply_of(unseal(seal(plain(Reply(3, {"a": torch.ones(2)}))))).result["a"]
    tensor([1., 1.])
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import torch

from envsync.errors import WireError
from envsync.links.ray_codec import pack, unpack
from envsync.links.table import ERROR_BYTES
from envsync.protocol import Kind, Reply, Request
from envsync.state import Leaf, numpy_view

ROWS = ":rows"
"""In a reply for many rows (a natively batched env's, :meth:`~envsync.links.rows_reader.RowsReader.reply`),
the slots its values' rows belong to, in order (no env-state name or attribute path has a colon)."""
_SIZES = struct.Struct("!QI")
"""A sealed record's header length and how many array buffers follow it."""
_LENGTH = struct.Struct("!Q")
KINDS = frozenset(int(kind) for kind in Kind)
"""The kinds a request may name."""


def plain(record: Request | Reply) -> tuple[Any, ...]:
    """A record as plain values and arrays (a reply's tensors as numpy arrays where numpy
    has their dtype, see :func:`wire`)."""
    if isinstance(record, Request):
        return ("request", record.id, int(record.kind), record.payload)
    return ("reply", record.id, wire(record.result), record.error)


def request_of(value: Any) -> Request:
    """The request :func:`plain` made; :class:`WireError` for anything else (an unknown kind
    included)."""
    match value:
        case ("request", int() as id_, int() as kind, dict() as payload) if kind in KINDS:
            return Request(id_, Kind(kind), payload)
    raise WireError(f"not a request: {_short(value)}")


def reply_of(value: Any) -> Reply:
    """The reply :func:`plain` made, its values as tensors of their own; :class:`WireError`
    for anything else."""
    match value:
        case ("reply", int() as id_, dict() as result, None) if all(
            isinstance(k, str) and isinstance(v, np.ndarray | torch.Tensor) for k, v in result.items()
        ):
            return Reply(id_, {k: unwire(v) for k, v in result.items()})
        case ("reply", int() as id_, {}, str() as error):
            return Reply(id_, {}, error)
    raise WireError(f"not a reply: {_short(value)}")


def as_rows(worker: int, reply: Reply) -> tuple[np.ndarray, Reply]:
    """One worker's reply as a reply of rows (:meth:`~envsync.links.base.Outbox.replies`):
    the worker, and its values with a row dim of one."""
    values = {k: torch.as_tensor(v).unsqueeze(0) for k, v in reply.result.items()}
    return np.array([worker], dtype=np.int64), Reply(reply.id, values, reply.error)


def row_of(reply: Reply, at: int) -> Reply:
    """The reverse of :func:`as_rows`: row ``at`` of a reply of rows as that worker's own
    reply (a failure is every row's as it is)."""
    return reply if reply.failed else reply._replace(result={k: v[at] for k, v in reply.result.items()})


def sealed_reply(reply: Reply, room: int, where: str) -> bytes:
    """``reply`` sealed for a reply area of ``room`` bytes (``where`` names the area): a
    traceback's end, as a failure's; a reply that does not fit is sent as a failure that says so."""
    if reply.error is not None:
        tail = reply.error.encode("utf-8", "replace")[-ERROR_BYTES:]
        reply = reply._replace(error=tail.decode("utf-8", "replace"))
    data = seal(plain(reply))
    if len(data) > room:
        text = f"the reply to request {reply.id} is {len(data)} bytes; {where} holds {room}"
        data = seal(plain(Reply(reply.id, {}, text)))
    return data


def seal(value: Any) -> bytes:
    """``value`` (plain values and arrays) as one byte string, for a slot's area."""
    header, raws = pack(value)
    sizes = _SIZES.pack(len(header), len(raws)) + b"".join(_LENGTH.pack(r.nbytes) for r in raws)
    return b"".join([sizes, header, *(bytes(r) for r in raws)])


def unseal(data: bytes | bytearray | memoryview) -> Any:
    """What :func:`seal` sealed (arrays on copies of their bytes)."""
    view = memoryview(data)
    try:
        size, count = _SIZES.unpack_from(view, 0)
        at = _SIZES.size
        lengths = [_LENGTH.unpack_from(view, at + i * _LENGTH.size)[0] for i in range(count)]
        at += count * _LENGTH.size
        header = bytes(view[at : at + size])
        at += size
        buffers = []
        for n in lengths:
            buffers.append(bytearray(view[at : at + n]))
            at += n
    except struct.error as exc:
        raise WireError(f"a sealed record is cut short ({len(view)} bytes)") from exc
    if at > len(view):
        raise WireError(f"a sealed record is cut short ({len(view)} bytes)")
    return unpack(header, buffers)


def wire(values: dict[str, torch.Tensor]) -> dict[str, Leaf]:
    """A reply's values as they travel: numpy arrays where numpy has the dtype.

    Examples:
        >>> type(wire({"x": torch.ones(2)})["x"]).__name__
        'ndarray'
    """
    return {name: as_numpy(value) for name, value in values.items()}


def unwire(value: Leaf) -> torch.Tensor:
    """A travelled value as a tensor of its own (the reverse of :func:`wire`).

    Examples:
        >>> unwire(wire({"x": torch.ones(2)})["x"])
        tensor([1., 1.])
    """
    return torch.from_numpy(np.array(value)) if isinstance(value, np.ndarray) else value.clone()


def as_numpy(value: torch.Tensor) -> Leaf:
    """``value`` as a numpy view where numpy has its dtype, else itself."""
    view = numpy_view(torch.as_tensor(value).detach())
    return value if view is None else view


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
