"""The direct connection between the main process and each relay (see :mod:`envsync.links.ray`).

One TCP connection per remote collector, opened by its relay to the main process's
:class:`Listener`: posts go down it in order, reports come up. A message is plain values and arrays, written by
:mod:`envsync.links.ray_codec` (no pickle) as a small header, then the arrays' bytes out of
band: the sender writes them from the arrays' own memory, and the receiver reads each into
one buffer that the decoded array then views (no copy beyond the socket's). ``TCP_NODELAY``
is set on both ends: messages are small and latency is the point.

A connection is accepted only after it presents the listener's token (32 random bytes,
compared in constant time) before anything from it is read; the token travels to the
relays inside torchrl's pickled scheme, over Ray. A peer with the token still cannot run
code here: what it sends decodes to plain values and arrays only, or raises
:class:`~envsync.links.ray_codec.WireError`. The traffic is not encrypted (see
``docs/ray.md``, Security).

Examples:
    >>> import numpy as np
    >>> a, b = socket.socketpair()
    >>> Channel(a).send({"x": np.arange(3)})
    >>> Channel(b).recv()["x"]
    array([0, 1, 2])
"""

from __future__ import annotations

import contextlib
import hmac
import secrets
import socket
import struct
import threading
from typing import Any

from envsync.links.ray_codec import pack, unpack

HEADER = struct.Struct("!QI")
"""A message's frame: its header's length (:func:`~envsync.links.ray_codec.pack`), then how
many out-of-band buffers follow."""
LENGTH = struct.Struct("!Q")
"""One out-of-band buffer's length (after the header, one per buffer), or a collector index."""
TOKEN_BYTES = 32
HELLO_TIMEOUT = 5.0
"""Seconds a new connection has to present its token."""
SEND_TIMEOUT = 30.0
"""Seconds a send may block on a peer that reads nothing before the connection is dropped."""


def frames(message: Any) -> list[Any]:
    """``message`` as the byte strings :meth:`Channel.send_frames` writes: the lengths, the
    header, then each out-of-band buffer (views of the arrays' memory, not copies).

    Examples:
        >>> import numpy as np
        >>> [bytes(f) for f in frames(np.zeros(1, np.uint8))][2]
        b'\\x00'
    """
    data, raws = pack(message)
    lengths = HEADER.pack(len(data), len(raws)) + b"".join(LENGTH.pack(r.nbytes) for r in raws)
    return [lengths, data, *raws]


class Channel:
    """One end of a connection: whole messages, sent from any thread, received by one."""

    def __init__(self, sock: socket.socket) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._sending = threading.Lock()

    def send(self, message: Any) -> None:
        self.send_frames(frames(message))

    def send_frames(self, parts: list[Any]) -> None:
        """Write one message made by :func:`frames` (whole, or not at all if the peer is gone)."""
        with self._sending:
            for part in parts:
                self.sock.sendall(part)

    def recv(self) -> Any:
        """The next message; ``EOFError`` once the peer closed;
        :class:`~envsync.links.ray_codec.WireError` for one that holds anything but plain
        values and arrays (the stream is then lost: drop the connection)."""
        size, count = HEADER.unpack(_exactly(self.sock, HEADER.size))
        lengths = [LENGTH.unpack(_exactly(self.sock, LENGTH.size))[0] for _ in range(count)]
        data = _exactly(self.sock, size)
        return unpack(data, [_exactly(self.sock, n) for n in lengths])

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv
        self.sock.close()


def _exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        read = sock.recv_into(view[got:])
        if read == 0:
            raise EOFError("the connection closed")
        got += read
    return buf


class Listener:
    """The main process's listening socket, on ``host``, and the token its peers present.

    Examples:
        >>> listener = Listener("127.0.0.1")
        >>> peer = connect(listener.address, listener.token, 3)
        >>> listener.accept()[0]
        3
        >>> peer.close(); listener.close()
    """

    def __init__(self, host: str) -> None:
        self.sock = socket.create_server((host, 0))
        self.address = (host, int(self.sock.getsockname()[1]))
        self.token = secrets.token_bytes(TOKEN_BYTES)

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> tuple[int, Channel] | None:
        """The next connection and the collector index it says it serves; ``None`` when it
        does not present the token in time (it is closed)."""
        conn, _ = self.sock.accept()
        try:
            conn.settimeout(HELLO_TIMEOUT)
            hello = _exactly(conn, TOKEN_BYTES + LENGTH.size)
            if not hmac.compare_digest(bytes(hello[:TOKEN_BYTES]), self.token):
                raise PermissionError("wrong token")
            conn.settimeout(SEND_TIMEOUT)
        except (OSError, EOFError):
            conn.close()
            return None
        return LENGTH.unpack(hello[TOKEN_BYTES:])[0], Channel(conn)

    def close(self) -> None:
        self.sock.close()


def connect(address: tuple[str, int], token: bytes, collector: int, timeout: float = 30.0) -> Channel:
    """Open a connection to a :class:`Listener` as the relay of remote collector ``collector``."""
    sock = socket.create_connection(address, timeout=timeout)
    sock.sendall(token + LENGTH.pack(collector))
    sock.settimeout(None)
    return Channel(sock)
