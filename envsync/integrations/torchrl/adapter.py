"""How a receiver sits beside a torchrl env without a ``TransformedEnv`` layer.

:class:`EnvHooks` is installed on the env a wrapped factory builds: it replaces that env
instance's ``_step`` and ``_reset`` (torchrl calls them through every wrapper around it),
which makes them the receiver's safe points. With nothing pending, a step costs one integer
read and a counter increment. Tags are not written per step: the hooks note at which step
of the rollout a version took effect, and :meth:`EnvHooks.tag` writes ``"env_version"`` (at
the root and under ``"next"``) and ``"env_index"`` once per rollout.

:class:`CollectorAdapter` is the receiver's view of that env and its collector, and
:func:`bind` ties a receiver to a collector: it wraps the collector instance's ``rollout``
and the commands torchrl's worker loop runs on the env (reset, seed, state dicts, close),
so the worker loop never applies while the collector drives the env.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from tensordict import TensorDictBase
from torchrl.envs import EnvBase

from envsync import reinit
from envsync.configure import config_applier, env_state_dict
from envsync.errors import EnvSyncError, ValidationError
from envsync.integrations.torchrl.chain import chain_of, runner
from envsync.integrations.torchrl.paths import held_at
from envsync.integrations.torchrl.rollouts import guard_commands, wrap_rollout
from envsync.integrations.torchrl.tags import (
    INDEX_KEY,
    VERSION_KEY,
    Changes,
    fill_changes,
    mark_change,
    set_tag,
    tags_set_aside,
    truncate,
    truncate_at,
)
from envsync.links.base import LinkHandle
from envsync.spec import ApplySpec
from envsync.state import FlatConfig
from envsync.worker.owner import Owner
from envsync.worker.places import Place, Standalone, SubEnv
from envsync.worker.receiver import EnvStateReceiver

_UNDER_HOOKS = "_envsync_under_hooks"  # marks the base env of a hooked TransformedEnv


class EnvHooks:
    """Safe points and tag bookkeeping for one env (installed by the wrapped factory).

    Args:
        env: the env to hook; its ``_step`` and ``_reset`` are replaced on the instance.
        spec: how versions are applied.
        initial_config: the config the env was built with (version 0).

    Examples:
        >>> from envsync.envs import make_drift_env
        >>> from envsync.protocol import ApplyAt
        >>> env = make_drift_env()
        >>> hooks = EnvHooks.install(env, ApplySpec(None, ApplyAt.RESET), None)
        >>> _ = env.rollout(3)
        >>> hooks.frame
        3
    """

    def __init__(self, env: EnvBase, spec: ApplySpec, initial_config: TensorDictBase | None) -> None:
        self.spec = spec
        self.initial_config = initial_config
        self.receiver: EnvStateReceiver | None = None
        self.env_index = 0
        self.frame = 0
        self.obs_version = 0
        self._root: Changes = [(0, 0)]
        self._next: Changes = [(0, 0)]
        self._target: Any = None  # the receiver's latest(), looked up once per bind
        self._step = env._step
        self._reset = env._reset
        self.owner = Owner()  # its fast path: settled, and the latest target a step handled
        self.owner.settled = True

    @classmethod
    def install(cls, env: EnvBase, spec: ApplySpec, initial_config: TensorDictBase | None) -> EnvHooks:
        """Hook ``env`` (once: an env hooked already keeps its hooks)."""
        hooks = env.__dict__.get("_envsync_hooks")
        if isinstance(hooks, EnvHooks):
            return hooks
        hooks = cls(env, spec, initial_config)
        env.__dict__["_envsync_hooks"] = hooks
        env._step = hooks.step
        env._reset = hooks.reset
        base = getattr(env, "base_env", None)
        if base is not None:  # a TransformedEnv: a collector that re-wraps it drops the hooks
            base.__dict__[_UNDER_HOOKS] = True
        return hooks

    def bind(self, receiver: EnvStateReceiver, env_index: int) -> None:
        """Serve ``receiver`` from now on (replacing any earlier one)."""
        previous = self.receiver
        if previous is not None:
            previous.close()
        self.receiver = receiver
        self.env_index = env_index
        self._target = receiver.latest
        self.owner.unsettle()

    def step(self, tensordict: TensorDictBase) -> TensorDictBase:
        # the env's owner's lock for the whole step: no apply from the worker loop overlaps it, and
        # the fast path's test sees every version an apply made before the step began
        owner = self.owner
        with owner.lock:
            frame = self.frame
            self.frame = frame + 1
            receiver = self.receiver
            # compared with the target this path handled, not the receiver's `seen`: the idle
            # worker loop's periodic wake notices (and acknowledges) targets too, even while busy
            if receiver is None or (owner.settled and self._target() == owner.handled):
                return self._step(tensordict)
            return self._slow_step(receiver, frame, tensordict)

    def _slow_step(self, receiver: EnvStateReceiver, frame: int, tensordict: TensorDictBase) -> TensorDictBase:
        owner = self.owner
        if owner.is_applying:  # a step of the apply itself (a re-init that rolls out)
            return self._step(tensordict)
        owner.handled = self._target()
        receiver.before_step()  # notes the version the step runs under
        version = receiver.version
        mark_change(self._next, frame, version)
        out = self._step(tensordict)
        if receiver.truncate_now():
            truncate(out)
        mark_change(self._root, frame + 1, version)
        self.obs_version = version
        owner.settled = receiver.version == version
        return out

    def reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDictBase:
        with self.owner.lock:
            receiver = self.receiver
            if receiver is None:
                return self._reset(tensordict, **kwargs)
            receiver.before_reset()  # notes the version the reset's observation comes from
            out = self._reset(tensordict, **kwargs)
            self.obs_version = receiver.version
            mark_change(self._root, self.frame, self.obs_version)
            self.owner.unsettle()
            return out

    def begin(self) -> None:
        """A rollout starts: frames count from 0; tags carry over from the last state."""
        version = self.receiver.version if self.receiver is not None else 0
        self.frame = 0
        self._root = [(0, self.obs_version)]
        self._next = [(0, version)]
        self.owner.settled = version == self.obs_version

    def tag(self, batch: TensorDictBase) -> None:
        """Write the rollout's tags into ``batch`` (in place when it has them already)."""
        shape = batch.batch_size
        for key, changes in ((VERSION_KEY, self._root), (("next", VERSION_KEY), self._next)):
            out = batch.get(key, None)
            if out is None:
                out = torch.empty(shape, dtype=torch.int64)
                fill_changes(out, changes)
                set_tag(batch, key, out)
            else:
                fill_changes(out, changes)
        for key in (INDEX_KEY, ("next", INDEX_KEY)):
            if batch.get(key, None) is None:
                set_tag(batch, key, torch.full(shape, self.env_index, dtype=torch.int64))

    def truncate_last(self, batch: TensorDictBase) -> None:
        """End the rollout's last frame as truncated (a ``"truncate"`` version is pending)."""
        truncate_at(batch.get("next"), (..., -1))

    def finish(self, batch: TensorDictBase, receiver: EnvStateReceiver) -> list[int]:
        """Tag a rollout's batch and, when ``receiver`` (the one that drove the rollout) has
        a pending version that must end the episode, truncate its last frame; return the
        envs it truncated (``[0]``, or none)."""
        self.tag(batch)
        if not receiver.truncate_now():
            return []
        self.truncate_last(batch)
        return [0]


