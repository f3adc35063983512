"""A batched env's group: what of its sub-envs needs the collector, beside the batched env.

Its place in the worker loop (one member for all its sub-envs), the busy marks, the tags,
the safe points of the batched env's own transforms (their receiver, on the gate over the
sub-envs' ends: :mod:`.level`) and the rollout's safe points of a worker whose env is a
``SerialEnv``, a ``ParallelEnv`` or a natively batched env (see :mod:`.batched` for the
sub-envs' own hooks).
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
from tensordict import TensorDictBase

from envsync.errors import ValidationError
from envsync.integrations.torchrl.batched import MAX_ROUNDS, BatchedHooks, Leaves
from envsync.integrations.torchrl.level import level_receiver
from envsync.integrations.torchrl.rollouts import guard_commands, wrap_rollout
from envsync.integrations.torchrl.tags import tags_set_aside
from envsync.links.base import LinkHandle
from envsync.protocol import ApplyAt
from envsync.worker.receiver import EnvStateReceiver
from envsync.worker.siblings import Siblings


class EnvGroup:
    """The sub-envs of one batched env, seen from the process that drives it: their idle
    work (one member of the worker loop), their busy marks and the reads behind their tags.

    Args:
        collector: the (inner) collector that drives the batched env.
        hooks: the batched env's hooks.
        leaves: how to reach its envs.
        handle: the link.
        first_slot: the link slot of sub-env 0 (the others follow).
    """

    def __init__(
        self, collector: Any, hooks: BatchedHooks, leaves: Leaves, handle: LinkHandle, first_slot: int
    ) -> None:
        self.spec = hooks.spec
        self.num_envs = hooks.num_envs
        self.leaves = leaves
        self._collector = weakref.ref(collector)
        self.envs = Siblings(handle, first_slot, self.num_envs, rows=leaves.rows)
        self._seen = np.zeros(0, dtype=np.int64)
        self._settled_at = np.zeros(0, dtype=np.int64)  # every env's version at the last settled read
        self._pushed = -1  # the link's pushed mark when the group last settled
        self.gate = self.envs.gate  # the batched level's end (its receiver's, if it has one)
        # the batched env's owner: the worker loop's idle work against the collector's rollouts;
        # driving the batched env marks every env under it busy
        self.owner = hooks.owner
        self.owner.marks_with(self.gate.set_busy)
        self._lock = self.owner.lock
        self._closed = False
        self.level: EnvStateReceiver | None = None  # the batched env's own transforms' receiver, if any

    def unchanged(self) -> bool:
        """Whether no push reached any sub-env since the group last settled: one integer read
        while nothing was pushed to the link (the fast path of every step), the targets read
        once after a push (which may have gone to another worker's envs)."""
        pushed = self.envs.pushed()
        if pushed == self._pushed:
            return True
        if not np.array_equal(self.envs.targets(), self._seen):
            return False
        self._pushed = pushed
        return True

    def read(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        """Per sub-env (columns): the version its last step ran under, its observation's, its
        applied one; and whether every sub-env is settled (remembering the targets it settled on)."""
        pushed = self.envs.pushed()  # before the targets: a push landing between is seen next time
        targets, reached, failed, ran, obs = self.envs.versions()
        settled = bool((((targets == reached) | (targets == failed)) & (ran == reached) & (obs == reached)).all())
        settled = settled and (self.level is None or not self._level_behind())
        if settled:
            self._seen, self._pushed, self._settled_at = targets, pushed, reached
        return ran, obs, reached, settled

    def settled_versions(self) -> np.ndarray | None:
        """Every env's version while nothing changed since the group last read them all settled
        (the owner settled, no push since: each env's step, observation and applied version
        are then one, what a rollout starts from); else ``None``. No counter is read."""
        return self._settled_at if self.owner.settled and self.unchanged() else None

    def _level_behind(self) -> bool:
        """Whether the batched level has a version to apply, or envs to acknowledge."""
        assert self.level is not None
        return self.level.pending or self.gate.unacknowledged()

    def unsettled(self, *, pending: bool) -> np.ndarray:
        """A mask of the sub-envs whose safe point has something to do
        (:meth:`~envsync.worker.siblings.Siblings.unsettled`)."""
        return self.envs.unsettled(pending=pending)

    def pending(self) -> np.ndarray:
        """The sub-envs with a version not applied (nor failed) yet (int64, ascending)."""
        return self.envs.pending()

    def busy(self) -> AbstractContextManager[None]:
        """Mark the collector as driving the batched env: the worker loop keeps off meanwhile,
        and so do a ``ParallelEnv``'s sub-envs' own loops (told through their slots)."""
        return self.owner.driving()

    def apply_if_idle(self, only: list[int] | None = None) -> None:
        """With the collector idle: ``"step"`` versions apply at once in their leaves;
        truncating ones (and re-inits that move the env) reset those sub-envs through the
        collector, and the leaves apply at their reset."""
        with self._lock:
            if self.spec.apply_at is ApplyAt.RESET:
                return
            # again while pushes land meanwhile (one integer read tells: no second read of
            # every env's counters when none did)
            for _ in range(MAX_ROUNDS):
                pushed = self.envs.pushed()
                pending = self.pending()
                if only is not None:
                    pending = pending[np.isin(pending, only)]
                collector = self._collector()
                if not len(pending) or collector is None:
                    return
                if self.spec.idle_resets:
                    collector.reset(index=pending.tolist())
                elif self.leaves.in_own_loops:
                    self.envs.poke(pending.tolist())
                else:
                    self.leaves.apply_now(pending)
                if self.envs.pushed() == pushed:
                    return

    def catch_up(self) -> None:
        """Apply the batched env's own level up to what the worker's envs all applied, and
        acknowledge what it holds (a safe point)."""
        level = self.level
        if level is not None:
            with self._lock:
                level.apply_pending()
                self.gate.ack_applied(level.version, level.holds)

    def serve(self) -> None:
        """Answer pending gathers: the sub-envs' (unless their receivers serve them) and the
        batched env's own (at a rollout's end, or with the collector idle)."""
        with self._lock:
            asked = self.envs.asked()
            if len(asked):
                self.leaves.serve(asked)
            if self.level is not None and self.gate.request() is not None:
                self.catch_up()
                self.level.serve()

    def settle(self, truncating: list[int]) -> None:
        """After a rollout: a truncating version applies here only for the sub-envs whose
        last frame this rollout truncated (one that arrives later is the worker loop's: a
        fresh episode); then pending gathers are answered."""
        if not (self.owner.settled and self.unchanged()):  # settled with no push since: nothing to apply
            if truncating or not self.spec.truncates:
                self.apply_if_idle(truncating if self.spec.truncates else None)
            self.catch_up()
        self.serve()

    def truncating(self) -> list[int]:
        """The sub-envs whose pending version must end their episode as truncated."""
        return self.pending().tolist() if self.spec.truncates else []

    def on_wake(self) -> None:
        """The worker loop was woken: acknowledge what reached the envs; apply and serve if idle."""
        with self._lock:
            self.envs.notice()
            if not self.owner.driven:
                self.apply_if_idle()
                self.catch_up()
                self.serve()

    def on_error(self, text: str) -> None:
        """An error escaped :meth:`on_wake`: every env with a version pending fails it (its
        receiver keeps its own failed mark)."""
        self.envs.fail_pending(text)

    def start(self) -> None:
        """Join the worker loop with every env's end: its slot's wake-up, or, when the
        sub-envs' own receivers serve them in their processes, its relay."""
        self.envs.join(self, relayed=self.leaves.in_own_loops)

    def close(self) -> None:
        """Leave the worker loop."""
        self._closed = True

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (the worker loop then drops the group)."""
        return self._closed


def bind_batched(collector: Any, handle: LinkHandle, first_slot: int, first_env: int, envs: int) -> EnvGroup:
    """Bind every sub-env of ``collector``'s batched env to its slot, and catch up.

    Raises:
        ValidationError: the batched env has another number of sub-envs than the link
            expects per worker.
        EnvSyncError: a leaf could not be bound.
    """
    found = BatchedHooks.of(collector.env)
    assert found is not None
    env, hooks = found
    if hooks.num_envs != envs:
        raise ValidationError(
            f"this worker's batched env has {hooks.num_envs} sub-envs; the sender expects {envs} per worker "
            "(every worker must drive as many envs; see envs_per_worker=)"
        )
    leaves = hooks.leaves(env)
    group = EnvGroup(collector, hooks, leaves, handle, first_slot)
    own = hooks.own_transforms(env, collector)
    if own is not None:
        group.level = level_receiver(own, hooks.spec, group.gate, group.owner)
    caught_up = leaves.bind(handle, first_slot, first_env, gated=own is not None)
    hooks.group = group
    group_ref = weakref.ref(group)

    def finish(batch: TensorDictBase, owner: EnvGroup) -> list[int]:
        hooks.tag(batch, first_env)
        truncating = owner.truncating()
        hooks.truncate_last(batch, truncating)
        return truncating

    wrap_rollout(collector, group_ref, hooks.begin, finish, tags_set_aside)
    guard_commands(collector, group_ref)
    group.catch_up()  # the batched env's own entries too, before the reset below sees them
    if caught_up:
        collector.reset()  # the leaves run the latest version: start fresh episodes under it
    group.start()
    return group
