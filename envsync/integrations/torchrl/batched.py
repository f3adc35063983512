"""Batched envs: every sub-env of a ``SerialEnv`` or ``ParallelEnv`` is an env of the fleet.

Each sub-env (a *leaf*) gets its own slot on the link and its own receiver, beside it,
wherever it runs: in the worker for a ``SerialEnv``, in the ``ParallelEnv``'s sub-process
otherwise. The wrapped factory swaps the batched env's leaf factories (before it starts) for
:class:`LeafFactory`, which hooks each leaf like an unbatched env, so a leaf applies at its
own safe points: its own reset (partial resets included), its steps, and its truncation.

What needs the collector lives beside the batched env, in :class:`~.group.EnvGroup`: its place in
the worker loop (one member for all sub-envs; an idle apply goes to a ``SerialEnv``'s leaf directly, or as a
partial reset of that sub-env through the collector; a ``ParallelEnv``'s leaves are served
by their own processes' loops and wake the group through their slots' relays), the busy marks, the tags, and
the batched env's own transforms (its receiver, :mod:`.level`, caught up after a step that
saw a change and when a rollout begins). A leaf writes into its slot the version its latest
step ran under and the one its observation comes from, only when they change;
:class:`BatchedHooks` reads them after a batched step only while some sub-env is unsettled,
and writes ``env_version`` and ``env_index`` once per rollout, row by row.
"""

from __future__ import annotations

import traceback
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
from tensordict import TensorDictBase
from torchrl.envs import EnvBase, ParallelEnv
from torchrl.envs.batched_envs import BatchedEnvBase

from envsync.configure import apply_config
from envsync.errors import EnvSyncError, ValidationError
from envsync.integrations.torchrl.adapter import EnvHooks, serve_env
from envsync.integrations.torchrl.level import outer_env
from envsync.integrations.torchrl.tags import INDEX_KEY, VERSION_KEY, Columns, Filled, set_tag, truncate_at
from envsync.links.base import LinkHandle
from envsync.spec import ApplySpec
from envsync.worker.owner import Owner
from envsync.worker.receiver import EnvStateReceiver

BIND = "_envsync_bind"
APPLY_NOW = "_envsync_apply_now"
SERVE = "_envsync_serve"
HOOKS = "_envsync_batched"
MAX_ROUNDS = 8
"""Rounds of an idle apply while pushes keep landing (each waits for the group's lock)."""


def find_batched(env: Any) -> BatchedEnvBase | None:
    """The ``SerialEnv``/``ParallelEnv`` a (possibly transformed) env is built on, if any."""
    while env is not None:
        if isinstance(env, BatchedEnvBase):
            return env
        env = getattr(env, "base_env", None)
    return None


def prepare_leaf(env: EnvBase, spec: ApplySpec, initial_config: TensorDictBase) -> EnvBase:
    """Hook one sub-env of a batched env like an unbatched env, give it the template config,
    and add the entry points its group calls (through a ``ParallelEnv``'s channel)."""
    hooks = EnvHooks.install(env, spec, initial_config)
    apply_config(env, spec.apply, initial_config)
    env.__dict__[BIND] = _leaf_call(env, hooks, _bind_leaf)
    env.__dict__[APPLY_NOW] = _leaf_call(env, hooks, _apply_now)
    env.__dict__[SERVE] = _leaf_call(env, hooks, _serve)
    return env


