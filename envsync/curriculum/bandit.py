"""A bandit over discrete tasks: UCB1 or EXP3 (Auer et al. 2002), per env or per worker.

The arms are configs (task variants). When an env (``per="env"``) or every env of a worker
(``per="worker"``) is due (:meth:`~envsync.curriculum.Strategy.due`: at its reset, in reset
mode), it pulls an arm; a worker's envs all get the same arm. Every whole episode run under
a pull is one reward for its arm: ``reward(episode)`` (default the return), mapped from
``reward_range`` to ``[0, 1]`` and clipped, as both rules assume.

- ``"ucb1"``: an arm never rewarded yet first (lowest index first, one pull each); then the
  arm with the largest ``mean_i + sqrt(2 ln n / n_i)`` (``n`` rewards in all, ``n_i`` of arm
  ``i``; ties to the lowest index).
- ``"exp3"``: draw arm ``i`` with ``p_i = (1 - gamma) w_i / sum(w) + gamma / K``; a reward
  ``x`` of a pull drawn with ``p_i`` multiplies ``w_i`` by ``exp(gamma * (x / p_i) / K)``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from envsync.curriculum.base import Strategy, columns_of, envs_of_workers
from envsync.curriculum.ledger import Episode, Measure, NestedKey
from envsync.errors import ValidationError
from envsync.sender.sender import Sender


def episode_return(episode: Episode) -> float:
    """The default reward of a pull: the episode's return."""
    return episode.episode_return


