"""What a push publishes: each targeted env's update of its desired state.

A push's input (config values, possibly one row per env; env-state entries) is validated
against the templates and turned into flat leaves stamped with the new version, as columns
(:class:`~envsync.sender.desired.Update`: values shared by every targeted env, and rows), plus the
update of what a worker joining later starts from. Statistics of ``recompute(where="main")`` policies are computed
here, on the probe env, once per distinct config. Nothing is written: :meth:`envsync.sender.core.Core.publish`
writes what this returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from envsync.errors import ValidationError
from envsync.indexing import Indices
from envsync.levels import is_batched
from envsync.links.base import Flat
from envsync.sender import desired
from envsync.sender.core import Core
from envsync.sender.desired import Update
from envsync.state import ConfigTemplate, EnvStateTemplate, Leaf, nest, tensor_of

Plan = tuple[list[Update], Flat | None]
"""The updates of a push (each targeted env in one of them), and the update of the default
(``None``: unchanged)."""
MainStats = Callable[[TensorDict], Mapping[str, Any]]
"""Computes ``recompute(where="main")`` statistics on the probe env under a whole config."""


class Updates:
    """Builds the updates of a push from its input (call under the core's lock).

    Args:
        core: the sender's records and fleet.
        template: the config template.
        env_state_template: gives the env-state template (asked for only when needed).
        main_stats: computes main-process statistics, or ``None`` when no policy does.

    Examples:
        >>> import torch
        >>> from envsync.sender.core import Core
        >>> from envsync.state import ConfigTemplate, EnvStateTemplate
        >>> template = ConfigTemplate({"x": 0.0})
        >>> core = Core(template.flat)
        >>> updates = Updates(core, template, lambda: EnvStateTemplate({}), None)
        >>> parts, default = updates.push({"x": 2.0}, None, None, None)
        >>> len(parts[0].targets), float(default["config", "x"])
        (0, 2.0)
    """

    def __init__(
        self,
        core: Core,
        template: ConfigTemplate,
        env_state_template: Callable[[], EnvStateTemplate],
        main_stats: MainStats | None,
    ) -> None:
        self._core = core
        self._template = template
        self._env_state_template = env_state_template
        self._main_stats = main_stats

    def push(
        self,
        config: Mapping[str, Any] | TensorDictBase | None,
        env_state: Mapping[str, Any] | TensorDictBase | None,
        workers: Sequence[int] | None,
        envs: Indices | None,
    ) -> Plan:
        """The updates of ``push(config, env_state, workers=, envs=)``.

        Raises:
            ValidationError: the input does not fit the templates or the fleet.
        """
        fleet = self._core.fleet
        fleet_wide = workers is None and envs is None
        targets = fleet.target_array(workers, envs)
        cfg, rows = self._template.fit_rows(config, len(targets)) if config is not None else ({}, {})
        env = self._env_state_template().fit(env_state) if env_state is not None else {}
        if envs is not None and any(map(is_batched, env)):
            self._check_whole_workers(targets)
        version = self._core.desired.version + 1
        if self._main_stats is None or not (cfg or rows):
            shared = desired.leaves(cfg, env, version)
            update = Update(targets, shared, {("config", k): v for k, v in rows.items()})
            if not fleet_wide:
                return [update], None
            if not rows:  # every env alike: what a worker joining later starts from, too
                return [update], shared
            # rows are per env: a worker joining later takes only the pushed env state
            return [update], desired.leaves({}, env, version) if env else None
        # statistics computed in main for the config each env will run (one per distinct config)
        cache: dict[bytes, dict[str, torch.Tensor]] = {}
        positions = range(len(targets))
        configs = [{**cfg, **{k: v[i] for k, v in rows.items()}} for i in positions]
        flats = [
            desired.leaves(c, self._with_main_stats(c, env, int(e), cache), version)
            for c, e in zip(configs, targets.tolist(), strict=True)
        ]
        default = None
        if fleet_wide:
            default = desired.leaves(cfg, self._with_main_stats(cfg, env, None, cache), version) if not rows else None
            default = default if default is not None or not env else desired.leaves({}, env, version)
        return Update.stacked(targets.tolist(), flats), default

    def rows(self, configs: Mapping[int, Mapping[str, Any] | TensorDictBase]) -> Plan:
        """The updates giving each listed worker its own config: one
        flat for every env of a worker (statistics computed in main aside, which are per env's
        config), so a worker of 65,536 worlds costs what a worker of one does."""
        version = self._core.desired.version + 1
        cache: dict[bytes, dict[str, torch.Tensor]] = {}
        targets: list[np.ndarray] = []
        flats: list[Flat] = []
        counts: list[int] = []
        fleet = self._core.fleet
        for index in list(configs):
            cfg = self._template.fit(configs[index])
            envs = fleet.target_array([index])
            if self._main_stats is None:
                targets.append(envs)
                flats.append(desired.leaves(cfg, {}, version))
                counts.append(len(envs))
                continue
            for e in envs.tolist():
                targets.append(np.array([e], dtype=np.int64))
                flats.append(desired.leaves(cfg, self._with_main_stats(cfg, {}, e, cache), version))
                counts.append(1)
        chosen = np.concatenate(targets) if targets else np.zeros(0, dtype=np.int64)
        return Update.stacked(chosen, flats, counts), None

    def _check_whole_workers(self, targets: np.ndarray) -> None:
        """A batched env's own entries belong to its worker: a push of them with ``envs=``
        must target every env of each worker it touches (by vector ops: the heads of the
        targets, counted against the envs per worker)."""
        fleet = self._core.fleet
        heads, counts = np.unique(fleet.heads(targets), return_counts=True)
        partial = []
        for head, count in zip(heads.tolist(), counts.tolist(), strict=True):
            attachment, _ = fleet.locate(head)
            if count < attachment.envs_per_worker:  # targets are distinct: fewer is some of them
                partial.append(fleet.worker_of(head))
        if partial:
            raise ValidationError(
                f"env_state 'batched.*' belongs to a worker's batched env, shared by all its envs: target whole "
                f"workers (workers={partial}, or every env of each), not some of their envs"
            )

    def _with_main_stats(
        self,
        config: Mapping[str, Leaf],
        env_state: dict[str, torch.Tensor],
        worker: int | None,
        cache: dict[bytes, dict[str, torch.Tensor]],
    ) -> dict[str, torch.Tensor]:
        """Add the statistics of ``recompute(where="main")`` policies, computed on the probe
        env under the config ``worker`` (or, for ``None``, a worker joining later) will run;
        ``cache`` holds them per distinct config, so equal configs get identical statistics."""
        if self._main_stats is None or not config:
            return env_state
        source = self._core.desired.default if worker is None else self._core.mirror(worker)
        merged = desired.section(source, "config")
        merged.update(config)
        key = b"".join(tensor_of(merged[k]).numpy().tobytes() for k in sorted(merged))
        if key not in cache:
            cache[key] = self._env_state_template().fit(self._main_stats(nest(merged)))
        return {**cache[key], **env_state}
