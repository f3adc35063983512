"""How a message on a Ray link's connection is turned into bytes and back
(:mod:`envsync.links.ray_channel` frames them), without pickle.

A message is built of plain values (``None``, ``bool``, ``int``, ``float``, ``str``,
``bytes``, and ``tuple``, ``list`` and ``dict`` of them) and arrays: numpy arrays of a
number or bool dtype, and torch tensors (for the dtypes numpy lacks, such as bfloat16).
:func:`pack` writes the plain values into a small tagged *header*, one tag byte per value,
and stands each array there as its dtype, its shape and the index of its bytes, which travel
out of band: the buffers are views of the arrays' own memory (a copy is made only of an
array that is not contiguous). :func:`unpack` reads the header back and builds each array on
its received buffer (no copy). An array that appears several times in a message travels
once and is one array again on arrival.

Nothing here is pickled, so nothing a peer sends can name a function to call: a tag outside
the set below, a dtype outside :data:`NUMPY_DTYPES` or :data:`TORCH_DTYPES`, or any
malformed header raises :class:`~envsync.errors.WireError`. Records of the protocol (such as
:class:`~envsync.links.mailbox.Held`) travel as plain tuples, converted at the edges
(:mod:`envsync.links.ray_wire`).

Examples:
    >>> import numpy as np
    >>> header, buffers = pack({("env_state", "x"): np.arange(3), "n": (1, None, "a")})
    >>> len(buffers), bytes(buffers[0])[:8]
    (1, b'\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x00')
    >>> unpack(header, [bytearray(b) for b in buffers])
    {('env_state', 'x'): array([0, 1, 2]), 'n': (1, None, 'a')}
"""

from __future__ import annotations

import math
import struct
import sys
from typing import Any

import numpy as np

from envsync.errors import WireError

COUNT = struct.Struct("!I")
SIZED = struct.Struct("!cI")
"""A tag and a length (of a string, bytes, a container) or an index (of an array)."""
WORD = struct.Struct("!cq")
WORD_BODY = struct.Struct("!q")
REAL = struct.Struct("!cd")
REAL_BODY = struct.Struct("!d")
BYTE = struct.Struct("!B")
DIM = struct.Struct("!Q")
MAX_DEPTH = 64
"""How deeply containers may nest in a message (deeper is refused, not recursed into)."""
MAX_DIMS = 32

_CODES = ("?", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8", "c8", "c16")
NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    d.str: d for code in _CODES for d in (np.dtype(code).newbyteorder("<"), np.dtype(code).newbyteorder(">"))
}
"""The numpy dtypes an array may travel as, by ``dtype.str`` (numbers and bools: never
``object``, whose items would be Python objects)."""
TORCH_DTYPES = (*(np.dtype(code).name for code in _CODES), "bfloat16", "float8_e4m3fn", "float8_e5m2")
"""The torch dtypes a tensor may travel as, by name (those of them this torch has)."""


def pack(message: Any) -> tuple[bytes, list[memoryview]]:
    """``message`` as a header and the out-of-band buffers of its arrays (views of their
    memory, in the order the header names them).

    Examples:
        >>> header, buffers = pack([1, b"x"])
        >>> header, buffers
        (b'l\\x00\\x00\\x00\\x02q\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x01y\\x00\\x00\\x00\\x01x', [])
    """
    packer = _Packer()
    packer.value(message, 0)
    return bytes(packer.out), packer.buffers


