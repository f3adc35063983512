"""What the Ray link's connections carry (envsync.links.ray_codec): plain values and arrays,
exactly, without pickle; anything else is refused."""

from __future__ import annotations

import contextlib
import os
import pickle
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from envsync import EnvSyncError
from envsync.errors import WireError
from envsync.links.ray_codec import MAX_DEPTH, pack, unpack


def trip(header: bytes, buffers: list[Any]) -> Any:
    """What arrives: each buffer read into a bytearray of its own, as the connection does."""
    return unpack(header, [bytearray(bytes(b)) for b in buffers])


def same(a: Any, b: Any) -> bool:
    """Equal, with the same types all the way down (arrays: dtype, shape and bytes)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and bytes(a.contiguous().view(-1).view(torch.uint8).numpy())
            == bytes(b.contiguous().view(-1).view(torch.uint8).numpy())
        )
    if isinstance(a, float):
        return struct.pack("!d", a) == struct.pack("!d", b)  # nan, -0.0: bit for bit
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


ARRAYS = [
    np.arange(6, dtype=np.float32).reshape(2, 3),
    np.arange(5, dtype=np.int64) - 2**40,
    np.array([True, False, True]),
    np.arange(4, dtype=np.float16),
    np.arange(4, dtype=np.float64) / 3,
    np.arange(4, dtype=np.uint8),
    np.arange(3, dtype=np.int8) - 1,
    np.array([1 + 2j, -3j], dtype=np.complex64),
    np.arange(3, dtype=">f4"),  # big-endian
    np.array(9.8, dtype=np.float32),  # 0-d
    np.zeros((0, 3), dtype=np.int32),  # no items
    np.arange(12.0).reshape(3, 4)[:, ::2],  # not contiguous
    np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
    np.array([np.nan, -0.0, np.inf]),
]
TENSORS = [
    torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
    torch.tensor(1.5, dtype=torch.bfloat16),  # 0-d
    torch.zeros(0, 2, dtype=torch.bfloat16),
    torch.arange(4, dtype=torch.float32),
    torch.tensor([True, False]),
    torch.arange(8, dtype=torch.int64).reshape(2, 4).t(),  # not contiguous
]


@pytest.mark.parametrize("array", ARRAYS + TENSORS, ids=lambda a: f"{type(a).__name__}-{a.dtype}-{tuple(a.shape)}")
def test_arrays_of_every_allowed_dtype_arrive_exactly(array: Any) -> None:
    got = trip(*pack(array))
    assert same(np.array(array, order="C") if isinstance(array, np.ndarray) else array.contiguous(), got)
    assert same(array.tolist(), got.tolist())


def test_nested_plain_values_arrive_exactly() -> None:
    message = (
        12,
        {
            0: (
                3,
                0,
                {("env_state", "norm"): np.ones(3, np.float32), ("config", "g"): torch.ones(2, dtype=torch.bfloat16)},
            ),
            -1: [None, True, False, 0, -(2**63), 2**63, -(2**200), 1.5, float("nan"), -0.0, "", "é✓", b"", b"\x00\xff"],
            "nested": {"a": [(1, (2, [3, {"b": ()}]))], None: {}, 2.5: [], (1, "x"): "key as tuple"},
        },
        "caught up",
    )
    assert same(trip(*pack(message)), message)


def test_an_array_that_appears_several_times_travels_once_and_arrives_as_one() -> None:
    shared = np.arange(4.0)
    bf = torch.ones(3, dtype=torch.bfloat16)
    header, buffers = pack({0: shared, 1: shared, 2: bf, 3: [bf, shared]})
    assert len(buffers) == 2
    got = trip(header, buffers)
    assert got[0] is got[1] is got[3][1] and got[2] is got[3][0]


def test_arrays_travel_without_copies_on_either_side() -> None:
    array = np.arange(2**16, dtype=np.float32)
    tensor = torch.arange(2**10, dtype=torch.bfloat16)
    header, buffers = pack([array, tensor])
    # sent from the arrays' own memory
    assert np.shares_memory(np.frombuffer(buffers[0], np.uint8), array)
    assert np.frombuffer(buffers[1], np.uint8).ctypes.data == tensor.data_ptr()
    # built on the received buffers, writable
    received = [bytearray(bytes(b)) for b in buffers]
    got_array, got_tensor = unpack(header, received)
    assert got_array.ctypes.data == np.frombuffer(received[0], np.uint8).ctypes.data
    assert got_tensor.data_ptr() == np.frombuffer(received[1], np.uint8).ctypes.data
    assert got_array.flags.writeable
    got_tensor.add_(1)  # a tensor of its own to write, no warning about a read-only buffer


class Gadget:
    def __reduce__(self) -> Any:
        return (os.system, ("echo pwned >&2",))


@dataclass
class Record:
    n: int


@pytest.mark.parametrize(
    "value",
    [
        Gadget(),
        Record(1),
        {1, 2},
        np.array([object()], dtype=object),
        np.array(["a"]),
        np.array([(1, 2.0)], dtype="i4,f8"),
        print,
    ],
    ids=["reduce-gadget", "dataclass", "set", "object-array", "str-array", "structured-array", "function"],
)
def test_anything_but_plain_values_and_arrays_is_refused_when_sent(value: Any) -> None:
    with pytest.raises(WireError, match="cannot travel"):
        pack({"x": [value]})


def test_a_pickle_that_would_run_code_is_refused_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    crafted_pickles = [pickle.dumps(Gadget(), protocol=p) for p in (0, 2, 5)]
    calls: list[Any] = []
    monkeypatch.setattr(os, "system", lambda *a: calls.append(a))
    for crafted in crafted_pickles:
        with pytest.raises(WireError, match="unknown tag") as raised:
            unpack(crafted, [])
        assert isinstance(raised.value, EnvSyncError)
    assert calls == []


def array_header(dtype: bytes, shape: tuple[int, ...], tag: bytes = b"a") -> bytes:
    return (
        tag
        + struct.pack("!I", len(dtype))
        + dtype
        + bytes((len(shape),))
        + b"".join(struct.pack("!Q", n) for n in shape)
    )


@pytest.mark.parametrize(
    ("header", "buffers", "why"),
    [
        (array_header(b"|O8", (1,)), [bytearray(8)], "may not travel"),
        (array_header(b"<U1", (1,)), [bytearray(4)], "may not travel"),
        (array_header(b"[('a', '<i4')]", (1,)), [bytearray(4)], "may not travel"),
        (array_header(b"_dynamo", (1,), b"x"), [bytearray(4)], "may not travel"),
        (array_header(b"<f4", (3,)), [bytearray(8)], "does not fit"),
        (array_header(b"<f4", (1,)), [], "more arrays than buffers"),
        (array_header(b"<f4", (2**63, 0)), [bytearray(0)], "shape"),
        (b"N", [bytearray(4)], "names 0 of the 1 buffers"),
        (b"NN", [], "bytes after the message"),
        (b"l\x00\x00\x00\x02N", [], "ends inside"),
        (b"s\x00\x00\x00\x09abc", [], "ends inside"),
        (b"q\x00\x00", [], "ends inside"),
        (b"", [], "ends inside"),
        (b"s\x00\x00\x00\x02\xff\xfe", [], "not UTF-8"),
        (b"d\x00\x00\x00\x01l\x00\x00\x00\x00N", [], "cannot key a dict"),
        (b"r\x00\x00\x00\x00", [], "before it came"),
        (b"l\x00\x00\x00\x01" * (MAX_DEPTH + 1) + b"N", [], "nests deeper"),
        (b"c__builtin__\neval\n", [], "unknown tag"),
    ],
)
def test_a_malformed_or_disallowed_header_is_refused_with_a_clear_error(
    header: bytes, buffers: list[bytearray], why: str
) -> None:
    with pytest.raises(WireError, match=why):
        unpack(header, buffers)


def test_nesting_deeper_than_allowed_is_refused_when_sent() -> None:
    deep: Any = None
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(WireError, match="nests deeper"):
        pack(deep)


plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.binary(),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(st.integers() | st.text() | st.tuples(st.text(), st.text()), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(plain)
def test_any_plain_value_round_trips(value: Any) -> None:
    assert same(trip(*pack(value)), value)


@settings(max_examples=300, deadline=None)
@given(plain, st.data())
def test_a_damaged_header_decodes_to_plain_values_or_raises_wire_error_only(value: Any, data: st.DataObject) -> None:
    header, buffers = pack([value, np.arange(3, dtype=np.int16), torch.ones(2, dtype=torch.bfloat16)])
    damaged = bytearray(header)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(damaged) - 1))
        damaged[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(damaged)))
    for attempt in (bytes(damaged), bytes(damaged[:cut])):
        with contextlib.suppress(WireError):
            trip(attempt, buffers)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_decode_to_plain_values_or_raise_wire_error_only(header: bytes) -> None:
    with contextlib.suppress(WireError):
        unpack(header, [bytearray(8)])


def test_arrays_of_as_many_dimensions_as_numpy_allows_arrive() -> None:
    assert trip(*pack(np.zeros((1,) * 32))).shape == (1,) * 32
