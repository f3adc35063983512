"""What a push publishes: each targeted env's update of its desired state.

A push's input (config values, possibly one row per env; env-state entries) is validated
against the templates and turned into flat leaves stamped with the new version, one update
per targeted env (shared between envs that get the same), plus the update of what a worker
joining later starts from. Statistics of ``recompute(where="main")`` policies are computed
here, on the probe env, once per distinct config. Nothing is written: :meth:`envsync.core.Core.publish`
writes what this returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from envsync import desired
from envsync.core import Core
from envsync.errors import ValidationError
from envsync.levels import is_batched
from envsync.links.base import Flat
from envsync.state import ConfigTemplate, EnvStateTemplate, Leaf, nest, tensor_of

Plan = tuple[dict[int, Flat], Flat | None]
"""Per targeted env index its update, and the update of the default (``None``: unchanged)."""
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
        >>> from envsync.core import Core
        >>> from envsync.state import ConfigTemplate, EnvStateTemplate
        >>> template = ConfigTemplate({"x": 0.0})
        >>> core = Core(template.flat)
        >>> updates = Updates(core, template, lambda: EnvStateTemplate({}), None)
        >>> per_env, default = updates.push({"x": 2.0}, None, None, None)
        >>> per_env, float(default["config", "x"])
        ({}, 2.0)
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
        envs: Sequence[int] | None,
    ) -> Plan:
        """The updates of ``push(config, env_state, workers=, envs=)``.

        Raises:
            ValidationError: the input does not fit the templates or the fleet.
        """
        fleet = self._core.fleet
        targets = fleet.targets(workers, envs)
        fitted = self._template.fit_rows(config, len(targets)) if config is not None else {}
        rows = fitted if isinstance(fitted, list) else None
        cfg = fitted if isinstance(fitted, dict) else {}
        env = self._env_state_template().fit(env_state) if env_state is not None else {}
        if envs is not None and any(map(is_batched, env)):
            self._check_whole_workers(targets)
        version = self._core.desired.version + 1
        cache: dict[bytes, dict[str, torch.Tensor]] = {}

        def update(c: Mapping[str, Leaf], e: int | None) -> Flat:
            return desired.leaves(c, self._with_main_stats(c, env, e, cache), version)

        fleet_wide = workers is None and envs is None
        one_for_all = rows is None and self._main_stats is None  # never mutated
        # the shared update is also what a worker joining later starts from (fleet-wide)
        shared = update(cfg, None) if rows is None and (fleet_wide or one_for_all) else None
        if one_for_all and shared is not None:
            updates = dict.fromkeys(targets, shared)
        else:
            updates = {e: update(c, e) for e, c in zip(targets, rows or [cfg] * len(targets), strict=True)}
        if fleet_wide and shared is None and env:  # rows of config, one env state for all
            shared = desired.leaves({}, env, version)
        return updates, shared if fleet_wide else None

    def rows(self, configs: Mapping[int, Mapping[str, Any] | TensorDictBase], *, by_env: bool) -> Plan:
        """The updates giving each listed worker (or, ``by_env``, env) its own config."""
        version = self._core.desired.version + 1
        cache: dict[bytes, dict[str, torch.Tensor]] = {}
        updates = {}
        for index in list(configs):
            cfg = self._template.fit(configs[index])
            fleet = self._core.fleet
            envs = fleet.targets(None, [index]) if by_env else fleet.targets([index])
            for e in envs:
                updates[e] = desired.leaves(cfg, self._with_main_stats(cfg, {}, e, cache), version)
        return updates, None

    def _check_whole_workers(self, targets: list[int]) -> None:
        """A batched env's own entries belong to its worker: a push of them with ``envs=``
        must target every env of each worker it touches."""
        fleet = self._core.fleet
        chosen = set(targets)
        touched = {fleet.worker_of(e) for e in targets}
        partial = sorted(w for w in touched if not set(fleet.envs_of(w)) <= chosen)
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
