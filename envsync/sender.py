"""EnvStateSender: validate -> write -> bump version -> wait for acknowledgements.

The sender owns the *desired* env state of every worker: a config (fixed template) and,
optionally, entries of the env's ``state_dict()``. Each push publishes a new integer version
(the template is version 0). Before a collector is attached, pushes only change the desired
state; a collector attached later starts every worker from it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tensordict import TensorDict, TensorDictBase

from envsync.desired import DesiredState, Mirror, Undo, stamped
from envsync.errors import AckTimeout, EnvSyncError, ValidationError, WorkerApplyError
from envsync.probe import Probe
from envsync.protocol import NO_FAILURE, ApplyAt, Until, failure_to_raise, is_done
from envsync.receiver import ApplySpec
from envsync.reinit import Policy, ReinitSpec, Selector
from envsync.state import ApplyFn, ConfigTemplate, ConfigValue, EnvStateTemplate
from envsync.transports.shared_memory import SharedMemoryChannel

_SPIN = 200
_POLL = 0.0005


@dataclass
class Attachment:
    """A live link to one collector's workers, made by an integration.

    Args:
        channel: the transport's sender end.
        alive: tells whether a worker's process still runs.
        detached: tells whether the collector has been shut down.
        on_close: run when the sender closes (e.g. stop an in-process receiver).
    """

    channel: SharedMemoryChannel
    alive: Callable[[int], bool]
    detached: Callable[[], bool]
    on_close: Callable[[], None] = lambda: None


class EnvStateSender:
    """Publishes the desired env state to the workers of a torchrl collector.

    Args:
        config: the config template: names to numbers or tensors, nested mappings allowed.
        apply: how a worker applies config: a method name looked up on the env (then its
            base env, then the unwrapped gymnasium env), a callable ``fn(env, config)``, or
            ``None``.
        reinit: re-initialisation policies for stateful transforms (see ``envsync.reinit``).
        apply_at: ``"reset"`` (default), ``"step"`` or ``"truncate"``.
        allow_nonfinite: accept NaN and inf config values.

    Examples:
        >>> sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
        >>> sender.push(config={"difficulty": 0.5})  # no collector yet: desired state only
        1
        >>> sender.desired_config()["difficulty"].item()
        0.5
        >>> sender.close()
    """

    def __init__(
        self,
        *,
        config: Mapping[str, ConfigValue] | None = None,
        apply: str | ApplyFn | None = None,
        reinit: Mapping[Selector, Policy] | None = None,
        apply_at: str = "reset",
        allow_nonfinite: bool = False,
    ) -> None:
        try:
            mode = ApplyAt(apply_at)
        except ValueError:
            raise ValidationError(f"apply_at={apply_at!r}; expected one of {[m.value for m in ApplyAt]}") from None
        if apply is not None and not isinstance(apply, str) and not callable(apply):
            raise ValidationError(f"apply must be a method name, a callable or None, got {apply!r}")
        self.template = ConfigTemplate(config or {}, allow_nonfinite=allow_nonfinite)
        self.spec = ApplySpec(apply=apply, apply_at=mode, reinit=ReinitSpec.from_mapping(reinit))
        self._allow_nonfinite = allow_nonfinite
        self._version = 0
        self._desired = DesiredState(self.template.values)
        self._undo: Undo | None = None
        self._probe: Probe | None = None
        self._env_state_template: EnvStateTemplate | None = None
        self._attachment: Attachment | None = None
        self._mirror = Mirror(TensorDict(), 0)  # what each attached worker was last sent
        self._reported: dict[int, int] = {}
        self._lock = threading.RLock()
        self._closed = False

    # ---- attaching (the integration calls these) -------------------------------------------

    def env_fn(self, fn: Callable[..., Any] | Any) -> Any:
        """Wrap an env factory (or a built env) so its env carries envsync's safe points.

        Args:
            fn: a callable returning an ``EnvBase``, or an ``EnvBase``.

        Returns:
            A picklable factory (or, for a built env, that env with the transform appended).
        """
        from envsync.integrations.torchrl import wrap_env_fn

        return wrap_env_fn(self, fn)

    def schemes(self, policy_scheme: Any | None = None) -> dict[str, Any]:
        """The ``weight_sync_schemes`` to pass to the collector.

        Args:
            policy_scheme: replaces the default ``"policy"`` scheme.

        Returns:
            ``{"env": <envsync scheme>, "policy": <policy scheme>}``.
        """
        from envsync.integrations.torchrl import make_schemes

        return make_schemes(self, policy_scheme)

    def _remember_env(self, probe: Probe) -> None:
        if self._probe is not None:
            self._probe.close()
        self._probe = probe
        self._env_state_template = None

    def _probe_or_fail(self) -> Probe:
        if self._probe is None:
            raise ValidationError("envsync needs an env: wrap your env factory with sender.env_fn first")
        return self._probe

    def env_state_template(self) -> EnvStateTemplate:
        """The env-state keys a push may carry, read once from a probe env in this process.

        The probe also checks, before any worker starts, that ``apply_at="truncate"`` has a
        ``"truncated"`` key and that every ``reinit`` selector matches a transform that
        supports its policy.

        Raises:
            ValidationError: no env factory was wrapped with :meth:`env_fn` yet, or the env
                does not fit the sender's settings.
        """
        if self._env_state_template is None:
            self._env_state_template = self._probe_or_fail().describe(self.spec, self._allow_nonfinite)
        return self._env_state_template

    def _attach(self, make: Callable[[TensorDict], Attachment]) -> Attachment:
        """Attach a collector: ``make`` builds the transport from the initial payload."""
        with self._lock:
            self._check_open()
            previous = self._attachment
            self._attachment = None
            if previous is not None:
                previous.on_close()
                previous.channel.close()
            payload = self._desired.payload(self.env_state_template().values)
            attachment = make(payload)
            self._mirror = Mirror(payload, attachment.channel.num_workers)
            for worker in range(attachment.channel.num_workers):
                attachment.channel.write(worker, self._version, TensorDict())
            self._attachment = attachment
            self._reported = {}
            return attachment

    def _live_attachment(self) -> Attachment | None:
        attachment = self._attachment
        if attachment is not None and attachment.detached():
            self._attachment = None
            attachment.on_close()
            attachment.channel.close()
            return None
        return attachment

    # ---- pushing ---------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The latest published version (0 is the template)."""
        return self._version

    @property
    def num_workers(self) -> int | None:
        """The number of workers of the attached collector, or ``None``."""
        attachment = self._live_attachment()
        return None if attachment is None else attachment.channel.num_workers

    def push(
        self,
        config: Mapping[str, Any] | TensorDictBase | None = None,
        env_state: Mapping[str, Any] | TensorDictBase | None = None,
        *,
        workers: Sequence[int] | None = None,
        wait: str | None = "received",
        timeout: float = 30.0,
    ) -> int:
        """Publish a new desired state and return its version.

        Args:
            config: a subset of the template's names with new values.
            env_state: entries of the env's ``state_dict()`` to load, in place.
            workers: the workers to target (default: all).
            wait: ``"received"``, ``"applied"`` or ``None``.
            timeout: seconds to wait for acknowledgements.

        Raises:
            ValidationError: bad input; nothing was sent.
            WorkerApplyError: a worker failed to apply this (or an earlier) version.
            AckTimeout: some targeted workers did not answer in time, or died.
        """

        def prepare(cache: dict[bytes, TensorDict]) -> tuple[dict[int, TensorDict], TensorDict | None]:
            update = self._validated(config, env_state)
            updates = {w: self._with_main_stats(update, w, cache) for w in self._targets(workers)}
            return updates, (self._with_main_stats(update, None, cache) if workers is None else None)

        return self._send(prepare, wait=wait, timeout=timeout)

    def push_each(
        self,
        configs: Mapping[int, Mapping[str, Any] | TensorDictBase],
        *,
        wait: str | None = "received",
        timeout: float = 30.0,
    ) -> int:
        """Publish one version that gives each listed worker its own config.

        Args:
            configs: worker index to a (partial) config.
            wait: ``"received"``, ``"applied"`` or ``None``.
            timeout: seconds to wait for acknowledgements.

        Returns:
            The new version.
        """

        def prepare(cache: dict[bytes, TensorDict]) -> tuple[dict[int, TensorDict], TensorDict | None]:
            targets = self._targets(list(configs))
            return {w: self._with_main_stats(self._validated(configs[w], None), w, cache) for w in targets}, None

        return self._send(prepare, wait=wait, timeout=timeout)

    def _send(
        self,
        prepare: Callable[[dict[bytes, TensorDict]], tuple[dict[int, TensorDict], TensorDict | None]],
        *,
        wait: str | None,
        timeout: float,
    ) -> int:
        """The one way a push goes out: check -> raise pending failures -> ``prepare`` the
        validated per-worker updates (and the default's) -> publish -> wait."""
        with self._lock:
            until = self._check_wait(wait)
            self._check_open()
            self._raise_failures()
            updates, default = prepare({})
            version = self._publish(updates, default=default)
        if until is not None:
            self.wait(version, until=until.value, workers=list(updates), timeout=timeout)
        return version

    def _validated(self, config: Any, env_state: Any) -> TensorDict:
        update = TensorDict()
        if config is not None:
            update["config"] = self.template.validate(config)
        if env_state is not None:
            update["env_state"] = self.env_state_template().validate(env_state)
        return update

    def _with_main_stats(self, update: TensorDict, worker: int | None, cache: dict[bytes, TensorDict]) -> TensorDict:
        """Add the statistics of ``recompute(where="main")`` policies, computed on the probe
        env under the config ``worker`` (or, for ``None``, a worker joining later) will run;
        ``cache`` holds them per distinct config, so equal configs get identical statistics."""
        if not self.spec.reinit.computes_in_main or "config" not in update.keys():
            return update
        merged = self.desired_config(worker)
        merged.update(update["config"])
        key = b"".join(v.numpy().tobytes() for _, v in sorted(merged.items(True, True), key=lambda kv: str(kv[0])))
        if key not in cache:
            stats = self._probe_or_fail().main_stats(self.spec, merged)
            cache[key] = self.env_state_template().validate(stats)
        env_state = cache[key].clone()
        if "env_state" in update.keys():
            env_state.update(update["env_state"])
        out = update.clone(recurse=False)
        out["env_state"] = env_state
        return out

    def _targets(self, workers: Sequence[int] | None) -> list[int]:
        count = self.num_workers
        if workers is None:
            return list(range(count or 0))
        if count is None:
            raise ValidationError("workers= needs an attached collector; none is attached")
        chosen = []
        for worker in workers:
            if not isinstance(worker, int) or isinstance(worker, bool) or not 0 <= worker < count:
                raise ValidationError(f"worker {worker!r} does not exist; workers are 0..{count - 1}")
            if worker not in chosen:
                chosen.append(worker)
        return chosen

    def _publish(self, updates: Mapping[int, TensorDict], *, default: TensorDict | None) -> int:
        """Write each worker's update under a new version; ``default`` also changes the
        desired state of workers that join later. Records what it replaces in ``_undo``."""
        version = self._version + 1
        attachment = self._live_attachment()
        undo = Undo(version, {}, None)
        if default is not None:
            template = self.env_state_template().values if "env_state" in default.keys() else TensorDict()
            undo.default = self._desired.previous_values(default, template)
            self._desired.update(default, version)
        if attachment is not None:
            for worker, update in updates.items():
                published = stamped(update, version)
                attachment.channel.write(worker, version, published)
                attachment.channel.notify(worker)  # at once: this worker applies while we go on
                undo.workers[worker] = self._mirror.previous_values(worker, update)
                self._mirror.record(worker, published)
        self._version = version
        self._undo = undo
        return version

    def _roll_back(self, failed: int) -> int | None:
        """Publish, as a new version, what the failed latest push replaced; return it."""
        undo = self._undo
        if undo is None or undo.version != failed or failed != self._version:
            return None
        version = self._publish(undo.workers, default=undo.default)
        self._undo = None  # a rollback is not rolled back in turn
        return version

    # ---- waiting ---------------------------------------------------------------------------

    def wait(
        self,
        version: int,
        *,
        until: str = "applied",
        workers: Sequence[int] | None = None,
        timeout: float = 30.0,
    ) -> None:
        """Block until the workers have received or applied ``version``.

        Args:
            version: the version to wait for.
            until: ``"received"`` or ``"applied"``.
            workers: the workers to wait for (default: all).
            timeout: seconds before :class:`~envsync.AckTimeout`.

        Raises:
            WorkerApplyError: a worker failed to apply a version.
            AckTimeout: some workers did not answer in time; a dead worker is reported at once.
        """
        mode = self._check_wait(until)
        assert mode is not None
        attachment = self._live_attachment()
        if attachment is None:
            return
        pending = self._targets(workers)
        deadline = time.monotonic() + timeout
        spins = 0
        while True:
            with self._lock:
                try:
                    self._raise_failures(pending)
                except WorkerApplyError as err:
                    self._confirm_rollback(err, mode, deadline)
                    raise
            pending = [w for w in pending if not is_done(attachment.channel.status(w), version, mode)]
            if not pending:
                return
            dead = [w for w in pending if not attachment.alive(w)]
            if dead or time.monotonic() > deadline:
                raise AckTimeout(version, pending, dead=dead, until=mode.value)
            spins += 1
            time.sleep(0 if spins < _SPIN else _POLL)

    def _confirm_rollback(self, err: WorkerApplyError, until: Until, deadline: float) -> None:
        """Wait (within what is left of the deadline) until the rollback is in place too."""
        if err.rollback is None:
            return
        try:
            self.wait(err.rollback, until=until.value, timeout=max(0.05, deadline - time.monotonic()))
        except EnvSyncError as late:
            err.add_note(f"rollback version {err.rollback} not confirmed: {late}")

    def _raise_failures(self, workers: Sequence[int] | None = None) -> None:
        """Raise the first failure not raised yet; if it is of the latest push, roll it back."""
        attachment = self._attachment
        if attachment is None:
            return
        for worker in range(attachment.channel.num_workers) if workers is None else workers:
            status = attachment.channel.status(worker)
            failed = failure_to_raise(status, self._reported.get(worker, NO_FAILURE))
            if failed is not None:
                self._reported[worker] = failed
                rollback = self._roll_back(failed)
                raise WorkerApplyError(worker, failed, attachment.channel.error_text(worker), rollback=rollback)

    def versions(self) -> list[int]:
        """The version each worker's env runs now (empty when no collector is attached)."""
        attachment = self._live_attachment()
        if attachment is None:
            return []
        return [attachment.channel.status(w).applied for w in range(attachment.channel.num_workers)]

    # ---- desired state and checkpoints -----------------------------------------------------

    def desired_config(self, worker: int | None = None) -> TensorDict:
        """The desired config of ``worker`` (default: of every worker not addressed alone)."""
        if worker is None:
            return self._desired.config.clone()
        attachment = self._live_attachment()
        if attachment is None:
            raise ValidationError("worker= needs an attached collector; none is attached")
        self._targets([worker])
        return self._mirror.config(worker).clone()

    def state_dict(self) -> dict[str, Any]:
        """A checkpoint of the desired state: ``{"version", "config"}``.

        ``"config"`` has one row per worker when a collector is attached, else no batch dim.
        """
        attachment = self._live_attachment()
        if attachment is None:
            config = self._desired.config.clone()
        else:
            config = TensorDict.stack([self._mirror.config(w) for w in range(attachment.channel.num_workers)]).clone()
        return {"version": self._version, "config": config}

    def load_state_dict(self, state: Mapping[str, Any]) -> int:
        """Restore a checkpoint made by :meth:`state_dict`; returns the version now desired.

        With a collector attached, the restored configs are pushed as a new version (applied
        per the apply mode); without one, every worker of the next collector starts from them.
        """
        if "version" not in state or "config" not in state:
            raise ValidationError("a sender checkpoint has the keys 'version' and 'config'")
        config = state["config"]
        if not isinstance(config, TensorDictBase):
            config = TensorDict(config)
        rows = [config] if config.batch_dims == 0 else list(config.unbind(0))
        for row in rows:
            self.template.validate(row)
        with self._lock:
            self._check_open()
            if self.num_workers is None:
                if len(rows) != 1:
                    raise ValidationError("a per-worker checkpoint can only be loaded with a collector attached")
                self._desired.config.update(self.template.validate(rows[0]))
                self._version = max(self._version, int(state["version"]))
                return self._version
        if len(rows) == 1:
            return self.push(config=rows[0], wait=None)
        if len(rows) != self.num_workers:
            raise ValidationError(
                f"checkpoint has {len(rows)} worker configs, the collector has {self.num_workers} workers"
            )
        return self.push_each(dict(enumerate(rows)), wait=None)

    # ---- life cycle ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ValidationError("this EnvStateSender is closed")

    @staticmethod
    def _check_wait(wait: str | None) -> Until | None:
        if wait is None:
            return None
        try:
            return Until(wait)
        except ValueError:
            raise ValidationError(f"wait={wait!r}; expected 'received', 'applied' or None") from None

    def close(self) -> None:
        """Release the shared memory, the probe env and in-process listeners; idempotent."""
        with self._lock:
            self._closed = True
            if self._probe is not None:
                self._probe.close()
            attachment, self._attachment = self._attachment, None
            if attachment is not None:
                attachment.on_close()
                attachment.channel.close()

    def __enter__(self) -> EnvStateSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
