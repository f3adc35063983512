"""EnvStateReceiver: notice a version -> apply it at a safe point -> acknowledge.

One receiver lives beside each env, bound to one link end and one env adapter. Its safe
points are called by the adapter from the thread that drives the env: :meth:`before_reset`
(before the env resets), :meth:`before_step` (before a step) and :meth:`truncate_now`
(after a step). While the collector is idle, the process's worker loop (:mod:`envsync.worker_loop`), woken
by the sender, applies ``"step"`` and ``"truncate"`` versions at once.

One apply, in order: config method -> env state (copied from the link straight into the
env's tensors) -> re-initialisation (not after a version that only merges statistics) ->
(``"truncate"`` while idle: the reset that follows).
Everything runs inside one ``try``: if any part raises, the previous config and env state
are restored, the failure is reported with its traceback, and the env keeps running its
previous version. Nothing is acknowledged as applied before the whole apply succeeded.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np
import torch
from tensordict import TensorDictBase

from envsync import worker_loop
from envsync.errors import EnvSyncError
from envsync.exclusion import Exclusion
from envsync.levels import is_batched
from envsync.links.base import End, ReceiverLink
from envsync.places import Place, Standalone
from envsync.protocol import NO_FAILURE, ApplyAt, Kind, Reply, Request
from envsync.reinit import STATS
from envsync.spec import ApplySpec
from envsync.state import FlatConfig, flat_names

_MAX_RETRIES = 8


class EnvAdapter(Protocol):
    """What a receiver needs from the env it serves (see ``envsync.integrations``)."""

    def apply_config(self, config: FlatConfig) -> None:
        """Give the env a whole config (by dotted name) through the user's config method."""

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The env's live ``state_dict()`` tensors by key (written in place), and its running
        statistics (``stats.*``: fresh exports, loaded back by :meth:`commit`)."""

    def read_attributes(self, paths: list[str]) -> dict[str, torch.Tensor]:
        """Copies of what the env holds at attribute paths (a row's part, for a row of a
        natively batched env), by path."""

    def note_read(self, entries: dict[str, torch.Tensor], target: int) -> None:
        """A gather read ``entries`` while ``target`` was the latest version published: the
        statistics of a version published later (a merge of what was read) are loaded on top
        of what the env saw after this read."""

    def commit(self, written: dict[str, torch.Tensor], *, version: int, restore: bool = False) -> None:
        """Load entries of ``version`` written into :meth:`state_tensors` that are not live
        (``stats.*``): statistics on top of what the env saw since the latest read before
        ``version`` was published (see :meth:`note_read`), unless ``restore`` (the env's own
        earlier values, put back) or the same transform's own entries were written too (its
        whole state: a checkpoint row)."""

    @property
    def has_reinit(self) -> bool:
        """Whether any re-initialisation policy runs after an apply (and so may fail)."""

    def reinit(self, version: int) -> None:
        """Run the re-initialisation policies after a version is in place."""

    def reset(self) -> None:
        """Reset the env through its collector, so the next rollout starts a fresh episode."""


class EnvStateReceiver:
    """The worker side of envsync, bound to one link end and one env adapter.

    Args:
        link: this worker's end of the link.
        spec: how versions are applied.
        adapter: the env this receiver serves.
        initial_config: the config the env was built with (version 0).
        place: where the env lives (:class:`~envsync.places.Standalone`, the default, or
            :class:`~envsync.places.SubEnv`).
        exclusion: the env's exclusion (:mod:`envsync.exclusion`), shared with the hooks
            that step and reset it; a fresh one when not given.

    Examples:
        >>> EnvStateReceiver.__name__
        'EnvStateReceiver'
    """

    def __init__(
        self,
        *,
        link: End,
        spec: ApplySpec,
        adapter: EnvAdapter,
        initial_config: TensorDictBase | None,
        place: Place | None = None,
        exclusion: Exclusion | None = None,
    ) -> None:
        self.link = link
        self.spec = spec
        self.adapter = adapter
        self.exclusion = exclusion if exclusion is not None else Exclusion()
        self._lock = self.exclusion.lock
        self.applying = False  # read only by the thread that holds the exclusion
        self.version = 0
        self.seen = 0
        self._failed = NO_FAILURE
        self._config: FlatConfig | None = None
        if initial_config is not None:
            self._config = {k: v.clone() for k, v in flat_names(initial_config).items()}
        self._snapshot: dict[str, torch.Tensor] = {}
        self._kept: set[str] = set()
        self._snapshot_version = 0
        self._stamps: dict[str, int] = {}
        self._handlers = {Kind.ENV_STATE: self._entries, Kind.ATTRIBUTES: self._attributes}
        self._closed = False
        self._truncates = spec.truncates
        self._applies_at_step = spec.apply_at is ApplyAt.STEP and not spec.truncates
        self.place: Place = place if place is not None else Standalone()
        self._handed = 0  # the latest request handed to the batched env's level

    @property
    def worker(self) -> int:
        """This receiver's worker index on its link."""
        return self.link.worker

    def start(self, *, loop: bool = True) -> bool:
        """Catch up with the latest desired state, and (``loop``) join the worker loop; return
        whether it caught up. After catching up it resets its env when its place says it
        does (:attr:`Place.resets`; a sub-env's group resets the sub-env instead)."""
        caught_up = False
        with self._lock:
            if self._pending(self.link.target()):
                caught_up = self.apply_latest(reset_after=self.place.resets)
        if loop:
            worker_loop.serve(self, [self.link])
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

    def _notice(self, target: int) -> None:
        if target != self.seen:
            self.seen = target
            self.link.ack_received(target)

    def busy(self) -> AbstractContextManager[None]:
        """Mark the collector as driving the env: the worker loop keeps off meanwhile."""
        return self.exclusion.driving(self.link.set_busy)

    def before_reset(self) -> None:
        """Safe point before the env resets: every mode applies a pending version here."""
        if self.applying:
            return
        target = self.link.target()
        if self._pending(target):
            with self._lock:
                self.apply_latest(reset_after=False)

    def before_step(self) -> None:
        """Safe point before a step: arm a new version; ``"step"`` mode applies it."""
        if self.applying:
            return
        target = self.link.target()
        with self._lock:
            self._notice(target)
            if self._applies_at_step and self._pending(target):
                self.apply_latest(reset_after=False)

    def truncate_now(self) -> bool:
        """Whether the step just taken must end the episode (``"truncate"`` mode, pending)."""
        return self._truncates and not self.applying and self._pending(self.link.target())

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
            if not self.exclusion.driven:
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
            if request.kind is Kind.BATCHED_STATE:
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
        self.applying = True
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
                self._undo(header.undo)
                # the batched env's own entries are its group's (envsync.levels)
                names = [n for n, stamp in header.stamps.items() if stamp > self.version and not is_batched(n)]
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
        finally:
            self.applying = False
        self._config = config
        self._stamps.update({name: header.stamps[name] for name in loaded})
        self.version = version
        self.link.ack_applied(version)
        return True

    def _load(self, version: int, names: list[str], loaded: list[str], *, keep_all: bool) -> bool:
        """Copy the given env-state entries from the link straight into the env. What they
        replace is kept (one reused buffer per entry) where it cannot be had otherwise: for
        every entry when a later step of this apply may still fail (``keep_all``), else for
        the entries pushed here for the first time, whose live values only this worker knows
        (a fleet rollback puts them back; the sender republishes the others)."""
        if not names:
            return True
        live = self.adapter.state_tensors()
        keep = set(names) if keep_all else {name for name in names if not self._stamps.get(name)}

        def load(name: str, view: torch.Tensor) -> None:
            target = live[name]
            if name in keep:
                kept = self._snapshot.get(name)
                if kept is None or kept.shape != target.shape or kept.dtype != target.dtype:
                    self._snapshot[name] = target.detach().clone()
                else:
                    kept.copy_(target)
            loaded.append(name)
            target.data.copy_(view)

        done = self.link.load_entries(version, names, load)  # all or nothing, under the slot lock
        if done and keep:
            self._kept = keep
            self._snapshot_version = version
        self.adapter.commit({name: live[name] for name in loaded}, version=version)
        return done

    def _undo(self, undo: int) -> None:
        """A rollback of ``undo``: put back the first-time entries this worker loaded for it,
        those ``undo`` itself pushed (an env that applied earlier versions in the same apply,
        at a reset, keeps their entries: the rollback does not undo them)."""
        if undo and undo == self._snapshot_version:
            live = self.adapter.state_tensors()
            undone = [name for name in self._kept if self._stamps.get(name) == undo]
            for name in undone:
                live[name].data.copy_(self._snapshot[name])
                self._stamps[name] = 0
            self.adapter.commit({name: live[name] for name in undone}, version=undo, restore=True)
            self._snapshot_version = 0

    def _restore(self, loaded: list[str]) -> str:
        """Put the previous config and env state back; return what failed doing so."""
        try:
            if self._config is not None:
                self.adapter.apply_config(self._config)
            live = self.adapter.state_tensors() if loaded else {}
            restored = [name for name in loaded if name in self._kept]
            for name in restored:
                live[name].data.copy_(self._snapshot[name])
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