def _leaf_call(env: EnvBase, hooks: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """A leaf entry point that never raises (a ``ParallelEnv`` sub-process dies of an
    exception): it answers ``(traceback text or "", result)``."""
    env_ref = weakref.ref(env)

    def call(*args: Any) -> tuple[str, Any]:
        try:
            return "", fn(env_ref(), hooks, *args)
        except Exception:
            return traceback.format_exc(), None

    return call


def _bind_leaf(
    env: EnvBase, hooks: EnvHooks, handle: LinkHandle, slot: int, env_index: int, loop: bool, gated: bool
) -> bool:
    receiver: EnvStateReceiver = serve_env(env, hooks, handle, slot, env_index, None, relay=loop, gated=gated)
    return receiver.start(loop=receiver.link if loop else None)


def _apply_now(env: EnvBase, hooks: Any) -> None:
    if hooks.receiver is not None:
        hooks.receiver.apply_if_idle()


def _serve(env: EnvBase, hooks: Any) -> None:
    if hooks.receiver is not None:
        hooks.receiver.serve()


def prepare_batched(batched: BatchedEnvBase, spec: ApplySpec, wrap_leaf: Callable[[Any], Any]) -> None:
    """Make every sub-env of ``batched`` (not started yet) an env of the fleet: each of its
    leaf factories is replaced by ``wrap_leaf(factory)`` (which calls :func:`prepare_leaf`).

    Raises:
        ValidationError: the batched env is started already, or its sub-envs are batched.
    """
    if isinstance(batched.__dict__.get(HOOKS), BatchedHooks):
        return
    if not batched.is_closed:
        raise ValidationError(
            f"the {type(batched).__name__} was started before envsync saw it: build it (and return it from "
            "your factory) without resetting or stepping it, so envsync can reach its sub-envs"
        )
    if tuple(batched.batch_size) != (batched.num_workers,):
        raise ValidationError(
            f"envsync needs unbatched sub-envs in a {type(batched).__name__}; its batch size is "
            f"{list(batched.batch_size)} for {batched.num_workers} sub-envs"
        )
    batched.create_env_fn = [wrap_leaf(fn) for fn in batched.create_env_fn]
    BatchedHooks.install(batched, spec)


class BatchedHooks:
    """Frame counting and per-sub-env tags on a batched env (installed by the factory).

    Its ``_step``, ``_reset`` and ``step_and_maybe_reset`` are replaced on the instance;
    after each batched step, while some sub-env is unsettled, the versions every leaf noted
    in its slot are read and recorded as per-row changes.
    """

    def __init__(self, env: EnvBase, spec: ApplySpec) -> None:
        self.num_envs = int(env.batch_size[0])
        self.spec = spec
        self.group: Group | None = None
        self.frame = 0
        # the batched env's owner: its group's idle work and its level's applies against the
        # collector's rollouts, and the fast path of its steps (settled, depth)
        self.owner = Owner()
        self.owner.settled = True
        self._root = Columns(np.zeros(self.num_envs, dtype=np.int64))
        self._next = Columns(np.zeros(self.num_envs, dtype=np.int64))
        self._filled = Filled()  # what the batch's version tags hold from the last rollout
        self._step = env._step
        self._reset = env._reset
        self._step_and_maybe_reset = env.step_and_maybe_reset

    hooks_step_and_maybe_reset = True
    """Whether the env's own ``step_and_maybe_reset`` is hooked too (a ``ParallelEnv``'s
    steps and resets its sub-envs without calling ``_step``/``_reset``)."""

    @classmethod
    def install(cls, env: EnvBase, spec: ApplySpec) -> BatchedHooks:
        return cls(env, spec).attach(env)

    def attach(self, env: EnvBase) -> Any:
        """Replace ``env``'s ``_step`` and ``_reset`` (and ``step_and_maybe_reset``) on the instance."""
        env.__dict__[HOOKS] = self
        env._step = self.step
        env._reset = self.reset
        if self.hooks_step_and_maybe_reset:
            env.step_and_maybe_reset = self.step_and_maybe_reset
        return self

    @staticmethod
    def of(env: Any) -> tuple[EnvBase, BatchedHooks] | None:
        """The hooked batched env inside a collector's env (torchrl may wrap it) and its hooks."""
        while env is not None:
            hooks = getattr(env, "__dict__", {}).get(HOOKS)
            if isinstance(hooks, BatchedHooks):
                return env, hooks
            env = getattr(env, "base_env", None)
        return None

    def leaves(self, env: EnvBase) -> Leaves:
        """How the group reaches the envs of the fleet that ``env`` holds."""
        assert isinstance(env, BatchedEnvBase)
        return SubEnvs(env)

    @staticmethod
    def own_transforms(env: EnvBase, collector: Any) -> EnvBase | None:
        """The env that holds the batched env's own transforms: the ``TransformedEnv`` the
        collector steps, when there is one around the batched env."""
        return outer_env(collector.env)

    def step(self, tensordict: TensorDictBase) -> TensorDictBase:
        owner = self.owner
        if owner.depth:
            return self._step(tensordict)
        owner.depth = 1
        try:
            out = self._step(tensordict)
        finally:
            owner.depth = 0
        self._after_step()
        return out

    def step_and_maybe_reset(self, tensordict: TensorDictBase) -> tuple[TensorDictBase, TensorDictBase]:
        owner = self.owner
        owner.depth += 1
        try:
            out = self._step_and_maybe_reset(tensordict)
        finally:
            owner.depth -= 1
        if not owner.depth:
            self._after_step()
        return out

    def reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDictBase:
        out = self._reset(tensordict, **kwargs)
        self._after_reset()
        return out

    def _after_reset(self) -> None:
        group = self.group
        if not self.owner.depth and group is not None:
            group.catch_up()  # the batched env's own entries, for the envs just reset
            self._root.mark(self.frame, group.read()[1])
            self.owner.unsettle()

    def _after_step(self) -> None:
        frame = self.frame
        self.frame = frame + 1
        group = self.group
        if group is None or (self.owner.settled and group.unchanged()):
            return
        group.catch_up()  # the batched env's own entries, for the next step
        ran, obs, _, settled = group.read()
        self._next.mark(frame, ran)
        self._root.mark(frame + 1, obs)
        self.owner.settled = settled

    def begin(self) -> None:
        """A rollout starts: frames count from 0; tags carry over from the leaves' state."""
        self.frame = 0
        group = self.group
        if group is None:
            return
        versions = group.settled_versions()
        if versions is not None:  # no read of every env's counters at every rollout of thousands of worlds
            self._root = Columns(versions)
            self._next = Columns(versions)
            return
        group.catch_up()  # what the worker's envs applied while idle
        _, obs, applied, settled = group.read()
        self._root = Columns(obs)
        self._next = Columns(applied)
        # settled, with no push since: the rollout's steps take the fast path from the first
        self.owner.settled = settled

    def tag(self, batch: TensorDictBase, first_env: int) -> None:
        """Write the rollout's tags into ``batch`` (leading dim: the sub-envs)."""
        shape = batch.batch_size
        for key, columns in ((VERSION_KEY, self._root), (("next", VERSION_KEY), self._next)):
            out = batch.get(key, None)
            if out is None:
                out = torch.empty(shape, dtype=torch.int64)
                set_tag(batch, key, out)
            self._filled.fill(key, out, columns)
        for key in (INDEX_KEY, ("next", INDEX_KEY)):  # the same every rollout: written once into the buffer
            if batch.get(key, None) is None:
                index = torch.arange(first_env, first_env + self.num_envs, dtype=torch.int64)
                set_tag(batch, key, index.view(-1, *([1] * (len(shape) - 1))).expand(shape).clone())

    @staticmethod
    def truncate_last(batch: TensorDictBase, rows: list[int]) -> None:
        """End the rollout's last frame of these sub-envs as truncated."""
        nxt = batch.get("next")
        for i in rows:
            truncate_at(nxt, (i, -1))


class Group(Protocol):
    """What a batched env's hooks read of its group (:class:`~.group.EnvGroup`)."""

    def unchanged(self) -> bool:
        """Whether no push reached any sub-env since the group last settled."""

    def read(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        """Per sub-env (columns): the version its last step ran under, its observation's, its
        applied one; and whether every sub-env is settled."""

    def settled_versions(self) -> np.ndarray | None:
        """Every sub-env's version while nothing changed since the group last read them all
        settled; else ``None``."""

    def catch_up(self) -> None:
        """Load the batched env's own entries the worker's envs all applied."""

    def unsettled(self, *, pending: bool) -> np.ndarray:
        """A mask of the sub-envs whose safe point has something to do (``pending``: a
        version to apply counts)."""


class Leaves(Protocol):
    """How a group reaches the envs of the fleet one batched env holds."""

    in_own_loops: bool
    """Whether the envs' own receivers are in their processes' worker loops (apply while idle,
    answer gathers): the group then only pokes them, and is woken through the slots' relays for what they hand it."""

    rows: bool
    """Whether the envs are rows of one natively batched env (one process, one slot lock and
    one wake-up for all: the group acknowledges them as columns)."""

    def bind(self, handle: LinkHandle, first_slot: int, first_env: int, *, gated: bool) -> bool:
        """Bind env ``i`` to link slot ``first_slot + i`` as fleet env ``first_env + i``
        (``gated``: under a batched level, which acknowledges their versions as applied);
        return whether any caught up with a version."""

    def apply_now(self, indices: np.ndarray) -> None:
        """Apply these envs' pending versions now (the collector is idle; a ``"step"`` version;
        not called when they are in their own loops)."""

    def serve(self, indices: np.ndarray) -> None:
        """Answer these envs' pending gathers now (the collector is idle or at a rollout's
        end; not called when they are in their own loops)."""


class SubEnvs:
    """The sub-envs of a ``SerialEnv`` or ``ParallelEnv``, each with its receiver beside it.

    The receivers of a ``ParallelEnv``'s sub-envs are in their own processes' worker loops (the sender
    wakes them directly): they answer gathers and apply a ``"step"`` version while idle
    themselves, so the group never writes into the ``ParallelEnv``'s channels from the
    worker loop (the user's thread may use them, e.g. torchrl's attribute forwarding); it only
    pokes them, and they wake it through their slots' relays for what is the group's (the
    batched env's own entries; an idle apply that resets the sub-env through the collector).
    A ``SerialEnv``'s sub-envs run in this process: the group, in this process's loop, applies and serves.
    """

    def __init__(self, batched: BatchedEnvBase) -> None:
        self._batched = weakref.ref(batched)
        self.in_own_loops = isinstance(batched, ParallelEnv)
        self.rows = False

    def _live(self) -> BatchedEnvBase:
        batched = self._batched()
        if batched is None:
            raise EnvSyncError("the batched env is gone")
        return batched

    def bind(self, handle: LinkHandle, first_slot: int, first_env: int, *, gated: bool) -> bool:
        batched = self._live()
        count = int(batched.num_workers)
        calls = {i: (handle, first_slot + i, first_env + i, self.in_own_loops, gated) for i in range(count)}
        return any(call_leaves(batched, calls, BIND).values())

    def apply_now(self, indices: np.ndarray) -> None:
        call_leaves(self._live(), {i: () for i in indices.tolist()}, APPLY_NOW)

    def serve(self, indices: np.ndarray) -> None:
        if not self.in_own_loops:
            call_leaves(self._live(), {i: () for i in indices.tolist()}, SERVE)


def call_leaves(batched: BatchedEnvBase, calls: dict[int, tuple[Any, ...]], name: str) -> dict[int, Any]:
    """Call a leaf entry point of each sub-env in ``calls`` with its arguments: through the
    ``ParallelEnv``'s channels (every call sent before any answer is read, so the sub-envs
    work in parallel), or directly in a ``SerialEnv``; raise what one raised."""
    if batched.is_closed:
        batched.start()
    answers: dict[int, tuple[str, Any]] = {}
    if isinstance(batched, ParallelEnv):
        for index, args in calls.items():
            batched.parent_channels[index].send((name, (list(args), {})))
        for index in calls:
            answers[index] = batched.parent_channels[index].recv()[1]
    else:
        for index, args in calls.items():
            answers[index] = batched._envs[index].__dict__[name](*args)
    for index, (text, _) in answers.items():
        if text:
            raise EnvSyncError(f"sub-env {index} of the {type(batched).__name__}:\n{text}")
    return {index: result for index, (_, result) in answers.items()}
