"""How a worker applies a version: the config method, the apply mode and the re-initialisation
policies, fixed when the sender is built and shared by the sender, the probe env and every
receiver."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from envsync.protocol import ApplyAt
from envsync.reinit import ReinitSpec


@dataclass(frozen=True)
class ApplySpec:
    """How a worker applies a version: the config method and the apply mode.

    Args:
        apply: a method name looked up on the env, a callable ``fn(env, config)``, or ``None``.
        apply_at: where versions are applied (see :class:`~envsync.protocol.ApplyAt`).
        reinit: the re-initialisation policies run after each apply.
    """

    apply: Any
    apply_at: ApplyAt
    reinit: ReinitSpec = field(default_factory=ReinitSpec)

    @property
    def truncates(self) -> bool:
        """Whether a version that arrives mid-episode ends it as truncated. ``"truncate"`` does;
        so does ``"step"`` when a re-init policy steps the env (it needs a fresh episode)."""
        return self.apply_at is ApplyAt.TRUNCATE or (self.apply_at is ApplyAt.STEP and self.reinit.moves_env)

    @property
    def idle_resets(self) -> bool:
        """Whether a version applied while the collector is idle is followed by a reset (a
        truncating mode, or a re-init policy that steps the env)."""
        return self.truncates or self.reinit.moves_env