class Bandit(Strategy):
    """A UCB1 or EXP3 bandit choosing each env's (or worker's) task.

    Args:
        sender: the sender.
        arms: the tasks: configs (template names to values).
        rule: ``"ucb1"`` or ``"exp3"``.
        per: ``"env"`` (each env pulls) or ``"worker"`` (each worker pulls for its envs).
        reward: ``fn(episode) -> float``, the reward of one whole episode.
        reward_range: the ``(low, high)`` of rewards, mapped to ``[0, 1]``.
        gamma: EXP3's exploration rate.
        seed: seeds EXP3's draws.
        measures: as for :class:`~envsync.curriculum.Strategy`.
        logger: as for :class:`~envsync.curriculum.Strategy`.
        wait: as for :class:`~envsync.curriculum.Strategy`.

    Examples:
        >>> from envsync import EnvStateSender
        >>> sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
        >>> bandit = Bandit(sender, [{"difficulty": d} for d in (0.0, 1.0)], reward_range=(0.0, 50.0))
        >>> [bandit.select() for _ in range(2)]  # each arm once first
        [0, 1]
        >>> bandit.reward(0, 0.9); bandit.reward(1, 0.2)
        >>> bandit.select()
        0
        >>> sender.close()
    """

    def __init__(
        self,
        sender: Sender,
        arms: Sequence[Mapping[str, Any]],
        *,
        rule: str = "ucb1",
        per: str = "env",
        reward: Callable[[Episode], float] = episode_return,
        reward_range: tuple[float, float] = (0.0, 1.0),
        gamma: float = 0.1,
        seed: int = 0,
        measures: Mapping[str, NestedKey | Measure] | None = None,
        logger: Any = None,
        wait: str | None = "received",
    ) -> None:
        super().__init__(sender, measures=measures, logger=logger, wait=wait)
        if len(arms) < 1 or rule not in ("ucb1", "exp3") or per not in ("env", "worker"):
            raise ValidationError(f"Bandit needs arms, rule 'ucb1'/'exp3', per 'env'/'worker'; got {rule!r}, {per!r}")
        if reward_range[1] <= reward_range[0] or not 0 < gamma <= 1:
            raise ValidationError(f"Bandit needs reward_range low < high, gamma in (0, 1]; got {reward_range}, {gamma}")
        self.arms = [dict(arm) for arm in arms]
        self._table = columns_of(self.arms, "arm")  # a row per arm: a batch's pulls in one read
        self.rule, self.per, self.reward_fn, self.reward_range, self.gamma = rule, per, reward, reward_range, gamma
        self.counts = torch.zeros(len(arms), dtype=torch.int64)
        self.sums = torch.zeros(len(arms), dtype=torch.float64)
        self.weights = torch.ones(len(arms), dtype=torch.float64)
        self.rng = random.Random(seed)
        self.pulls: dict[tuple[int, int], tuple[int, float]] = {}
        self._pending: list[int] = []

    # ---- the rule --------------------------------------------------------------------------

    def select(self) -> int:
        """The arm of the next pull (see the module docstring)."""
        return self.selects(1)[0]

    def selects(self, count: int) -> list[int]:
        """The arms of the next ``count`` pulls, as many calls of :meth:`select` would give
        them: no reward comes in between, so EXP3's probabilities (a draw each) and UCB1's
        bounds are computed once."""
        if self.rule == "exp3":
            cumulative = np.cumsum(self.probabilities().numpy())  # in order, as a running total
            picks = np.array([self.rng.random() for _ in range(count)])
            # each pull's arm: the first whose running total is above its draw (the last if none)
            return np.searchsorted(cumulative, picks, side="right").clip(max=len(cumulative) - 1).tolist()
        untried = [a for a in np.flatnonzero(self.counts.numpy() == 0).tolist() if a not in self._pending][:count]
        self._pending.extend(untried)
        if len(untried) == count:
            return untried
        n = max(int(self.counts.sum()), 1)
        counts = self.counts.clamp(min=1).double()
        bounds = self.sums / counts + torch.sqrt(2 * math.log(n) / counts)
        return untried + [int(torch.argmax(bounds))] * (count - len(untried))

    def probabilities(self) -> torch.Tensor:
        """EXP3's draw probabilities."""
        k = len(self.arms)
        return (1 - self.gamma) * self.weights / self.weights.sum() + self.gamma / k

    def reward(self, arm: int, value: float, probability: float | None = None) -> None:
        """Take one reward in ``[0, 1]`` for ``arm`` (EXP3: of a pull drawn with ``probability``)."""
        # on numpy views of the tensors' own memory: a scalar torch op per call cost ~10x
        self.counts.numpy()[arm] += 1
        self.sums.numpy()[arm] += value
        if arm in self._pending:
            self._pending.remove(arm)
        if self.rule == "exp3":
            p = probability if probability is not None else float(self.probabilities()[arm])
            weights = self.weights.numpy()
            weights[arm] *= math.exp(self.gamma * (value / p) / len(self.arms))
            weights /= weights.max()  # the same probabilities, kept in range

    def scaled(self, episode: Episode) -> float:
        """An episode's reward mapped to ``[0, 1]``."""
        low, high = self.reward_range
        return min(max((self.reward_fn(episode) - low) / (high - low), 0.0), 1.0)

    def update(self, episodes: list[Episode]) -> None:
        """Reward the arms of whole episodes; pull for every due env (or worker)."""
        rewarded = 0
        for episode in episodes:
            pull = self.pulls.get((episode.env, episode.version))
            if episode.whole and pull is not None:
                self.reward(pull[0], self.scaled(episode), pull[1])
                rewarded += 1
        self.pulls = self.unsettled(self.pulls)
        groups = self._due_groups()
        if groups:
            chosen = self.selects(len(groups))
            probabilities = self.probabilities().tolist()
            envs = [env for group in groups for env in group]
            arms = [arm for group, arm in zip(groups, chosen, strict=True) for _ in group]
            version = self.assign_columns(envs, {name: column[arms] for name, column in self._table.items()})
            self.pulls.update({(env, version): (arm, probabilities[arm]) for env, arm in zip(envs, arms, strict=True)})
        if rewarded or groups:
            self.record(counts=self.counts.tolist(), means=(self.sums / self.counts.clamp(min=1)).tolist())

    def _due_groups(self) -> list[list[int]]:
        if self.per == "env":
            return [[env] for env in self.due()]
        due = set(self.due())
        return [envs for envs in envs_of_workers(self.sender).values() if envs and set(envs) <= due]

    # ---- resuming --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Every arm's reward count and sum, EXP3's weights, the random state, the history."""
        return {
            **super().state_dict(),
            "counts": self.counts.clone(),
            "sums": self.sums.clone(),
            "weights": self.weights.clone(),
            "rng": self.rng.getstate(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume the arms' statistics (every env pulls again at its next decision)."""
        super().load_state_dict(state)
        self.counts.copy_(state["counts"])
        self.sums.copy_(state["sums"])
        self.weights.copy_(state["weights"])
        self.rng.setstate(state["rng"])
        self.pulls.clear()
        self._pending.clear()
