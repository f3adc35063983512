"""Prioritized level replay (Jiang et al. 2021), as the authors' ``level_replay`` sampler does it.

A *level* is one config of a finite list (a seed, a layout, a difficulty). Every level has a
score ``S`` and a staleness ``C`` (how many draws ago it was last drawn). When an env is due
(:meth:`~envsync.curriculum.Strategy.due`: at its reset, in reset mode) it draws its next
level:

- ``p_seen`` is the share of levels already scored. With ``replay_schedule="proportionate"``
  the env replays with probability ``p_seen`` once ``p_seen >= rho``; with ``"fixed"`` it
  replays with probability ``1 - nu`` once ``p_seen >= rho`` (always once every level is
  seen). Otherwise it draws an unseen level uniformly;
- a replay draws seen level ``i`` with ``P = (1 - staleness_coef) * P_S + staleness_coef * P_C``,
  where ``P_S`` is the rank transform of the scores (``1 / rank(S_i) ** (1 / temperature)``,
  rank 1 the highest score) and ``P_C`` the power transform of the staleness
  (``C_i ** (1 / staleness_temperature)``), each normalised over the seen levels;
- every draw ages every level by one and sets the drawn level's staleness to 0.

A whole episode on level ``i`` sets ``S_i = (1 - alpha) * S_i + alpha * score(episode)``
(``alpha=1``: the latest score) and marks the level seen. The default score needs no value
function: ``-episode_return`` (the levels the agent does worst on come back first); pass
``score=`` for another (the authors use the mean positive value loss).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from envsync.curriculum.base import Strategy, columns_of
from envsync.curriculum.ledger import Episode, Measure, NestedKey
from envsync.errors import ValidationError
from envsync.sender.sender import Sender


def negative_return(episode: Episode) -> float:
    """The default score: the lower the return on a level, the sooner it is replayed."""
    return -episode.episode_return


class PLR(Strategy):
    """Prioritized level replay over a finite list of levels, drawn per env at its reset.

    Args:
        sender: the sender.
        levels: the levels: configs (template names to values), each a level.
        score: ``fn(episode) -> float``, the score of one whole episode on its level.
        temperature: the rank transform's temperature (``beta`` in the paper).
        staleness_coef: the weight of staleness (``rho`` in the paper's replay distribution).
        staleness_temperature: the power transform's temperature for staleness.
        alpha: how far a new score moves the level's score (1: replaces it).
        rho: the share of levels that must be seen before any replay.
        nu: with ``replay_schedule="fixed"``, the probability of a new level.
        replay_schedule: ``"proportionate"`` or ``"fixed"``.
        envs: the fleet indices of the envs PLR drives (default: all).
        seed: seeds the draws.
        measures: as for :class:`~envsync.curriculum.Strategy`.
        logger: as for :class:`~envsync.curriculum.Strategy`.
        wait: as for :class:`~envsync.curriculum.Strategy`.

    Examples:
        >>> from envsync import EnvStateSender
        >>> sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
        >>> plr = PLR(sender, [{"difficulty": d} for d in (0.0, 0.5, 1.0)], staleness_coef=0.0, temperature=1.0)
        >>> plr.scores[:] = torch.tensor([3.0, 1.0, 2.0]); plr.seen[:] = True
        >>> [round(p, 3) for p in plr.replay_weights().tolist()]  # ranks 1, 3, 2
        [0.545, 0.182, 0.273]
        >>> sender.close()
    """

    def __init__(
        self,
        sender: Sender,
        levels: Sequence[Mapping[str, Any]],
        *,
        score: Callable[[Episode], float] = negative_return,
        temperature: float = 0.1,
        staleness_coef: float = 0.1,
        staleness_temperature: float = 1.0,
        alpha: float = 1.0,
        rho: float = 1.0,
        nu: float = 0.5,
        replay_schedule: str = "proportionate",
        envs: Iterable[int] | None = None,
        seed: int = 0,
        measures: Mapping[str, NestedKey | Measure] | None = None,
        logger: Any = None,
        wait: str | None = "received",
    ) -> None:
        super().__init__(sender, measures=measures, logger=logger, wait=wait)
        if not levels:
            raise ValidationError("PLR needs at least one level")
        if replay_schedule not in ("proportionate", "fixed"):
            raise ValidationError(f"replay_schedule={replay_schedule!r}; expected 'proportionate' or 'fixed'")
        if temperature <= 0 or staleness_temperature <= 0 or not 0 <= staleness_coef <= 1:
            raise ValidationError("PLR needs temperatures > 0 and staleness_coef in [0, 1]")
        self.levels = [dict(level) for level in levels]
        self._table = columns_of(self.levels, "PLR level")  # a row per level: a batch's levels in one read
        self.score_fn = score
        self.temperature, self.staleness_temperature = temperature, staleness_temperature
        self.staleness_coef = staleness_coef
        self.alpha, self.rho, self.nu, self.replay_schedule = alpha, rho, nu, replay_schedule
        self.envs = None if envs is None else list(envs)
        self.scores = torch.zeros(len(levels), dtype=torch.float64)
        self.staleness = torch.zeros(len(levels), dtype=torch.float64)
        self.seen = torch.zeros(len(levels), dtype=torch.bool)
        self.rng = random.Random(seed)
        self.assigned: dict[tuple[int, int], int] = {}
        self.draws = {"replay": 0, "new": 0}

    # ---- the rule --------------------------------------------------------------------------

    def update(self, episodes: list[Episode]) -> None:
        """Score the levels of whole episodes; draw the next level of every due env."""
        scored = 0
        for episode in episodes:
            level = self.assigned.get((episode.env, episode.version))
            if episode.whole and level is not None:
                self.update_score(level, self.score_fn(episode))
                scored += 1
        self.assigned = self.unsettled(self.assigned)
        due = self.due(self.envs)
        if due:
            chosen = self.samples(len(due))
            version = self.assign_columns(due, {name: column[chosen] for name, column in self._table.items()})
            self.assigned.update({(env, version): level for env, level in zip(due, chosen, strict=True)})
        if scored or due:
            self.record(seen=int(self.seen.sum()), **self.draws, scores=self.scores.tolist())

    def update_score(self, level: int, score: float) -> None:
        """Move a level's score towards ``score`` (by ``alpha``) and mark it seen."""
        scores = self.scores.numpy()  # the tensors' own memory: a scalar torch op per call cost ~10x
        scores[level] = (1 - self.alpha) * scores[level] + self.alpha * score
        self.seen.numpy()[level] = True

    def sample(self) -> int:
        """Draw the next level: replay a seen one, or a new one (see the module docstring)."""
        return self.samples(1)[0]

    def samples(self, count: int) -> list[int]:
        """Draw the next levels of ``count`` envs, one after the other (each draw makes the
        others staler): the rank weights once (no score changes meanwhile), the staleness
        weights at each draw."""
        seen = self.seen.numpy()
        share = float(seen.mean(dtype=np.float32))
        every = bool(seen.all())
        scaled = self._rank_part(seen)  # the same for every draw of the batch
        unseen = (~seen).astype(np.float64)
        staleness = self.staleness.numpy()  # the tensor's own memory
        chosen = []
        for _ in range(count):
            if self.replay_schedule == "fixed":
                replay = share >= self.rho and (self.rng.random() > self.nu or share == 1.0)
            else:
                replay = share >= self.rho and self.rng.random() < share
            if replay or every:
                level = self._choice(self._mixed(scaled, seen, staleness))
                self.draws["replay"] += 1
            else:
                level = self._choice(unseen)
                self.draws["new"] += 1
            staleness += 1
            staleness[level] = 0
            chosen.append(level)
        return chosen

    def replay_weights(self) -> torch.Tensor:
        """``P_replay`` over every level (0 for unseen ones)."""
        seen = self.seen.numpy()
        return torch.from_numpy(self._mixed(self._rank_part(seen), seen, self.staleness.numpy()))

    def _rank_part(self, seen: np.ndarray) -> np.ndarray:
        """The rank part of the mix: the rank weights times ``1 - staleness_coef``."""
        return (1 - self.staleness_coef) * self._rank_weights(seen)

    def _rank_weights(self, seen: np.ndarray) -> np.ndarray:
        scores = self.scores.numpy()
        ranks = np.empty_like(scores)
        ranks[np.argsort(-scores, kind="stable")] = np.arange(1, len(scores) + 1, dtype=np.float64)
        return _normalised((1.0 / ranks ** (1.0 / self.temperature)) * seen)

    def _mixed(self, scaled: np.ndarray, seen: np.ndarray, staleness: np.ndarray) -> np.ndarray:
        """The rank part of the mix (``scaled``: the rank weights times ``1 - staleness_coef``)
        plus the staleness weights of ``staleness`` now."""
        if self.staleness_coef <= 0:
            return scaled  # 1.0 times the rank weights: those exactly
        exponent = 1.0 / self.staleness_temperature
        stale = _normalised((staleness if exponent == 1.0 else staleness**exponent) * seen)  # x ** 1.0 is x
        return scaled + self.staleness_coef * stale

    def _choice(self, weights: np.ndarray) -> int:
        total = weights.sum()
        pick = self.rng.random()  # the first level whose cumulative weight is above it
        if not total > 0:  # no weight anywhere (nothing seen, staleness all zero): the last level
            return len(weights) - 1
        return min(int(np.searchsorted(np.cumsum(weights / total), pick, side="right")), len(weights) - 1)

    # ---- resuming --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The level buffer (scores, staleness, seen), the draw counts, the random state."""
        return {
            **super().state_dict(),
            "scores": self.scores.clone(),
            "staleness": self.staleness.clone(),
            "seen": self.seen.clone(),
            "draws": dict(self.draws),
            "rng": self.rng.getstate(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume the level buffer (every env draws again at its next decision)."""
        super().load_state_dict(state)
        self.scores.copy_(state["scores"])
        self.staleness.copy_(state["staleness"])
        self.seen.copy_(state["seen"])
        self.draws = dict(state["draws"])
        self.rng.setstate(state["rng"])
        self.assigned.clear()


def _normalised(weights: np.ndarray) -> np.ndarray:
    total = weights.sum()
    return weights / total if total > 0 else weights
