"""The direct connection between the main process and a relay (no Ray cluster needed)."""

from __future__ import annotations

import os
import pickle
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from envsync.errors import WireError
from envsync.links import ray_channel
from envsync.links.ray_channel import HEADER, LENGTH, TOKEN_BYTES, Channel, Listener, connect
from envsync.links.ray_wire import CAUGHT_UP

UNPICKLED: list[str] = []


def trip() -> None:
    UNPICKLED.append("tripped")


class Tripwire:
    """Records being unpickled: nothing from a connection without the token may be."""

    def __reduce__(self) -> Any:
        return (trip, ())


def closed(peer: socket.socket) -> bool:
    try:
        return peer.recv(1) == b""
    except ConnectionResetError:  # closed with what it sent unread
        return True


@pytest.mark.timeout(30)
def test_a_connection_without_the_token_is_refused_before_anything_of_it_is_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ray_channel, "HELLO_TIMEOUT", 0.3)
    listener = Listener("127.0.0.1")
    try:
        wrong = socket.create_connection(listener.address)
        wrong.sendall(bytes(TOKEN_BYTES) + LENGTH.pack(0) + pickle.dumps(Tripwire()))
        assert listener.accept() is None
        silent = socket.create_connection(listener.address)  # never says anything
        assert listener.accept() is None
        assert UNPICKLED == []
        for peer in (wrong, silent):  # both were closed by the listener
            peer.settimeout(5)
            assert closed(peer)
            peer.close()
        right = connect(listener.address, listener.token, 7)
        accepted = listener.accept()
        assert accepted is not None and accepted[0] == 7
        right.close()
        accepted[1].close()
    finally:
        listener.close()


@pytest.mark.timeout(30)
def test_messages_arrive_whole_in_order_with_their_arrays_then_eof() -> None:
    listener = Listener("127.0.0.1")
    relay = connect(listener.address, listener.token, 0)
    accepted = listener.accept()
    assert accepted is not None
    main = accepted[1]
    big = np.random.default_rng(0).random(2**20)  # 8 MB: more than a socket buffer holds
    strided = np.arange(12.0).reshape(3, 4)[:, ::2]  # not contiguous: copied to travel
    messages = [(1, {"rows": big, "n": 3}), (2, strided), (3, "caught up"), (4, np.zeros(0, np.uint8))]
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.extend(relay.recv() for _ in messages))
    reader.start()
    for message in messages:
        main.send(message)
    reader.join(20)
    assert [m[0] for m in got] == [1, 2, 3, 4]
    assert np.array_equal(got[0][1]["rows"], big) and got[0][1]["n"] == 3
    assert got[0][1]["rows"].flags.writeable  # a buffer of its own, not a read-only view
    assert np.array_equal(got[1][1], strided) and got[2][1] == "caught up" and got[3][1].size == 0
    relay.send(("report", [1, 2]))  # and back up the same connection
    assert main.recv() == ("report", [1, 2])
    main.close()
    with pytest.raises(EOFError):
        relay.recv()
    relay.close()
    listener.close()


class Gadget:
    """A pickle that would run a shell command when unpickled."""

    def __reduce__(self) -> Any:
        return (os.system, ("echo pwned >&2",))


@pytest.mark.timeout(30)
def test_a_message_that_is_not_plain_values_and_arrays_is_refused_and_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    crafted = pickle.dumps(Gadget(), protocol=5)
    calls: list[Any] = []
    monkeypatch.setattr(os, "system", lambda *a: calls.append(a))
    a, b = socket.socketpair()
    a.sendall(HEADER.pack(len(crafted), 0) + crafted)
    with pytest.raises(WireError, match="unknown tag"):
        Channel(b).recv()
    with pytest.raises(WireError, match="cannot travel"):
        Channel(a).send((1, Gadget()))
    assert calls == [] and UNPICKLED == []
    a.close()
    b.close()


def until_caught_up(channel: Channel) -> None:
    channel.sock.settimeout(10)
    while channel.recv() != CAUGHT_UP:
        pass


@pytest.mark.timeout(60)
def test_a_peer_with_the_token_that_sends_code_or_garbage_is_dropped_and_the_other_relays_go_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ray_link = pytest.importorskip("envsync.links.ray")
    crafted = pickle.dumps(Gadget(), protocol=5)
    calls: list[Any] = []
    monkeypatch.setattr(os, "system", lambda *a: calls.append(a))
    link = ray_link.RayLink({("config", "difficulty"): torch.zeros(())}, [1, 1, 1], host="127.0.0.1")
    try:
        handle = link.handle()
        evil, garbled, good = (connect(handle.address, handle.token, c) for c in range(3))
        for channel in (evil, garbled, good):
            until_caught_up(channel)
        evil.sock.sendall(HEADER.pack(len(crafted), 0) + crafted)  # a pickle that would run code
        garbled.send(
            (np.full((6, 5), 9, dtype=np.int64), [(np.array([7]), "not its worker")], [])
        )  # plain, but not its report
        for dropped in (evil, garbled):
            with pytest.raises((EOFError, ConnectionResetError)):
                dropped.recv()
        acks = np.array([[1], [1], [0], [1], [0], [1]], dtype=np.int64)
        good.send((acks, [], []))  # the link's reading thread still reads
        deadline = time.monotonic() + 10
        while link.status(2).applied != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert link.status(2).applied == 1
        assert [link.status(w).applied for w in (0, 1)] == [0, 0]
        assert calls == []
        for channel in (evil, garbled, good):
            channel.close()
    finally:
        link.close()
