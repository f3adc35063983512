"""The sender's record of past configs: which config each env ran under each version.

A frame names its env (``env_index``) and the version its env applied (``env_version``);
together they name the config that produced it, but only while the sender remembers what it
published. :class:`ConfigHistory` keeps, per env, the config of every version published to
it, and forgets versions no frame can still carry: an env's frames carry its applied version
or newer ones, and frames already collected (a batch in flight, a batch the user holds) carry
older ones, so past the version in effect at the env's applied version the history keeps only
the ``keep`` newest entries of each env.

Leaves are kept by reference, as the sender keeps them (:mod:`envsync.desired`): a published
tensor is never written again, so a reference keeps its value.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping

from tensordict import TensorDict

from envsync.desired import section
from envsync.errors import ValidationError
from envsync.links.base import Flat
from envsync.state import Leaf, nest


class ConfigHistory:
    """Per env, the config of every version published to it that a frame may still carry.

    Args:
        keep: how many entries older than the one in effect at an env's applied version are
            kept for frames already collected (batches in flight or held by the user).

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

    def __init__(self, keep: int = 64) -> None:
        if not isinstance(keep, int) or keep < 0:
            raise ValidationError(f"keep must be a non-negative int, got {keep!r}")
        self.keep = keep
        self._versions: dict[int, list[int]] = {}
        self._configs: dict[int, list[dict[str, Leaf]]] = {}

    def record(self, version: int, configs: Mapping[int, Flat], applied: Callable[[int], int] | None = None) -> None:
        """Note that each env in ``configs`` (fleet index to its desired leaves, of which the
        ``"config"`` section is kept) runs that config from ``version`` on.

        An env's entries at ``version`` or later are replaced (an env index numbered again
        after every collector left starts over). ``applied(env)`` tells the version an env
        applied; once an env holds more than twice ``keep`` stale entries, they are pruned.
        """
        for env, flat in configs.items():
            versions = self._versions.setdefault(env, [])
            entries = self._configs.setdefault(env, [])
            cut = bisect.bisect_left(versions, version)
            del versions[cut:], entries[cut:]
            versions.append(version)
            entries.append(section(flat, "config"))
            if applied is not None and len(versions) > 2 * self.keep + 1:
                self._prune(env, applied(env))

    def _prune(self, env: int, applied: int) -> None:
        versions = self._versions[env]
        in_effect = max(bisect.bisect_right(versions, applied) - 1, 0)
        drop = max(in_effect - self.keep, 0)
        del versions[:drop], self._configs[env][:drop]

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
        return nest(self._configs[env][at]).clone()

    def versions(self, env: int) -> list[int]:
        """The versions kept for env ``env``, oldest first (each starts a config)."""
        return list(self._versions.get(env, []))
