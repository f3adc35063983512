"""What moves between the main process and the relays (on their connections,
:mod:`envsync.links.ray_channel`, and through the object store): one node's rows and their
encoding (:func:`encode`), the relays' reports (:data:`Acks`, :data:`Reply`) and the count
of what moved (:class:`Traffic`).

Everything here is tensors, numpy arrays, integers and strings: no user code is pickled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from envsync.links.base import Key
from envsync.state import Leaf, numpy_view

Rows = dict[int, tuple[int, int, dict[Key, Leaf]]]
"""One node's share of a push: link worker -> (version, undo mark, leaves)."""
Acks = tuple[int, int, int, bool, int]
"""One worker's report: ``(received, applied, failed, alive, answered)``."""
Reply = tuple[int, dict[str, Leaf], str | None]
"""One worker's answer to a gather: ``(request, values by env-state name, None)``, or
``(request, {}, traceback text)`` when it failed to answer; the values as
numpy arrays where numpy has their dtype (see :func:`wire`), which the connection carries
out of band (:mod:`envsync.links.ray_channel`)."""


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
            memo[id(value)] = _as_numpy(value)
        return memo[id(value)]

    return {w: (version, undo, {k: one(v) for k, v in leaves.items()}) for w, (version, undo, leaves) in rows.items()}


def wire(values: dict[str, torch.Tensor]) -> dict[str, Leaf]:
    """A gather answer's values as they travel: numpy arrays where numpy has the dtype.

    Examples:
        >>> type(wire({"x": torch.ones(2)})["x"]).__name__
        'ndarray'
    """
    return {name: _as_numpy(value) for name, value in values.items()}


def unwire(value: Leaf) -> torch.Tensor:
    """A travelled value as a tensor of its own (the reverse of :func:`wire`).

    Examples:
        >>> unwire(wire({"x": torch.ones(2)})["x"])
        tensor([1., 1.])
    """
    return torch.from_numpy(np.array(value)) if isinstance(value, np.ndarray) else value.clone()


def _as_numpy(value: torch.Tensor) -> Leaf:
    view = numpy_view(value.detach())
    return value if view is None else view


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
