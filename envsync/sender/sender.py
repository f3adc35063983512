"""The sender: validate -> publish a version -> wait for acknowledgements; the public front.

:class:`Sender` is what users call (push, wait, gather, sync_stats, checkpoints). What it
desires lives in its :class:`~envsync.sender.core.Core` (records, books, fleet, lock); a push's
updates are built by :mod:`envsync.sender.updates` and published by the core; waiting is
:mod:`envsync.sender.acks`, reading back :mod:`envsync.sender.gather`, checkpoints :mod:`envsync.sender.checkpoint`.
Each push publishes a new integer version (the template is version 0). Before a collector
is attached, pushes only change the desired state; a collector attached later starts every
worker from it.

The core knows no framework: an integration (``envsync.integrations.torchrl``) gives it a
probe env and attaches collectors through :attr:`Sender.port` (:class:`~envsync.sender.port.AttachPort`).
Users build :class:`envsync.EnvStateSender`, the torchrl front.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from tensordict import TensorDict, TensorDictBase

from envsync.errors import ValidationError
from envsync.indexing import Indices
from envsync.links.base import Flat
from envsync.protocol import ApplyAt, Until
from envsync.reinit import Policy, ReinitSpec, Selector
from envsync.sender import acks, checkpoint, desired, restore
from envsync.sender.core import Core
from envsync.sender.desired import Update
from envsync.sender.fleet import Member
from envsync.sender.gather import read_settled
from envsync.sender.history import ConfigHistory
from envsync.sender.port import AttachPort
from envsync.sender.reads import ReadBack
from envsync.sender.updates import Plan, Updates
from envsync.spec import ApplySpec
from envsync.state import ApplyFn, ConfigTemplate, ConfigValue, EnvStateTemplate, nest

Prepare = Callable[[], Plan]
_UNTIL = {until.value: until for until in Until}  # a dict look-up: an enum call costs more per push


class Sender(ReadBack):
    """Publishes the desired env state to the workers of attached collectors.

    Args:
        config: the config template: names to numbers or tensors, nested mappings allowed.
        apply: how a worker applies config: a built-in from :mod:`envsync.apply`
            (``attributes()``, ``rebuild()``), a method name looked up along the env's
            wrapper chain (the env, its base envs, the gymnasium env and its wrappers, the
            unwrapped env), a callable ``fn(env, config)``, or ``None``.
        reinit: re-initialisation policies for stateful transforms (see ``envsync.reinit``).
        apply_at: ``"reset"`` (default), ``"step"`` or ``"truncate"``.
        allow_nonfinite: accept NaN and inf config values.
        env_state_template: the env-state entries a push may carry: ``env.state_dict()`` of
            the env your factory builds, or the part of it you push (torchrl's keys); given,
            no env is ever built in the main process to learn them (use it when envs must
            not be initialised before workers fork).
        envs_per_worker: how many envs each worker's (batched) env holds; counted on the
            probe env when not given, and taken as 1 with an ``env_state_template`` (which
            builds no env in main to count them).

    Examples:
        >>> sender = Sender(config={"difficulty": 0.0}, apply="set_difficulty")
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
        env_state_template: Mapping[Any, Any] | TensorDictBase | None = None,
        envs_per_worker: int | None = None,
    ) -> None:
        try:
            mode = ApplyAt(apply_at)
        except ValueError:
            raise ValidationError(f"apply_at={apply_at!r}; expected one of {[m.value for m in ApplyAt]}") from None
        if apply is not None and not isinstance(apply, str) and not callable(apply):
            raise ValidationError(f"apply must be a method name, a callable or None, got {apply!r}")
        self.template = ConfigTemplate(config or {}, allow_nonfinite=allow_nonfinite)
        self.spec = ApplySpec(apply=apply, apply_at=mode, reinit=ReinitSpec.from_mapping(reinit))
        check_spec = getattr(apply, "check_spec", None)  # a built-in apply's demands on the mode
        if check_spec is not None:
            check_spec(self.spec)
        declared = None
        if env_state_template is not None:
            declared = EnvStateTemplate(env_state_template, allow_nonfinite=allow_nonfinite)
        if envs_per_worker is not None and (not isinstance(envs_per_worker, int) or envs_per_worker < 1):
            raise ValidationError(f"envs_per_worker must be a positive int, got {envs_per_worker!r}")
        self._core = Core(self.template.flat, resets=mode is ApplyAt.RESET)
        self._lock = self._core.lock
        self._fleet = self._core.fleet
        self.port = AttachPort(
            self._core,
            self.template,
            self.spec,
            env_state_template=declared,
            envs_per_worker=envs_per_worker,
            allow_nonfinite=allow_nonfinite,
        )
        """What integrations attach through (:class:`~envsync.sender.port.AttachPort`); users never need it."""
        main_stats = self._main_stats if self.spec.reinit.computes_in_main else None
        self._updates = Updates(self._core, self.template, self.env_state_template, main_stats)

    @property
    def config_history(self) -> ConfigHistory:
        """The config every env ran under each version a frame may still carry (see
        :meth:`config_at`; ``keep`` and ``keep_bytes`` bound its size)."""
        return self._core.history

    def env_state_template(self) -> EnvStateTemplate:
        """The env-state keys a push may carry: declared, or read once from the env your
        factory builds.

        Reading them also checks, before any worker starts, that ``apply_at="truncate"`` has
        a ``"truncated"`` key and that every ``reinit`` selector matches a transform that
        supports its policy.

        Raises:
            ValidationError: no env factory was wrapped yet, or the env does not fit the
                sender's settings.
        """
        return self.port.env_state_template()

    def _main_stats(self, config: TensorDict) -> Mapping[str, Any]:
        return self.port.probe_or_fail().main_stats(self.spec, config)

    # ---- pushing ---------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The latest published version (0 is the template)."""
        return self._core.desired.version

    @property
    def num_workers(self) -> int | None:
        """How many workers the attached collectors have, or ``None`` when none is attached."""
        with self._lock:
            self._core.prune()
            return len(self._fleet.workers()) if self._fleet.attachments else None

    @property
    def num_envs(self) -> int | None:
        """How many envs the attached collectors' workers drive (every sub-env of a batched
        env counts), or ``None`` when none is attached."""
        with self._lock:
            self._core.prune()
            return len(self._fleet.index_array()) if self._fleet.attachments else None

    def fleet(self) -> list[Member]:
        """Every attached worker: fleet index, collector (attach order), worker, envs, first env."""
        with self._lock:
            self._core.prune()
            return self._fleet.members()

    def push(
        self,
        config: Mapping[str, Any] | TensorDictBase | None = None,
        env_state: Mapping[str, Any] | TensorDictBase | None = None,
        *,
        workers: Sequence[int] | None = None,
        envs: Indices | None = None,
        wait: str | None = "received",
        timeout: float = 30.0,
    ) -> int:
        """Publish a new desired state and return its version.

        Args:
            config: a subset of the template's names with new values; a value with a leading
                dim of one row per targeted env (shape ``(n, *template shape)``, or a
                TensorDict with batch size ``[n]``) gives each env its own row.
            env_state: entries of the env's ``state_dict()`` to load, in place.
            workers: the fleet indices of the workers to target (every env of each).
            envs: the fleet indices of the envs to target, as ints or a 1-D integer tensor
                or array (default, with neither: every env of every collector).
            wait: ``"received"``, ``"applied"`` or ``None``.
            timeout: seconds to wait for acknowledgements.

        Raises:
            ValidationError: bad input; nothing was sent.
            WorkerApplyError: a worker failed to apply this (or an earlier) version.
            AckTimeout: some targeted workers did not answer in time, or died.
        """

        return self._send(lambda: self._updates.push(config, env_state, workers, envs), wait=wait, timeout=timeout)

    def push_each(
        self,
        configs: Mapping[int, Mapping[str, Any] | TensorDictBase],
        *,
        wait: str | None = "received",
        timeout: float = 30.0,
    ) -> int:
        """Publish one version that gives each listed worker its own config (every env of a
        batched worker gets it; give per-env rows with ``push(config=..., envs=...)``).

        Args:
            configs: worker fleet index to a (partial) config.
            wait: ``"received"``, ``"applied"`` or ``None``.
            timeout: seconds to wait for acknowledgements.

        Returns:
            The new version.
        """
        return self._send(lambda: self._updates.rows(configs), wait=wait, timeout=timeout)

    def _send(self, prepare: Prepare, *, wait: str | None, timeout: float) -> int:
        """The one way a push goes out: check -> raise pending failures -> ``prepare`` the
        validated per-worker updates (and the default's) -> publish -> wait."""
        until = self._check_wait(wait)
        with self._lock:
            self._core.check_open()
            self._core.prune()
            acks.raise_failures(self._core)
            updates, default = prepare()
            self._check_configs(updates, default)
            version = self._core.publish(updates, default=default)
        self._core.wake(here=until is not None)  # the lock let go: an in-process apply may run here
        targets = [update.targets for update in updates if len(update.targets)]
        if until is not None and targets:
            chosen = targets[0] if len(targets) == 1 else np.concatenate(targets)
            acks.wait(self._core, version, until, chosen, timeout, pruned=True)
        return version

    def _check_configs(self, updates: Sequence[Update], default: Flat | None) -> None:
        """Let the apply refuse, on the probe env, the whole config each update leads to (not
        with a declared env-state template: then no env is built in this process)."""
        probe = self.port.probe
        if probe is None or self.port.declared or not hasattr(self.spec.apply, "check_config"):
            return
        pairs = [
            (self._core.mirror(int(index)), update.row(position))
            for update in updates
            for position, index in enumerate(update.targets.tolist())
        ]
        pairs += [(self._core.desired.default, default)] if default is not None else []
        configs = [{**desired.section(old, "config"), **desired.section(new, "config")} for old, new in pairs]
        probe.check_configs(self.spec, configs)

    # ---- waiting ---------------------------------------------------------------------------

    def wait(
        self,
        version: int,
        *,
        until: str = "applied",
        workers: Sequence[int] | None = None,
        envs: Indices | None = None,
        timeout: float = 30.0,
    ) -> None:
        """Block until the workers have received or applied ``version``.

        Args:
            version: a published version.
            until: ``"received"`` or ``"applied"``.
            workers: the fleet indices of the workers to wait for (every env of each).
            envs: the fleet indices of the envs to wait for (default, with neither: all).
            timeout: seconds before :class:`~envsync.AckTimeout`.

        Raises:
            ValidationError: ``version`` was never published.
            WorkerApplyError: a worker failed to apply a version.
            AckTimeout: some workers did not answer in time; a dead worker, or one whose
                collector shut down meanwhile, is reported at once.
        """
        mode = self._check_wait(until)
        assert mode is not None
        if version > self.version or version < 0:
            raise ValidationError(f"version {version} was never published; the latest is {self.version}")
        acks.wait(self._core, version, mode, self._fleet.targets(workers, envs), timeout)

    # ---- desired state and checkpoints -----------------------------------------------------

    def desired_config(self, worker: int | None = None, *, env: int | None = None) -> TensorDict:
        """The desired config of a worker (its first env's, for a batched worker), or of
        env ``env``; with neither, the config a worker joining later starts from."""
        if worker is None and env is None:
            return nest(desired.section(self._core.desired.default, "config"), copy=True)
        with self._lock:
            self._core.prune()
            index = self._fleet.targets(None if worker is None else [worker], None if env is None else [env])[0]
            return nest(desired.section(self._core.mirror(index), "config"), copy=True)

    def config_at(self, env: int, version: int) -> TensorDict:
        """The config env ``env`` (fleet index) ran under ``version``: what a frame tagged
        ``env_index=env``, ``env_version=version`` was produced under.

        Kept for every version a frame may still carry (see :class:`~envsync.sender.history.ConfigHistory`;
        ``sender.config_history.keep`` sets how many older versions per env outlive the one an
        env applied).

        Raises:
            ValidationError: the env never ran that version, or it is no longer kept.

        Examples:
            >>> from torchrl.collectors import Collector
            >>> from envsync import EnvStateSender
            >>> from envsync.envs import make_drift_env
            >>> sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
            >>> collector = Collector(sender.env_fn(make_drift_env), None, frames_per_batch=4, total_frames=-1,
            ...                       weight_sync_schemes=sender.schemes())
            >>> sender.push(config={"difficulty": 0.5})
            1
            >>> batch = next(iter(collector))
            >>> env, version = batch["next", "env_index"][-1].item(), batch["next", "env_version"][-1].item()
            >>> env, version, sender.config_at(env, version)["difficulty"].item()
            (0, 1, 0.5)
            >>> sender.config_at(0, 0)["difficulty"].item()  # frames of version 0 may still be in flight
            0.0
            >>> collector.shutdown(); sender.close()
        """
        with self._lock:
            return self._core.history.config(env, version)

    def state_dict(self, *, gather: bool = False) -> dict[str, Any]:
        """A checkpoint: ``{"version", "config", "env_state"}`` and, after a ``sync_stats``,
        ``"stats"`` (the last merge and what each worker was given).

        ``"config"`` has one row per worker when a collector is attached, else no batch dim;
        ``"env_state"`` holds every env-state entry pushed (or computed in main, or merged)
        so far. With ``gather=True`` it also holds ``"worker_env_state"``: every worker's
        current entries (running statistics included), read back with :meth:`gather`.
        """
        gathered = None
        if gather:
            with self._lock:
                self._core.prune()
                envs = self._fleet.collected()
                books = {False: self._core.books.of(False), True: self._core.books.of(True)}
            if envs:
                gathered = read_settled(self._core, self.env_state_template(), None, envs, books, 30.0)
        return checkpoint.state_dict(self._core, self.env_state_template, gathered)

    def load_state_dict(self, state: Mapping[str, Any]) -> int:
        """Restore a checkpoint made by :meth:`state_dict`; returns the version now desired.

        With a collector attached, the restored state is pushed as new versions (applied
        per the apply mode). Without one, it becomes what the next collector starts from:
        one row per worker for a per-worker checkpoint (the collector must then have that
        many workers), each worker's own env state included.

        Raises:
            ValidationError: not a checkpoint, a row that does not fit the template, or a
                number of rows that is not the number of workers.
        """

        with self._lock:
            self._core.check_open()
            self._core.prune()
            plan = checkpoint.plan_restore(self._core, self.template, state)
            return restore.carry_out(self._core, plan, self.push)

    # ---- life cycle ------------------------------------------------------------------------

    @staticmethod
    def _check_wait(wait: str | None) -> Until | None:
        if wait is None:
            return None
        until = _UNTIL.get(wait) if isinstance(wait, str) else None
        if until is None:
            raise ValidationError(f"wait={wait!r}; expected 'received', 'applied' or None")
        return until

    def close(self) -> None:
        """Release every link, the probe env and in-process worker loops; idempotent."""
        with self._lock:
            self.port.close()
            self._core.close()

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
