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

from envsync.configure import apply_config
from envsync.errors import ValidationError
from envsync.levels import BATCHED, selector_level, split_reinit
from envsync.reinit import Chain, ReinitSpec, compute_in_main, plan, stats_entries, stats_indices, stats_sources
from envsync.state import EnvStateTemplate, Leaf, StatePath, state_leaves, tensor_of

if TYPE_CHECKING:
    from envsync.spec import ApplySpec


@dataclass(frozen=True)
class Layout:
    """How many envs of the fleet one worker env holds, and where their state lives.

    Args:
        num_envs: its envs (1 for an unbatched env, its sub-envs or rows when batched).
        make_leaf: builds an env that stands for one of them (``None``: the env itself).
        rows: they are rows of one natively batched env: a row's state is its row of every
            entry whose leading dim is ``num_envs``.
        make_outer: builds (in this process, ready to reset) an env holding a copy of the
            batched env's own transforms (see :mod:`envsync.levels`); ``None``: it has none.
        batched: the env is batched (``"batched.*"`` selectors are allowed).
    """

    num_envs: int = 1
    make_leaf: Callable[[], Any] | None = None
    rows: bool = False
    make_outer: Callable[[], Any] | None = None
    batched: bool = False


@dataclass
class Probe:
    """An env in the main process that tells the sender what the workers' envs look like.

    Args:
        make: builds the env (the wrapped factory), or returns the user's own env.
        owned: whether the sender built it (and so closes it).
        chain: given an env (or ``None``), its transform chain as the integration reads it
            (:class:`envsync.reinit.Chain`).
        split: given the env, its :class:`Layout`; a batched env holds one env of the fleet
            per sub-env, and is described by one sub-env and its own transforms.
        held_at: given an env and an attribute path, what it holds there (raises a
            ``ValidationError`` naming a path that does not resolve); ``None``: paths are
            not checked in this process.
    """

    make: Callable[[], Any]
    owned: bool
    chain: Callable[[Any], Chain]
    split: Callable[[Any], Layout] = lambda env: Layout()
    held_at: Callable[[Any, str], Any] | None = None
    env: Any = None
    _leaf: Any = None
    _outer: Any = None

    def get(self) -> Any:
        """The probe env, built on first use."""
        if self.env is None:
            self.env = self.make()
        return self.env

    def layout(self) -> Layout:
        """The probe env's :class:`Layout`."""
        return self.split(self.get())

    def num_envs(self) -> int:
        """How many envs of the fleet one such env holds (its sub-envs, when batched)."""
        return self.layout().num_envs

    def leaf(self) -> Any:
        """The env that stands for one env of the fleet: the probe env, or one of its
        sub-envs (built once, in this process)."""
        if self._leaf is None:
            make_leaf = self.layout().make_leaf
            self._leaf = self.get() if make_leaf is None else make_leaf()
        return self._leaf

    def outer(self) -> Any:
        """An env holding a copy of the batched env's own transforms (built once), or ``None``."""
        if self._outer is None:
            make_outer = self.layout().make_outer
            self._outer = None if make_outer is None else make_outer()
        return self._outer

    def describe(self, spec: ApplySpec, allow_nonfinite: bool) -> EnvStateTemplate:
        """Check the env against the sender's settings; return its env-state template: one
        env's entries, and the batched env's own as ``batched.*`` (:mod:`envsync.levels`).

        Raises:
            ValidationError: a mode that truncates without a ``"truncated"`` key, a
                ``reinit`` selector that matches nothing or a policy a transform lacks, or
                a ``"batched.*"`` selector on an env that is not batched.
        """
        layout = self.layout()
        leaf_rules, outer_rules = split_reinit(spec.reinit)
        if outer_rules.rules and not layout.batched:
            chosen = [f"batched.{s}" for s, _ in outer_rules.rules]
            raise ValidationError(
                f"reinit selectors {chosen} address a batched env's own transforms; the env is not batched"
            )
        env = self.leaf()
        if spec.truncates and "truncated" not in env.done_keys:
            raise ValidationError(
                f"apply_at={spec.apply_at.value!r} (with the reinit policies given) ends episodes as "
                f"truncated and needs a 'truncated' done key on the env (it has {env.done_keys}); "
                "add StepCounter(max_steps=...) (it adds one) or use GymEnv"
            )
        plan(self.chain(env), leaf_rules)
        if self.owned or env is not self.env:
            env.reset()  # lazy transforms (VecNorm) create their statistics at the first reset
        covers: dict[str, list[str]] = {}
        if layout.rows:  # a row's state is its row of the env's own entries (no moments of its own)
            entries = _rows_of(state_leaves(env.state_dict(keep_vars=True)), layout.num_envs)
        else:
            entries = self._entries(env, leaf_rules)
            covers = stats_sources(self.chain(env), leaf_rules)
        outer = self.outer()
        if outer is not None:
            plan(self.chain(outer), outer_rules)
            if outer is not env:
                outer.reset()
            entries.update({(BATCHED, *path): v for path, v in self._entries(outer, outer_rules).items()})
            outer_covers = stats_sources(self.chain(outer), outer_rules)
            covers |= {f"{BATCHED}.{p}": [f"{BATCHED}.{k}" for k in keys] for p, keys in outer_covers.items()}
        elif outer_rules.rules:
            plan(self.chain(None), outer_rules)  # nothing to match: raises, naming the selectors
        return EnvStateTemplate(entries, allow_nonfinite=allow_nonfinite, covers=covers)

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

    def check_paths(self, paths: Iterable[str]) -> None:
        """Resolve each attribute path on the env that stands for one env of the fleet.

        Raises:
            ValidationError: a path that does not resolve, or holds no number or array.
        """
        if self.held_at is not None:
            for path in paths:
                self.held_at(self.leaf(), path)

    def stats_indices(self, spec: ApplySpec, selector: Any) -> dict[int, float]:
        """The transforms ``selector`` picks that keep mergeable statistics: index -> decay
        (in one sub-env's chain, or, for a ``"batched.*"`` selector, the batched env's own)."""
        batched, own = selector_level(selector)
        leaf_rules, outer_rules = split_reinit(spec.reinit)
        if batched:
            outer = self.outer()
            return {} if outer is None else stats_indices(self.chain(outer), outer_rules, own)
        if self.layout().rows:
            return {}  # the rows share the env's transforms: their statistics are the whole env's
        return stats_indices(self.chain(self.leaf()), leaf_rules, own)

    def main_stats(self, spec: ApplySpec, config: TensorDictBase) -> dict[str, torch.Tensor]:
        """Run the ``recompute(where="main")`` policies under ``config``; return the state.

        Raises:
            ValidationError: the config method or the statistics failed on the probe.
        """
        env = self.leaf()
        try:
            apply_config(env, spec.apply, config)
            return compute_in_main(self.chain(env), split_reinit(spec.reinit)[0])
        except Exception as err:
            raise ValidationError(f"recompute(where='main') failed on the probe env: {err!r}") from err

    def _entries(self, env: Any, rules: ReinitSpec) -> dict[StatePath, Any]:
        """An env's ``state_dict()`` leaves by path, and its derived moments (``stats.*``)."""
        derived = {tuple(k.split(".")): v for k, v in stats_entries(self.chain(env), rules).items()}
        return {**state_leaves(env.state_dict(keep_vars=True)), **derived}

    def close(self) -> None:
        """Close the env if the sender built it (and the sub-env it built to describe it)."""
        if self._leaf is not None and self._leaf is not self.env:
            self._leaf.close()
        if self._outer is not None and self._outer is not self.env:
            self._outer.close(raise_if_closed=False)
        if self.owned and self.env is not None:
            self.env.close(raise_if_closed=False)  # a batched probe env is never started
        self.env = None
        self._leaf = None
        self._outer = None


def _rows_of(entries: dict[StatePath, Any], n: int) -> dict[StatePath, Any]:
    """A row of each entry whose leading dim is ``n`` (a natively batched env's rows)."""
    return {
        path: v[0]
        for path, v in entries.items()
        if isinstance(v, torch.Tensor) and not torch.nn.parameter.is_lazy(v) and v.ndim and v.shape[0] == n
    }