def find_hooks(env: Any) -> tuple[EnvBase, EnvHooks]:
    """The hooked env inside a collector's env (torchrl may wrap it further) and its hooks."""
    wrapped = env
    rewrapped = False
    while wrapped is not None:
        hooks = getattr(wrapped, "__dict__", {}).get("_envsync_hooks")
        if isinstance(hooks, EnvHooks):
            return wrapped, hooks
        rewrapped = rewrapped or bool(getattr(wrapped, "__dict__", {}).get(_UNDER_HOOKS))
        wrapped = getattr(wrapped, "base_env", None)
    if rewrapped:
        raise ValidationError(
            "the collector re-built your TransformedEnv around its base env (torchrl does that for "
            "max_frames_per_traj > 0: TransformedEnv(env, StepCounter(...)) unwraps env), which drops "
            "envsync's hooks: add StepCounter(max_steps=N) to your env's transforms instead of "
            "passing max_frames_per_traj"
        )
    raise ValidationError(
        "the collector's env was not built by an envsync factory: build the collector with "
        f"create_env_fn=sender.env_fn(make_env); its env is {type(env).__name__}"
    )


class CollectorAdapter:
    """The receiver's view of a hooked env and the collector that drives it (both by weakref).

    Args:
        collector: the (inner) collector.
        env: the hooked env (the one the factory built).
        spec: how versions are applied.
    """

    def __init__(self, collector: Any | None, env: EnvBase, spec: ApplySpec) -> None:
        self._collector = weakref.ref(collector) if collector is not None else lambda: None
        self._env = weakref.ref(env)
        self._spec = spec
        self._apply = config_applier(env, spec.apply)
        steps = reinit.plan(chain_of(env), spec.reinit)
        self.has_reinit = bool(steps)
        self._reinit = runner(steps)
        # (the target when read, the statistics a gather read), latest last: the bases a
        # merge pushed later is loaded on top of
        self._bases: list[tuple[int, dict[str, torch.Tensor]]] = []

    def _live_env(self) -> EnvBase:
        env = self._env()
        if env is None:
            raise EnvSyncError("the env of this receiver is gone")
        return env

    def apply_config(self, config: FlatConfig) -> None:
        self._apply(config)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        env = self._live_env()
        return {**env_state_dict(env, keep_vars=True), **reinit.stats_entries(chain_of(env), self._spec.reinit)}

    def read_attributes(self, paths: list[str]) -> dict[str, torch.Tensor]:
        env = self._live_env()
        return {path: held_at(env, path) for path in paths}

    def note_read(self, entries: dict[str, torch.Tensor], target: int) -> None:
        stats = {k: v.clone() for k, v in entries.items() if k.startswith(f"{reinit.STATS}.")}
        if stats:
            self._bases = [*self._bases[-2:], (target, stats)]

    def commit(self, written: dict[str, torch.Tensor], *, version: int, restore: bool = False) -> None:
        if not written:
            return
        chain = chain_of(self._live_env())
        # statistics whose transform's own entries were written here are that transform's
        # whole state, as written: what the env saw since a read is gone with the old state
        replaced = reinit.replaced_stats(chain, self._spec.reinit, written)
        stats = {k: v for k, v in written.items() if k.startswith(f"{reinit.STATS}.")}
        if not stats and not replaced:
            return
        merged = {k: v for k, v in stats.items() if int(k.split(".")[1]) not in replaced}
        if merged and not restore:  # a merge of what a gather read before `version` was published
            base = next((read for target, read in reversed(self._bases) if target < version), {})
            stats = {**stats, **reinit.on_top_of_own(chain, self._spec.reinit, merged, base)}
        if stats:
            reinit.load_stats(chain, self._spec.reinit, stats)
        # earlier reads no longer describe what the env holds: later merges go on top of this
        self._bases = [(version, reinit.stats_entries(chain, self._spec.reinit))]

    def reinit(self, version: int) -> None:
        self._reinit(self._live_env(), version)

    def reset(self) -> None:
        collector = self._collector()
        if collector is None:  # a sub-env of a batched env: its group resets it
            raise EnvSyncError("a sub-env is reset through its batched env's collector, not by its receiver")
        collector.reset()


