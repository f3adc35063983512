"""The probe: one env in the main process that stands for the workers' envs.

It is built once, lazily, from the wrapped factory (or is the user's own env for a
single-process ``Collector``). The sender reads from it the env-state keys a push may carry,
checks its settings against it before any worker starts, and computes on it the statistics
of ``recompute(where="main")`` policies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDictBase

from envsync.errors import ValidationError
from envsync.reinit import compute_in_main, plan, stats_entries, stats_indices
from envsync.state import EnvStateTemplate, Leaf, apply_config, tensor_of

if TYPE_CHECKING:
    from envsync.receiver import ApplySpec


@dataclass
class Probe:
    """An env in the main process that tells the sender what the workers' envs look like.

    Args:
        make: builds the env (the wrapped factory), or returns the user's own env.
        owned: whether the sender built it (and so closes it).
        split: given the env, how many envs of the fleet it holds, a builder of the env
            that stands for one of them (``None``: the env itself), and whether it takes env
            state; a batched env holds one per sub-env, and is described by one sub-env.
    """

    make: Callable[[], Any]
    owned: bool
    split: Callable[[Any], tuple[int, Callable[[], Any] | None, bool]] = lambda env: (1, None, True)
    env: Any = None
    _leaf: Any = None

    def get(self) -> Any:
        """The probe env, built on first use."""
        if self.env is None:
            self.env = self.make()
        return self.env

    def num_envs(self) -> int:
        """How many envs of the fleet one such env holds (its sub-envs, when batched)."""
        return self.split(self.get())[0]

    def leaf(self) -> Any:
        """The env that stands for one env of the fleet: the probe env, or one of its
        sub-envs (built once, in this process)."""
        if self._leaf is None:
            make_leaf = self.split(self.get())[1]
            self._leaf = self.get() if make_leaf is None else make_leaf()
        return self._leaf

    def describe(self, spec: ApplySpec, allow_nonfinite: bool) -> EnvStateTemplate:
        """Check the env against the sender's settings; return its env-state template.

        Raises:
            ValidationError: a mode that truncates without a ``"truncated"`` key, or a
                ``reinit`` selector that matches nothing or a policy a transform lacks.
        """
        env = self.leaf()
        if spec.truncates and "truncated" not in env.done_keys:
            raise ValidationError(
                f"apply_at={spec.apply_at.value!r} (with the reinit policies given) ends episodes as "
                f"truncated and needs a 'truncated' done key on the env (it has {env.done_keys}); "
                "add a StepCounter or use GymEnv"
            )
        plan(env, spec.reinit)
        if not self.split(self.get())[2]:
            return EnvStateTemplate({}, allow_nonfinite=allow_nonfinite)
        if self.owned or env is not self.env:
            env.reset()  # lazy transforms (VecNorm) create their statistics at the first reset
        derived = stats_entries(env, spec.reinit)
        return EnvStateTemplate.from_env(env, derived=derived, allow_nonfinite=allow_nonfinite)

    def check_configs(self, spec: ApplySpec, configs: Iterable[Mapping[str, Leaf]]) -> None:
        """Let the apply refuse, before a push is published, each distinct whole config an
        env would run (``rebuild()``: one whose rebuilt env would change the specs).

        Raises:
            ValidationError: the apply's ``check_config`` refused one.
        """
        check = getattr(spec.apply, "check_config", None)
        if check is None:
            return
        seen: set[bytes] = set()
        for config in configs:
            key = b"".join(k.encode() + tensor_of(config[k]).numpy().tobytes() for k in sorted(config))
            if key not in seen:
                seen.add(key)
                check(self.leaf(), config)

    def stats_indices(self, spec: ApplySpec, selector: Any) -> dict[int, float]:
        """The transforms ``selector`` picks that keep mergeable statistics: index -> decay."""
        return stats_indices(self.leaf(), spec.reinit, selector)

    def main_stats(self, spec: ApplySpec, config: TensorDictBase) -> dict[str, torch.Tensor]:
        """Run the ``recompute(where="main")`` policies under ``config``; return the state.

        Raises:
            ValidationError: the config method or the statistics failed on the probe.
        """
        env = self.leaf()
        try:
            apply_config(env, spec.apply, config)
            return compute_in_main(env, spec.reinit)
        except Exception as err:
            raise ValidationError(f"recompute(where='main') failed on the probe env: {err!r}") from err

    def close(self) -> None:
        """Close the env if the sender built it (and the sub-env it built to describe it)."""
        if self._leaf is not None and self._leaf is not self.env:
            self._leaf.close()
        if self.owned and self.env is not None:
            self.env.close(raise_if_closed=False)  # a batched probe env is never started
        self.env = None
        self._leaf = None
