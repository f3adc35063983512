"""Automatic domain randomisation, by DeXtreme's rule (IsaacGymEnvs ``adr_vec_task.py``).

Each parameter has a range ``[low, high]``, starting at ``ranges`` and kept inside ``bounds``.
When an env is due (:meth:`~envsync.curriculum.Strategy.due`: at its reset, in reset mode)
it draws its next config: with probability ``boundary_fraction`` it becomes a *boundary* env
for one of the ``2 * len(ranges)`` boundaries, chosen uniformly: that parameter is set to
the boundary's value (one ``delta`` beyond it with ``extended_boundary_sample``) and every
other parameter is drawn uniformly in its range; otherwise every parameter is drawn
uniformly. Each env gets its own row, in one push. A parameter whose template is an array (a
mass factor per body, with ``envsync.apply.scales``) draws each element in its range; a
boundary env sets every element to the boundary's value.

A whole episode of a boundary env adds its ``objective`` (the return, or a ledger measure) to
that boundary's queue (the ``queue`` latest results), if the boundary has not moved since the
env was given it. Whenever a queue is full, with ``m`` its mean and ``(t_low, t_high) =
thresholds``:

- lower boundary: ``m < t_low``: ``low`` moves up by ``delta`` (never above the initial
  ``low``); ``m > t_high``: down by ``delta`` (never below ``bounds``);
- upper boundary: ``m < t_low``: ``high`` moves down (never below the initial ``high``);
  ``m > t_high``: up (never above ``bounds``);
- ``delta_style="additive"`` adds or subtracts ``delta``; ``"multiplicative"`` multiplies or
  divides by it (``delta > 1``). A boundary that moved empties its queue; one that did not
  keeps it, sliding.

IsaacGymEnvs draws a boundary env when its uniform draw is *at least* the fraction (so 0.4
there gives 60% boundary envs); here ``boundary_fraction`` is the share of boundary envs, as
the DeXtreme paper describes it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from envsync.curriculum.base import Strategy
from envsync.curriculum.ledger import Episode, Measure, NestedKey
from envsync.errors import ValidationError
from envsync.sender.sender import Sender

Boundary = tuple[str, int]
"""A parameter's name and its side: 0 the lower boundary, 1 the upper."""