def serve_env(
    env: EnvBase, hooks: EnvHooks, handle: LinkHandle, slot: int, env_index: int, collector: Any, **where: bool
) -> Any:
    """A receiver for the hooked ``env`` on link ``slot``, as fleet env ``env_index``
    (``collector``: the collector that drives it, or ``None`` for a sub-env; ``relay``: a
    sub-env in another process than its group, which it wakes through the slot's relay;
    ``gated``: a sub-env under a batched level, which acknowledges its applies)."""
    end, relay = handle.open(slot), where.get("relay", False)
    if where.get("gated", False):
        end = end.gated(wake_group=relay)
    place: Place = Standalone()
    if collector is None:  # a sub-env: its group's owner marks it driven
        place = SubEnv(hooks.owner.unsettle, end.poke_relay if relay else lambda: None)
    else:
        hooks.owner.marks_with(end.set_busy)
    receiver = EnvStateReceiver(
        link=end,
        spec=hooks.spec,
        adapter=CollectorAdapter(collector, env, hooks.spec),
        initial_config=hooks.initial_config,
        place=place,
        owner=hooks.owner,
    )
    hooks.bind(receiver, env_index)
    return receiver


def bind_env(collector: Any, handle: LinkHandle, slot: int, env_index: int) -> EnvStateReceiver:
    """Bind ``collector``'s (unbatched) env to link ``slot`` as fleet env ``env_index``, and
    catch up.

    Raises:
        ValidationError: the collector's env was not built by an envsync factory.
    """
    env, hooks = find_hooks(collector.env)
    receiver: EnvStateReceiver = serve_env(env, hooks, handle, slot, env_index, collector)
    receiver_ref = weakref.ref(receiver)
    wrap_rollout(collector, receiver_ref, hooks.begin, hooks.finish, tags_set_aside)
    guard_commands(collector, receiver_ref)
    receiver.start(loop=receiver.link)
    return receiver
