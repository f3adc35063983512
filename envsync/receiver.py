"""EnvStateReceiver: notice a version -> apply it at a safe point -> acknowledge.

One receiver lives in each worker, next to the env it drives. Safe points are called by the
env's :class:`~envsync.integrations.torchrl.EnvSyncTransform` from the collector's thread:
``before_reset`` (before the base env resets), ``before_step`` (before any transform and the
base step) and ``after_step``. While the collector is idle (not inside a rollout), a daemon
thread woken by the sender applies ``"step"`` and ``"truncate"`` versions at once.

One apply, in order: config method -> env state (``load_state_dict`` semantics, in place) ->
after-apply callbacks (re-initialisation). If any part raises, the previous config and env
state are restored, the failure is reported with its traceback, and the env keeps running
its previous version.
"""

from __future__ import annotations

import threading
import traceback
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from tensordict import TensorDict, TensorDictBase

from envsync.protocol import NO_FAILURE, ApplyAt
from envsync.reinit import ReinitSpec
from envsync.state import ApplyFn, config_applier, load_env_state_, read_env_state
from envsync.transports.base import ReceiverEnd

AfterApply = Callable[[Any, int], None]
"""A callback run after config and env state of a version are in place: ``fn(env, version)``."""

_LISTEN_PERIOD = 0.5


@dataclass(frozen=True)
class ApplySpec:
    """How a worker applies a version: the config method and the apply mode.

    Args:
        apply: a method name looked up on the env, a callable ``fn(env, config)``, or ``None``.
        apply_at: where versions are applied (see :class:`~envsync.protocol.ApplyAt`).
        reinit: the re-initialisation policies run after each apply.
    """

    apply: str | ApplyFn | None
    apply_at: ApplyAt
    reinit: ReinitSpec = field(default_factory=ReinitSpec)

    @property
    def truncates(self) -> bool:
        """Whether a version that arrives mid-episode ends it as truncated. ``"truncate"`` does;
        so does ``"step"`` when a re-init policy steps the env (it needs a fresh episode)."""
        return self.apply_at is ApplyAt.TRUNCATE or (self.apply_at is ApplyAt.STEP and self.reinit.moves_env)