class ADR(Strategy):
    """DeXtreme's automatic domain randomisation over per-env configs.

    Args:
        sender: the sender.
        ranges: each parameter's (template name) initial range ``(low, high)``.
        bounds: each parameter's limits ``(min, max)``; a missing name or ``None`` is unbounded.
        delta: the step of each boundary (one number, or one per parameter).
        delta_style: ``"additive"`` or ``"multiplicative"`` (one, or one per parameter).
        boundary_fraction: the share of due envs that evaluate a boundary.
        queue: how many results of a boundary decide it (its queue's length).
        thresholds: ``(low, high)`` thresholds on the mean objective.
        objective: ``"episode_return"`` or the name of a ledger measure.
        extended_boundary_sample: evaluate one ``delta`` beyond each boundary.
        envs: the fleet indices of the envs ADR drives (default: all).
        seed: seeds the draws.
        measures: as for :class:`~envsync.curriculum.Strategy`.
        logger: as for :class:`~envsync.curriculum.Strategy`.
        wait: as for :class:`~envsync.curriculum.Strategy`.

    Examples:
        >>> from envsync import EnvStateSender
        >>> sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
        >>> adr = ADR(sender, ranges={"difficulty": (0.0, 0.25)}, bounds={"difficulty": (0.0, 5.0)},
        ...           delta=0.25, queue=2, thresholds=(30.0, 42.0))
        >>> for value in (45.0, 47.0):  # two results at the upper boundary, both above 42
        ...     adr.credit(("difficulty", 1), value)
        >>> adr.range["difficulty"]
        [0.0, 0.5]
        >>> sender.close()
    """

    def __init__(
        self,
        sender: Sender,
        ranges: Mapping[str, tuple[float, float]],
        *,
        bounds: Mapping[str, tuple[float | None, float | None]] | None = None,
        delta: float | Mapping[str, float] = 0.1,
        delta_style: str | Mapping[str, str] = "additive",
        boundary_fraction: float = 0.4,
        queue: int = 256,
        thresholds: tuple[float, float] = (0.0, 1.0),
        objective: str = "episode_return",
        extended_boundary_sample: bool = False,
        envs: Iterable[int] | None = None,
        seed: int = 0,
        measures: Mapping[str, NestedKey | Measure] | None = None,
        logger: Any = None,
        wait: str | None = "received",
    ) -> None:
        super().__init__(sender, measures=measures, logger=logger, wait=wait)
        self.names = list(ranges)
        self.initial = {n: (float(ranges[n][0]), float(ranges[n][1])) for n in self.names}
        self.range = {n: list(self.initial[n]) for n in self.names}
        self.bounds = {n: tuple((bounds or {}).get(n, (None, None))) for n in self.names}
        self.delta = {n: float(delta[n] if isinstance(delta, Mapping) else delta) for n in self.names}
        self.delta_style = {n: delta_style[n] if isinstance(delta_style, Mapping) else delta_style for n in self.names}
        self.boundary_fraction = boundary_fraction
        self.thresholds = (float(thresholds[0]), float(thresholds[1]))
        self.objective = objective
        self.extended_boundary_sample = extended_boundary_sample
        self.envs = None if envs is None else list(envs)
        self.queues: dict[Boundary, deque[float]] = {(n, s): deque(maxlen=queue) for n in self.names for s in (0, 1)}
        self.rng = np.random.default_rng(seed)
        flat = sender.template.flat
        self._shapes = {n: tuple(flat[n].shape) if n in flat else () for n in self.names}
        self.assigned: dict[tuple[int, int], tuple[Boundary, float]] = {}
        self.results = dict.fromkeys(self.queues, 0)
        """Per boundary: how many results it was credited in all."""
        self._validate(queue)
        self.record(**self._ranges())

    def _validate(self, queue: int) -> None:
        if not self.names:
            raise ValidationError("ADR needs at least one range")
        for n in self.names:
            low, high = self.initial[n]
            if low > high:
                raise ValidationError(f"ADR range of {n!r} is ({low}, {high}): low above high")
            if self.delta_style[n] not in ("additive", "multiplicative"):
                style = self.delta_style[n]
                raise ValidationError(f"delta_style of {n!r} is {style!r}; expected 'additive' or 'multiplicative'")
            if self.delta_style[n] == "multiplicative" and self.delta[n] <= 1.0:
                raise ValidationError(f"a multiplicative delta must be > 1; {n!r} has {self.delta[n]}")
        if not 0.0 <= self.boundary_fraction <= 1.0:
            raise ValidationError(f"boundary_fraction must be in [0, 1], got {self.boundary_fraction}")
        if queue < 1 or self.thresholds[0] > self.thresholds[1]:
            raise ValidationError(f"ADR needs queue >= 1 and thresholds low <= high; got {queue}, {self.thresholds}")
        if self.objective != "episode_return" and self.objective not in self.ledger.measures:
            raise ValidationError(f"objective {self.objective!r} is neither 'episode_return' nor a measure")

    # ---- the rule --------------------------------------------------------------------------

    def update(self, episodes: list[Episode]) -> None:
        """Credit boundary episodes, move boundaries whose queue is full, draw for due envs."""
        for episode in episodes:
            given = self.assigned.get((episode.env, episode.version))
            if episode.whole and given is not None and given[1] == self.boundary_value(given[0]):
                self.credit(given[0], self._objective(episode))
        self.assigned = self.unsettled(self.assigned)
        due = self.due(self.envs)
        if due:
            columns, boundaries = self.draws(len(due))
            version = self.assign_columns(due, columns)
            values = {boundary: self.boundary_value(boundary) for boundary in self.queues}
            self.assigned.update(
                ((env, version), (boundary, values[boundary]))
                for env, boundary in zip(due, boundaries, strict=True)
                if boundary is not None
            )

    def _objective(self, episode: Episode) -> float:
        return episode.episode_return if self.objective == "episode_return" else episode.measures[self.objective]

    def credit(self, boundary: Boundary, value: float) -> None:
        """Add one result to a boundary's queue and decide it if the queue is full."""
        queue = self.queues[boundary]
        queue.append(value)
        self.results[boundary] += 1
        if len(queue) < (queue.maxlen or 0):
            return
        name, side = boundary
        mean = sum(queue) / len(queue)
        low, high = self.thresholds
        initial, limit = self.initial[name][side], self.bounds[name][side]
        current = self.range[name][side]
        if mean < low:  # shrink towards the initial range
            moved = self._step(name, current, inward=True, limit=initial, side=side)
        elif mean > high:  # widen towards the bounds
            moved = self._step(name, current, inward=False, limit=limit, side=side)
        else:
            return
        if abs(moved - current) > 1e-9:
            self.range[name][side] = moved
            queue.clear()
            self.record(boundary=f"{name}.{'low' if side == 0 else 'high'}", mean=mean, **self._ranges())

    def _step(self, name: str, value: float, *, inward: bool, limit: float | None, side: int) -> float:
        up = inward == (side == 0)
        delta, style = self.delta[name], self.delta_style[name]
        if style == "additive":
            moved = value + delta if up else value - delta
        else:
            moved = value * delta if up else value / delta
        if limit is not None:
            moved = min(moved, limit) if up else max(moved, limit)
        return moved

    def boundary_value(self, boundary: Boundary) -> float:
        """The value a boundary env evaluates (beyond the boundary with ``extended_boundary_sample``)."""
        name, side = boundary
        value = self.range[name][side]
        if self.extended_boundary_sample:
            return self._step(name, value, inward=False, limit=self.bounds[name][side], side=side)
        return value

    def draw(self) -> tuple[dict[str, Any], Boundary | None]:
        """One env's next config, and the boundary it evaluates (``None``: a rollout env):
        :meth:`draws` of one env, a number per scalar parameter, a tensor per array one."""
        columns, boundaries = self.draws(1)
        row = {n: float(c[0]) if not self._shapes[n] else torch.from_numpy(c[0]) for n, c in columns.items()}
        return row, boundaries[0]

    def draws(self, count: int) -> tuple[dict[str, np.ndarray], list[Boundary | None]]:
        """The next configs of ``count`` envs as columns (float64, a row per env, an array
        parameter's elements each drawn in its range), and the boundary each evaluates:
        a few vector draws whatever ``count`` (a batch of thousands of worlds ends thousands
        of episodes)."""
        rng = self.rng
        modes = rng.integers(0, 2 * len(self.names), size=count)  # the boundary, if one is drawn
        modes[rng.random(count) >= self.boundary_fraction] = -1
        columns = {}
        for i, name in enumerate(self.names):
            low, high = self.range[name]
            column = rng.uniform(low, high, size=(count, *self._shapes[name]))
            for side in (0, 1):
                at = modes == 2 * i + side
                if at.any():
                    column[at] = self.boundary_value((name, side))
            columns[name] = column
        boundaries = [None if mode < 0 else (self.names[mode // 2], mode % 2) for mode in modes.tolist()]
        return columns, boundaries

    def _ranges(self) -> dict[str, float]:
        return {f"{n}.{side}": self.range[n][i] for n in self.names for i, side in enumerate(("low", "high"))}

    # ---- resuming --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The ranges, every boundary's queue, the random state and the history."""
        return {
            **super().state_dict(),
            "range": {n: list(r) for n, r in self.range.items()},
            "queues": {f"{n}.{s}": list(q) for (n, s), q in self.queues.items()},
            "results": {f"{n}.{s}": count for (n, s), count in self.results.items()},
            "rng": self.rng.bit_generator.state,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume the ranges and queues (every env draws again at its next decision)."""
        super().load_state_dict(state)
        self.range = {n: [float(v) for v in state["range"][n]] for n in self.names}
        for (n, s), queue in self.queues.items():
            queue.clear()
            queue.extend(state["queues"][f"{n}.{s}"])
            self.results[n, s] = int(state["results"][f"{n}.{s}"])
        # numpy's state; a checkpoint made with Python's random (before 2026-12-07) draws on from the seed
        if isinstance(state["rng"], dict):
            self.rng.bit_generator.state = state["rng"]
        self.assigned.clear()
