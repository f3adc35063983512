"""EnvStateReceiver: notice a version -> apply it at a safe point -> acknowledge.

One receiver lives beside each level of a worker's env that holds state, bound to one link
end and one env adapter: a plain env, each sub-env of a batched env, each row of a natively
batched env, an env outside any collector, and a batched env's own transforms (whose end is
the gate over its envs' ends, :class:`~envsync.worker.gate.GateEnd`). Its place
(:mod:`envsync.worker.places`) says which entries it owns and what it does besides applying. Its
safe points are called by the adapter from the thread that drives the env:
:meth:`before_reset` (before the env resets), :meth:`before_step` (before a step) and
:meth:`truncate_now` (after a step); a batched level's by its group
(:meth:`apply_pending`). While the collector is idle, the process's worker loop
(:mod:`envsync.worker.loop`), woken by the sender, applies ``"step"`` and ``"truncate"``
versions at once.

One apply, in order: config method -> env state (copied from the link straight into the
env's tensors) -> re-initialisation (not after a version that only merges statistics) ->
(``"truncate"`` while idle: the reset that follows).
Everything runs inside one ``try``: if any part raises, the previous config and env state
are restored, the failure is reported with its traceback, and the env keeps running its
previous version. Nothing is acknowledged as applied before the whole apply succeeded. An
entry this receiver loaded whose stamp went back to 0 (a rollback of the push that first
pushed it) gets back the value it had before that push, even when the receiver never saw the
rollback's own version.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Generic, TypeVar

import numpy as np
import torch
from tensordict import TensorDictBase

from envsync.errors import EnvSyncError
from envsync.levels import BATCHED
from envsync.links.base import Notices, ReceiverLink
from envsync.protocol import NO_FAILURE, ApplyAt, Kind, Reply, Request
from envsync.reinit import STATS
from envsync.spec import ApplySpec
from envsync.state import FlatConfig, flat_names
from envsync.worker import loop as worker_loop
from envsync.worker.env_adapter import EnvAdapter
from envsync.worker.owner import Owner
from envsync.worker.places import Place, Standalone

_MAX_RETRIES = 8


L = TypeVar("L", bound=ReceiverLink)


class EnvStateReceiver(Generic[L]):
    """The worker side of envsync, bound to one link end and one env adapter.

    Args:
        link: this worker's end of the link.
        spec: how versions are applied.
        adapter: the env this receiver serves.
        initial_config: the config the env was built with (version 0).
        place: where the env lives (:class:`~envsync.worker.places.Standalone`, the default, or
            :class:`~envsync.worker.places.SubEnv`).
        owner: the env's owner (:mod:`envsync.worker.owner`), shared with the hooks
            that step and reset it; a fresh one when not given.

    Examples:
        >>> EnvStateReceiver.__name__
        'EnvStateReceiver'
    """

    def __init__(
        self,
        *,
        link: L,
        spec: ApplySpec,
        adapter: EnvAdapter,
        initial_config: TensorDictBase | None,
        place: Place | None = None,
        owner: Owner | None = None,
    ) -> None:
        self.link = link
        self.latest = link.target
        """``latest()``: the version this receiver's end targets now (for an env, the latest
        one published to it: one integer read, what a step's fast path compares)."""
        self.spec = spec
        self.adapter = adapter
        self.owner = owner if owner is not None else Owner()
        self._lock = self.owner.lock
        self.version = 0
        self.seen = 0
        self._failed = NO_FAILURE
        self._config: FlatConfig | None = None
        if initial_config is not None:
            self._config = {k: v.clone() for k, v in flat_names(initial_config).items()}
        self._snapshot: dict[str, torch.Tensor] = {}  # what this apply replaced, for its restore
        self._kept: set[str] = set()
        self._first: set[str] = set()  # the entries this apply pushes for the first time
        self._before_first: dict[str, torch.Tensor] = {}  # what an entry's first push replaced
        self._stamps: dict[str, int] = {}
        self._handlers = {
            Kind.ENV_STATE: self._entries,
            Kind.BATCHED_STATE: self._entries,
            Kind.ATTRIBUTES: self._attributes,
        }
        self._closed = False
        self._truncates = spec.truncates
        self._applies_at_step = spec.apply_at is ApplyAt.STEP and not spec.truncates
        self.place: Place = place if place is not None else Standalone()
        self._owns = self.place.owns
        self._answers_level = self.place.owns(BATCHED)
        self._handed = 0  # the latest request handed to the batched env's level

    @property
    def worker(self) -> int:
        """This receiver's worker index on its link."""
        return self.link.worker

    def start(self, *, loop: Notices | None) -> bool:
        """Catch up with the latest desired state, and join the worker loop through ``loop``
        (its end's notices: the link end itself; ``None``: its group serves it); return
        whether it caught up. After catching up it resets its env when its place says it
        does (:attr:`Place.resets`; a sub-env's group resets the sub-env instead)."""
        caught_up = False
        with self._lock:
            if self._pending(self.link.target()):
                caught_up = self.apply_latest(reset_after=self.place.resets)
        if loop is not None:
            worker_loop.serve(self, [loop])
        return caught_up

    def close(self) -> None:
        """Leave the worker loop."""
        self._closed = True

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (the worker loop then drops this receiver)."""
        return self._closed

    def on_error(self, text: str) -> None:
        """An error escaped :meth:`on_wake`: the target version failed (it is not applied
        again until a newer one)."""
        target = self.link.target()
        self._failed = target
        self.link.report_failure(target, text)

    def _pending(self, target: int) -> bool:
        return target != self.version and target != self._failed

    @property
    def pending(self) -> bool:
        """Whether a version is published that this receiver neither holds nor failed."""
        return self._pending(self.link.target())

    def holds(self, stamps: dict[str, int]) -> bool:
        """Whether a version whose env-state entries are stamped ``stamps`` asks nothing of this
        receiver's level: it holds every entry the level owns as stamped there, and has no
        re-initialisation to run (a batched level's gate then acknowledges an env that reached
        that version without waiting for its siblings, :meth:`~envsync.worker.gate.GateEnd.ack_applied`)."""
        if self.adapter.has_reinit:
            return False
        return all(self._stamps.get(name, 0) == stamp for name, stamp in stamps.items() if self._owns(name))

    def apply_pending(self) -> None:
        """Apply a pending version now, in any mode: the caller knows its env is at a safe
        point (a batched level's group, once its envs applied what it gates on)."""
        with self._lock:
            if self._pending(self.link.target()):
                self.apply_latest(reset_after=False)

    def _notice(self, target: int) -> None:
        if target != self.seen:
            self.seen = target
            self.link.ack_received(target)

    def busy(self) -> AbstractContextManager[None]:
        """Mark the collector as driving the env: the worker loop keeps off meanwhile."""
        return self.owner.driving()

    def before_reset(self) -> None:
        """Safe point before the env resets: every mode applies a pending version here; the
        reset's observation comes from the version held then (noted in the link)."""
        if not self.owner.is_applying and self._pending(self.link.target()):
            with self._lock:
                self.apply_latest(reset_after=False)
        self.link.note_versions(None, self.version)

    def before_step(self) -> None:
        """Safe point before a step: arm a new version; ``"step"`` mode applies it. The step
        runs under the version held then (noted in the link)."""
        if self.owner.is_applying:
            return
        target = self.link.target()
        with self._lock:
            self._notice(target)
            if self._applies_at_step and self._pending(target):
                self.apply_latest(reset_after=False)
        self.link.note_versions(self.version, self.version)

    def truncate_now(self) -> bool:
        """Whether the step just taken must end the episode (``"truncate"`` mode, pending)."""
        return self._truncates and not self.owner.is_applying and self._pending(self.link.target())

    def settle(self, truncating: list[int]) -> None:
        """After a rollout: a truncating version applies here only if the rollout's last
        frame was truncated for it (``truncating``; one that arrives later is the idle
        worker loop's: a fresh episode); then a pending gather is answered."""
        if truncating or not self.spec.truncates:
            self.apply_if_idle()
        self.serve()

    def on_wake(self) -> None:
        """Called by the worker loop when woken by the sender (or every half second)."""
        with self._lock:
            self._notice(self.link.target())
            if not self.owner.driven:
                self.apply_if_idle()
                self.serve()

    def serve(self) -> None:
        """Answer a pending request by its kind (at a safe point): the env's entries, or what
        it holds at attribute paths; one for the batched env's own entries is its level's,
        handed over once."""
        request = self.link.request()
        if request is None:
            return
        with self._lock:
            if request.kind is Kind.BATCHED_STATE and not self._answers_level:
                if request.id != self._handed:
                    self._handed = request.id
                    self.place.hand_over()
                return
            answer(self.link, request, self._handlers[request.kind])

    def _entries(self, payload: dict[str, Any]) -> dict[str, torch.Tensor]:
        names = payload["names"]
        live = self.adapter.state_tensors() if names else {}
        out = {name: live[name] for name in names}
        self.adapter.note_read(out, self.link.target())
        return out

    def _attributes(self, payload: dict[str, Any]) -> dict[str, torch.Tensor]:
        return self.adapter.read_attributes(list(payload["paths"]))

    def apply_if_idle(self) -> None:
        """With the collector idle: ``"step"`` and ``"truncate"`` versions apply as the env's
        place says (:meth:`Place.idle_apply`)."""
        with self._lock:
            if self.spec.apply_at is ApplyAt.RESET or not self._pending(self.link.target()):
                return
            self.place.idle_apply(self)

    def apply_latest(self, *, reset_after: bool) -> bool:
        """Apply the latest desired state; on failure restore the previous one and report.
        Outpaced by the sender (a newer version each time it loads), it acknowledges
        nothing, restores the previous config, and stays pending for its next safe point."""
        with self._lock, self.owner.applying():
            return self._apply_latest(reset_after)

    def _apply_latest(self, reset_after: bool) -> bool:
        previous = self.version
        version = self.link.target()
        loaded: list[str] = []
        config = self._config
        try:
            for _ in range(_MAX_RETRIES):
                header = self.link.read_header()
                version = header.version
                self._notice(version)
                config = header.config
                self.adapter.apply_config(config)
                self._undo(header.stamps)
                # the entries of this receiver's level (envsync.levels), pushed since it last
                # applied and up to the header's version (a batched level's gate)
                names = [n for n, stamp in header.stamps.items() if self.version < stamp <= version and self._owns(n)]
                loaded = []
                keep_all = reset_after or self.adapter.has_reinit
                if self._load(version, names, loaded, keep_all=keep_all):
                    break
            else:  # nothing of the env state was loaded (a load checks the version first)
                trouble = self._restore([])
                if trouble:
                    raise EnvSyncError(f"outpaced by the sender, the previous config did not come back:{trouble}")
                return False
            if not _merge_only(loaded, config, self._config):
                self.adapter.reinit(version)
            if reset_after:
                self.version = version  # the reset's observation comes from this version
                self.adapter.reset()
        except Exception:
            self.version = previous
            text = traceback.format_exc()
            text += self._restore(loaded)
            self._failed = version
            self.link.report_failure(version, text)
            return False
        self._config = config
        for name in loaded:
            self._stamps[name] = header.stamps[name]
            if name not in self._first:  # pushed again: its first push can no longer be rolled back
                self._before_first.pop(name, None)
        self.version = version
        self.link.ack_applied(version)
        return True

    def _load(self, version: int, names: list[str], loaded: list[str], *, keep_all: bool) -> bool:
        """Copy the given env-state entries from the link straight into the env. What they
        replace is kept (one reused buffer per entry) when a later step of this apply may
        still fail (``keep_all``); what an entry's first push replaces is kept until the
        entry is pushed again or rolled back (only this worker knows it: a fleet rollback
        puts it back, see :meth:`_undo`; the sender republishes the others). An entry its
        env does not hold yet (a lazy transform's, until its first reset) loads nothing: the
        apply waits for the next safe point."""
        if not names:
            return True
        live = self.adapter.state_tensors()
        if any(name not in live for name in names):
            return False
        keep = set(names) if keep_all else set()
        self._first = first = {name for name in names if not self._stamps.get(name)}

        def load(name: str, view: torch.Tensor) -> None:
            target = live[name]
            if name in first:
                self._before_first[name] = target.detach().clone()
            if name in keep:
                kept = self._snapshot.get(name)
                if kept is None or kept.shape != target.shape or kept.dtype != target.dtype:
                    self._snapshot[name] = target.detach().clone()
                else:
                    kept.copy_(target)
            loaded.append(name)
            target.data.copy_(view)

        done = self.link.load_entries(version, names, load)  # all or nothing, under the slot lock
        self._kept = keep if done else set()
        self.adapter.commit({name: live[name] for name in loaded}, version=version)
        return done

    def _undo(self, stamps: dict[str, int]) -> None:
        """Entries this receiver loaded whose stamp is 0 again (their first push rolled back):
        put back what that push replaced. An entry pushed again since keeps its new value."""
        undone = [name for name, stamp in self._stamps.items() if stamp and not stamps.get(name, 0)]
        if not undone:
            return
        live = self.adapter.state_tensors()
        restored = [name for name in undone if name in self._before_first and name in live]
        for name in restored:
            live[name].data.copy_(self._before_first.pop(name))
        for name in undone:
            self._stamps[name] = 0
        self.adapter.commit({name: live[name] for name in restored}, version=0, restore=True)

    def _restore(self, loaded: list[str]) -> str:
        """Put the previous config and env state back; return what failed doing so."""
        try:
            if self._config is not None:
                self.adapter.apply_config(self._config)
            live = self.adapter.state_tensors() if loaded else {}
            restored = [name for name in loaded if name in self._kept or name in self._first]
            for name in restored:
                kept = self._snapshot[name] if name in self._kept else self._before_first[name]
                live[name].data.copy_(kept)
            self.adapter.commit({name: live[name] for name in restored}, version=self.version, restore=True)
        except Exception:
            return "\nwhile restoring the previous state:\n" + traceback.format_exc()
        return ""


def answer(end: ReceiverLink, request: Request, handle: Callable[[dict[str, Any]], dict[str, torch.Tensor]]) -> None:
    """Answer ``request`` on ``end`` with ``handle(request.payload)``; if handling raises,
    answer with the failure and its traceback instead (the sender raises it as a
    :class:`~envsync.errors.GatherError`). Every worker-side answer goes through here: a
    failure to answer is never reported as a failure to apply a version, and never reaches
    the collector's loop."""
    try:
        reply = Reply(request.id, handle(request.payload))
    except Exception:
        reply = Reply(request.id, {}, traceback.format_exc())
    end.reply(reply)


def _merge_only(loaded: list[str], config: FlatConfig, previous: FlatConfig | None) -> bool:
    """Whether a version brought merged statistics (``stats.*``) and nothing else: no other
    env state, the same config. Re-initialisation follows a new config or env state; after a
    ``sync_stats`` merge it would only throw the merge away (or, recomputing, step the env)."""
    if not loaded or any(not name.startswith(f"{STATS}.") for name in loaded) or previous is None:
        return False
    same = previous.keys() == config.keys()
    return same and all(config[k] is previous[k] or np.array_equal(config[k], previous[k]) for k in config)
