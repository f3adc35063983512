"""The sender's record of past configs: which config each env ran under each version.

A frame names its env (``env_index``) and the version its env applied (``env_version``);
together they name the config that produced it, but only while the sender remembers what it
published. :class:`ConfigHistory` keeps, per env, the config of every version published to
it, and forgets versions no frame can still carry: an env's frames carry its applied version
or newer ones, and frames already collected (a batch in flight, a batch the user holds) carry
older ones, so past the version in effect at the env's applied version the history keeps only
the ``keep`` newest entries of each env, and of those only as many as fit in ``keep_bytes``
(a large config pushed often would otherwise hold ``keep`` payloads).

Leaves are kept by reference, as the sender keeps them (:mod:`envsync.desired`): a published
tensor is never written again, so a reference keeps its value. An entry is never changed
either: envs recorded alike by one call (a fleet-wide push) share it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping

from tensordict import TensorDict

from envsync.desired import section
from envsync.errors import ValidationError
from envsync.links.base import Flat
from envsync.state import Leaf, nest

SLACK = 16
"""Entries past ``keep`` that an env may gather before it is pruned (a prune reads the env's
applied version: once per ``SLACK`` records, not at every push)."""


_NONE: dict[str, Leaf] = {}
"""The entry before an env's first (never changed)."""


def _nbytes(leaf: Leaf) -> int:
    return int(getattr(leaf, "nbytes", 8))


class ConfigHistory:
    """Per env, the config of every version published to it that a frame may still carry.

    Args:
        keep: how many entries older than the one in effect at an env's applied version are
            kept for frames already collected (batches in flight or held by the user).
        keep_bytes: the most bytes those older entries may hold together (leaves they share
            with a newer entry are counted with that one); the newest of them is kept whatever
            its size.

    Examples:
        >>> import numpy as np
        >>> history = ConfigHistory(keep=1)
        >>> history.record(0, {0: {("config", "difficulty"): np.float32(0.0)}})
        >>> history.record(3, {0: {("config", "difficulty"): np.float32(0.5)}})
        >>> history.config(0, 2)["difficulty"].item()  # version 2 never reached env 0: it ran 0
        0.0
        >>> history.config(0, 7)["difficulty"].item()
        0.5
    """

    def __init__(self, keep: int = 64, keep_bytes: int = 64 << 20) -> None:
        if not isinstance(keep, int) or keep < 0:
            raise ValidationError(f"keep must be a non-negative int, got {keep!r}")
        if not isinstance(keep_bytes, int) or keep_bytes < 0:
            raise ValidationError(f"keep_bytes must be a non-negative int, got {keep_bytes!r}")
        self.keep = keep
        self.keep_bytes = keep_bytes
        self._versions: dict[int, list[int]] = {}
        self._configs: dict[int, list[dict[str, Leaf]]] = {}
        self._sizes: dict[int, list[int]] = {}  # per entry, the bytes of the leaves it brought
        self._held: dict[int, int] = {}  # per env, the sum of its entries' sizes

    def record(self, version: int, configs: Mapping[int, Flat], applied: Callable[[int], int] | None = None) -> None:
        """Note that each env in ``configs`` (fleet index to its desired leaves, of which the
        ``"config"`` section is kept) runs that config from ``version`` on.

        An env's entries at ``version`` or later are replaced (an env index numbered again
        after every collector left starts over). ``applied(env)`` tells the version an env
        applied; a few records past ``keep`` stale entries (or at once past ``keep_bytes``)
        the oldest are pruned, so that in a steady state the history keeps a bounded size.
        """
        made: dict[tuple[int, int], tuple[dict[str, Leaf], int, Flat, object]] = {}
        for env, flat in configs.items():
            versions = self._versions.get(env)
            if versions is None:
                versions, self._configs[env], self._sizes[env] = [], [], []
                self._versions[env] = versions
            entries, sizes = self._configs[env], self._sizes[env]
            held = self._held.get(env, 0)
            if versions and versions[-1] >= version:
                cut = bisect.bisect_left(versions, version)
                held -= sum(sizes[cut:])
                del versions[cut:], entries[cut:], sizes[cut:]
            last = entries[-1] if entries else _NONE
            # envs of one mirror after one entry (a fleet-wide push) share the new entry
            got = made.get((id(flat), id(last)))
            if got is None:
                entry = section(flat, "config")
                size = 0
                for name, value in entry.items():
                    if last.get(name) is not value:
                        size += _nbytes(value)
                got = made[id(flat), id(last)] = (entry, size, flat, last)  # both kept: their ids stay theirs
            entry, size = got[0], got[1]
            versions.append(version)
            entries.append(entry)
            sizes.append(size)
            self._held[env] = held + size
            if applied is not None and (len(versions) > self.keep + SLACK or held + size > self.keep_bytes):
                self._prune(env, applied(env))

    def _prune(self, env: int, applied: int) -> None:
        versions, sizes = self._versions[env], self._sizes[env]
        in_effect = max(bisect.bisect_right(versions, applied) - 1, 0)
        drop = max(in_effect - self.keep, 0)
        # then the oldest of the older entries, while they hold more than keep_bytes
        older = sum(sizes[drop:in_effect])
        while drop < in_effect - 1 and older > self.keep_bytes:
            older -= sizes[drop]
            drop += 1
        self._held[env] -= sum(sizes[:drop])
        del versions[:drop], self._configs[env][:drop], sizes[:drop]

    def config(self, env: int, version: int) -> TensorDict:
        """The config env ``env`` ran under ``version`` (a ``TensorDict`` shaped like the
        template: the latest version published to that env at or before ``version``).

        Raises:
            ValidationError: the env never ran that version, or the entry was pruned.
        """
        versions = self._versions.get(env)
        if not versions:
            raise ValidationError(f"env {env} has no recorded config; envs with one are {sorted(self._versions)}")
        at = bisect.bisect_right(versions, version) - 1
        if at < 0:
            raise ValidationError(
                f"env {env} has no config at version {version}: its oldest kept version is {versions[0]} "
                f"(older ones were never published to it, or were pruned: raise the sender's config_history.keep)"
            )
        return nest(self._configs[env][at], copy=True)

    def versions(self, env: int) -> list[int]:
        """The versions kept for env ``env``, oldest first (each starts a config)."""
        return list(self._versions.get(env, []))