class EnvStateReceiver:
    """The worker side of envsync, bound to one collector and one worker index.

    Args:
        end: this worker's end of the transport.
        spec: how versions are applied.
        collector: the (inner) collector whose env receives the state; held by weakref.
        reset_env: resets the env through the collector, so the next rollout starts a
            fresh episode.
        after_apply: callbacks run after each apply, in order.

    Examples:
        >>> EnvStateReceiver.__name__
        'EnvStateReceiver'
    """

    def __init__(
        self,
        *,
        end: ReceiverEnd,
        spec: ApplySpec,
        collector: Any,
        reset_env: Callable[[], None],
        after_apply: list[AfterApply] | None = None,
    ) -> None:
        self.end = end
        self.spec = spec
        self._collector = weakref.ref(collector)
        self._reset_env = reset_env
        self._after_apply = list(after_apply or [])
        self._lock = threading.RLock()
        self._busy = 0
        self.version = 0
        self._seen = 0
        self._failed = NO_FAILURE
        self._config: TensorDictBase | None = None
        self._apply_to: Any = None
        # the env state a failed apply restores; kept across applies (no 32 MB allocations)
        self._saved = TensorDict()
        self._apply_config: Callable[[TensorDictBase], None] = lambda config: None
        self._closed = False
        self._truncates = spec.truncates
        self._applies_at_step = spec.apply_at is ApplyAt.STEP and not spec.truncates
        self._resets_after_idle_apply = spec.truncates or spec.reinit.moves_env

    @property
    def worker(self) -> int:
        """This receiver's worker index."""
        return self.end.worker

    def _env(self) -> Any:
        collector = self._collector()
        if collector is None:
            raise RuntimeError("the collector of this receiver is gone")
        return collector.env

    def start(self, initial_config: TensorDictBase | None) -> None:
        """Catch up with the latest desired state, then listen while idle.

        Args:
            initial_config: the config the env was built with (version 0).
        """
        self._config = None if initial_config is None else initial_config.clone()
        with self._lock:
            if self._pending(self.end.target()):
                self._apply_latest()
                self._reset_env()
        thread = threading.Thread(
            target=_listen, args=(weakref.ref(self),), name=f"envsync-receiver-{self.worker}", daemon=True
        )
        thread.start()

    def close(self) -> None:
        """Stop the idle listener."""
        self._closed = True

    def _pending(self, target: int) -> bool:
        return target != self.version and target != self._failed

    def _notice(self, target: int) -> None:
        if target != self._seen:
            self._seen = target
            self.end.ack_received(target)

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Mark the collector as driving the env (a rollout or a reset): the listener keeps
        off; when the collector lets go, a version that arrived meanwhile is applied."""
        with self._lock:
            self._busy += 1
            self.end.set_busy(True)
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
                if not self._busy:
                    self.end.set_busy(False)
                    self._apply_if_idle()

    def before_reset(self) -> None:
        """Safe point before the base env resets: every mode applies a pending version here."""
        target = self.end.target()
        if self._pending(target):
            with self._lock:
                self._notice(target)
                self._apply_latest()

    def before_step(self) -> None:
        """Safe point before a step: arm a new version; ``"step"`` mode applies it."""
        target = self.end.target()
        if self._applies_at_step:
            if not self._pending(target):
                return
            with self._lock:
                self._notice(target)
                if self._pending(target):
                    self._apply_latest()
        elif target != self._seen:
            with self._lock:
                self._notice(target)

    def truncate_now(self) -> bool:
        """Whether the step just taken must end the episode (``"truncate"`` mode, pending)."""
        return self._truncates and self._pending(self.end.target())

    def on_wake(self) -> None:
        """Called by the listener thread when woken by the sender (or every half second)."""
        with self._lock:
            self._notice(self.end.target())
            if not self._busy:
                self._apply_if_idle()

    def _apply_if_idle(self) -> None:
        """With the collector idle (lock held): ``"step"`` and ``"truncate"`` apply at once."""
        if self.spec.apply_at is ApplyAt.RESET or not self._pending(self.end.target()):
            return
        if self._apply_latest() and self._resets_after_idle_apply:
            self._reset_env()

    def _applier(self, env: Any) -> Callable[[TensorDictBase], None]:
        if self._apply_to is not env:
            self._apply_config = config_applier(env, self.spec.apply)
            self._apply_to = env
        return self._apply_config

    def _apply_latest(self) -> bool:
        """Apply the latest desired state; on failure restore the previous one and report."""
        version, payload = self.end.read(since=self.version)
        self._notice(version)
        env = self._env()
        config = payload.get("config", None)
        env_state = payload.get("env_state", None)
        if env_state is not None and env_state.is_empty():
            env_state = None
        saved_state = None if env_state is None else read_env_state(env, env_state, into=self._saved)
        try:
            if config is not None:
                self._applier(env)(config)
            if env_state is not None:
                load_env_state_(env, env_state)
            for callback in self._after_apply:
                callback(env, version)
        except Exception:
            text = traceback.format_exc()
            if self._config is not None:
                self._applier(env)(self._config)
            if saved_state is not None:
                load_env_state_(env, saved_state)
            self._failed = version
            self.end.report_failure(version, text)
            return False
        if config is not None:
            self._config = config
        self.version = version
        self.end.ack_applied(version)
        return True


def _listen(ref: weakref.ReferenceType[EnvStateReceiver]) -> None:
    """The idle listener: wait for a wake-up, apply if the collector is idle."""
    while True:
        receiver = ref()
        if receiver is None or receiver._closed:
            return
        end = receiver.end
        del receiver
        end.wait_notice(_LISTEN_PERIOD)
        receiver = ref()
        if receiver is None or receiver._closed:
            return
        # also on a timeout: a version published while the collector was letting go is
        # picked up here at the latest
        receiver.on_wake()
        del receiver