def unpack(header: bytes | bytearray | memoryview, buffers: list[bytearray]) -> Any:
    """The message :func:`pack` made, its arrays built on ``buffers`` (writable, not copied);
    :class:`~envsync.errors.WireError` when the header is malformed or names anything but
    plain values and arrays of an allowed dtype.

    Examples:
        >>> unpack(*pack({"a": [True, -(2**70)]}))
        {'a': [True, -1180591620717411303424]}
        >>> unpack(b"?", [])
        Traceback (most recent call last):
        ...
        envsync.errors.WireError: unknown tag b'?' at byte 0 of the header
    """
    reader = _Reader(header, buffers)
    try:
        value = reader.value(0)
    except (struct.error, IndexError):  # a fixed-size field, or a tag, past the header's end
        raise WireError(f"the header ends inside a value (byte {reader.pos})") from None
    if reader.pos != len(reader.data):
        raise WireError(f"{len(reader.data) - reader.pos} bytes after the message in its header")
    if reader.used != len(buffers):
        raise WireError(f"the header names {reader.used} of the {len(buffers)} buffers that came with it")
    return value


class _Packer:
    """Writes one message: a tag byte per value, dispatched on the value's exact type first
    (the common case, and the hot path of every push and report)."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.buffers: list[memoryview] = []
        self._arrays: dict[int, tuple[int, Any]] = {}  # id -> (buffer index, the array kept alive)

    def value(self, value: Any, depth: int) -> None:
        kind = type(value)
        if kind is str:  # the commonest values are written here, without another call
            data = value.encode()
            self.out += SIZED.pack(b"s", len(data))
            self.out += data
        elif kind is int and -(2**63) <= value < 2**63:
            self.out += WORD.pack(b"q", value)
        elif value is None or kind is bool:
            self.out += b"N" if value is None else b"T" if value else b"F"
        else:
            write = _WRITERS.get(kind)
            if write is None:
                self.other(value, depth)
            else:
                write(self, value, depth)

    def integer(self, value: int, depth: int) -> None:
        if -(2**63) <= value < 2**63:
            self.out += WORD.pack(b"q", value)
            return
        data = value.to_bytes((value.bit_length() + 8) // 8, "big", signed=True)
        if len(data) > 255:
            raise WireError("an integer over 255 bytes cannot travel")
        self.out += b"i" + bytes((len(data),)) + data

    def real(self, value: float, depth: int) -> None:
        self.out += REAL.pack(b"f", value)

    def text(self, value: str, depth: int) -> None:
        self.blob(value.encode(), depth, b"s")

    def blob(self, value: bytes | bytearray, depth: int, tag: bytes = b"y") -> None:
        self.out += SIZED.pack(tag, len(value))
        self.out += value

    def sequence(self, value: tuple[Any, ...] | list[Any], depth: int) -> None:
        if depth >= MAX_DEPTH:
            raise WireError(f"a message nests deeper than {MAX_DEPTH} containers")
        self.out += SIZED.pack(b"t" if isinstance(value, tuple) else b"l", len(value))
        for item in value:
            self.value(item, depth + 1)

    def mapping(self, value: dict[Any, Any], depth: int) -> None:
        if depth >= MAX_DEPTH:
            raise WireError(f"a message nests deeper than {MAX_DEPTH} containers")
        self.out += SIZED.pack(b"d", len(value))
        for key, item in value.items():
            self.value(key, depth + 1)
            self.value(item, depth + 1)

    def other(self, value: Any, depth: int) -> None:
        """A value of a subclass of a plain type, a numpy scalar, or a tensor."""
        for kind, write in _WRITERS.items():
            if isinstance(value, kind):
                write(self, value, depth)
                return
        if isinstance(value, np.generic) and value.dtype.kind in "biuf":  # e.g. a count read from a numpy table
            self.value(value.item(), depth)
        elif _is_tensor(value):
            self.tensor(value)
        else:
            raise WireError(f"a {type(value).__name__} cannot travel on a Ray link's connection")

    def _seen(self, value: Any) -> bool:
        """Whether ``value`` travels already in this message (then it is named by its index)."""
        known = self._arrays.get(id(value))
        if known is None:
            return False
        self.out += SIZED.pack(b"r", known[0])
        return True

    def _shape(self, tag: bytes, dtype: str, shape: tuple[int, ...], memory: memoryview, value: Any) -> None:
        self._arrays[id(value)] = (len(self.buffers), value)
        self.blob(dtype.encode(), 0, tag)
        self.out += bytes((len(shape),))
        for n in shape:
            self.out += DIM.pack(n)
        self.buffers.append(memory)

    def numpy(self, array: np.ndarray, depth: int) -> None:
        if self._seen(array):
            return
        dtype = array.dtype.str
        if dtype not in NUMPY_DTYPES:
            raise WireError(f"a numpy array of dtype {array.dtype} cannot travel")
        self._shape(b"a", dtype, array.shape, _raw(array), array)

    def tensor(self, tensor: Any) -> None:
        import torch

        if self._seen(tensor):
            return
        name = str(tensor.dtype).removeprefix("torch.")
        if name not in _torch_dtypes():
            raise WireError(f"a tensor of dtype {tensor.dtype} cannot travel")
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
        self._shape(b"x", name, tuple(tensor.shape), raw.numpy().data, tensor)


_WRITERS: dict[type, Any] = {
    int: _Packer.integer,
    float: _Packer.real,
    str: _Packer.text,
    bytes: _Packer.blob,
    bytearray: _Packer.blob,
    tuple: _Packer.sequence,
    list: _Packer.sequence,
    dict: _Packer.mapping,
    np.ndarray: _Packer.numpy,
}


def _raw(array: np.ndarray) -> memoryview:
    """The bytes of ``array`` in C order: a view of its memory (a copy only when it is not
    C-contiguous)."""
    if array.flags.c_contiguous and array.size:
        try:
            return array.data.cast("B")
        except (TypeError, ValueError):  # a format memoryview cannot cast (complex, big-endian)
            pass
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")  # no tensor can exist before torch is imported
    return torch is not None and isinstance(value, torch.Tensor)


_TORCH: dict[str, Any] = {}


def _torch_dtypes() -> dict[str, Any]:
    if not _TORCH:
        import torch

        _TORCH.update({n: getattr(torch, n) for n in TORCH_DTYPES if isinstance(getattr(torch, n, None), torch.dtype)})
    return _TORCH


class _Reader:
    """Reads one message back, dispatched on each value's tag byte; any tag, dtype, length
    or index that does not fit raises :class:`WireError`."""

    def __init__(self, data: bytes | bytearray | memoryview, buffers: list[bytearray]) -> None:
        self.data = data
        self.pos = 0
        self.buffers = buffers
        self.used = 0
        self.arrays: list[Any] = []

    def value(self, depth: int) -> Any:
        data, at = self.data, self.pos
        tag = data[at]
        if tag == _INT:  # the commonest values are read here, without another call
            self.pos = at + 9
            return WORD_BODY.unpack_from(data, at + 1)[0]
        if tag == _STR:
            self.pos = at + 5
            return self.decode(self.take(COUNT.unpack_from(data, at + 1)[0]))
        if tag in _CONSTANTS:
            self.pos = at + 1
            return _CONSTANTS[tag]
        read = _READERS.get(tag)
        if read is None:
            raise WireError(f"unknown tag {bytes(data[at : at + 1])!r} at byte {at} of the header")
        self.pos = at + 1
        return read(self, depth)

    def fixed(self, layout: struct.Struct) -> Any:
        """The next field of ``layout`` (``struct.error`` past the end: see :func:`unpack`)."""
        (value,) = layout.unpack_from(self.data, self.pos)
        self.pos += layout.size
        return value

    def take(self, n: int) -> bytes | bytearray | memoryview:
        if self.pos + n > len(self.data):
            raise WireError(f"the header ends inside a value (byte {self.pos}, {n} more wanted)")
        self.pos += n
        return self.data[self.pos - n : self.pos]

    def big(self, depth: int) -> int:
        return int.from_bytes(self.take(self.fixed(BYTE)), "big", signed=True)

    def real(self, depth: int) -> float:
        return float(self.fixed(REAL_BODY))

    def text(self, depth: int = 0) -> str:
        return self.decode(self.take(self.fixed(COUNT)))

    def decode(self, data: bytes | bytearray | memoryview) -> str:
        try:
            return str(data, "utf-8")
        except UnicodeDecodeError as e:
            raise WireError(f"a string in the header is not UTF-8: {e}") from None

    def blob(self, depth: int) -> bytes:
        return bytes(self.take(self.fixed(COUNT)))

    def items(self, depth: int) -> list[Any]:
        if depth >= MAX_DEPTH:
            raise WireError(f"a message nests deeper than {MAX_DEPTH} containers")
        return [self.value(depth + 1) for _ in range(self.fixed(COUNT))]

    def sequence(self, depth: int) -> tuple[Any, ...]:
        return tuple(self.items(depth))

    def mapping(self, depth: int) -> dict[Any, Any]:
        if depth >= MAX_DEPTH:
            raise WireError(f"a message nests deeper than {MAX_DEPTH} containers")
        out = {}
        for _ in range(self.fixed(COUNT)):
            key = self.value(depth + 1)
            value = self.value(depth + 1)
            try:
                out[key] = value
            except TypeError:
                raise WireError(f"a {type(key).__name__} cannot key a dict") from None
        return out

    def numpy(self, depth: int) -> np.ndarray:
        dtype = self.text()
        kind = NUMPY_DTYPES.get(dtype)
        if kind is None:
            raise WireError(f"a numpy dtype {dtype!r} may not travel")
        shape, buffer = self._shape(kind.itemsize)
        try:
            array = np.frombuffer(buffer, dtype=kind).reshape(shape)
        except ValueError as e:  # a shape numpy cannot hold, even of no items
            raise WireError(f"an array of shape {shape}: {e}") from None
        self.arrays.append(array)
        return array

    def tensor(self, depth: int) -> Any:
        import torch

        dtype = self.text()
        kind = _torch_dtypes().get(dtype)
        if kind is None:
            raise WireError(f"a torch dtype {dtype!r} may not travel")
        shape, buffer = self._shape(kind.itemsize)
        try:  # torch.frombuffer refuses an empty buffer
            tensor = torch.frombuffer(buffer, dtype=kind).reshape(shape) if buffer else torch.empty(shape, dtype=kind)
        except (RuntimeError, ValueError, OverflowError) as e:  # a shape torch cannot hold, even of no items
            raise WireError(f"a tensor of shape {shape}: {e}") from None
        self.arrays.append(tensor)
        return tensor

    def _shape(self, itemsize: int) -> tuple[tuple[int, ...], bytearray]:
        """The shape of the next array and its buffer, which it must fill exactly."""
        dims = self.fixed(BYTE)
        if dims > MAX_DIMS:
            raise WireError(f"an array of {dims} dimensions")
        shape = tuple(self.fixed(DIM) for _ in range(dims))
        if self.used >= len(self.buffers):
            raise WireError("the header names more arrays than buffers came")
        buffer = self.buffers[self.used]
        self.used += 1
        if math.prod(shape) * itemsize != len(buffer):
            raise WireError(f"an array of shape {shape} and {itemsize}-byte items does not fit its {len(buffer)} bytes")
        return shape, buffer

    def seen(self, depth: int) -> Any:
        index = self.fixed(COUNT)
        if index >= len(self.arrays):
            raise WireError(f"the header names array {index} before it came")
        return self.arrays[index]


_INT, _STR = ord("q"), ord("s")
_CONSTANTS = {ord("N"): None, ord("T"): True, ord("F"): False}
_READERS: dict[int, Any] = {  # "q" and "s" are read in _Reader.value itself
    ord(tag): read
    for tag, read in {
        "i": _Reader.big,
        "f": _Reader.real,
        "y": _Reader.blob,
        "t": _Reader.sequence,
        "l": _Reader.items,
        "d": _Reader.mapping,
        "a": _Reader.numpy,
        "x": _Reader.tensor,
        "r": _Reader.seen,
    }.items()
}
