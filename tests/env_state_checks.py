"""Reading env state back in end-to-end tests: every observation each worker's VecNormV2 saw,
the statistics the sender's checkpoint holds, and the key of an ObservationNorm's ``loc``."""

from __future__ import annotations

from typing import Any

import torch
from helpers import rows

from envsync import EnvStateSender


class Seen:
    """Every observation each worker's VecNormV2 saw: each step's next observation, and the
    reset observations (the root of a stream's first frame, and of every frame after a done)."""

    def __init__(self) -> None:
        self.observations: list[torch.Tensor] = []
        self._done_last: dict[int, bool] = {}

    def add(self, batch: Any) -> None:
        for row in rows(batch):
            worker = int(row["env_index"][0])
            done = row["next", "done"].reshape(-1)
            after_done = torch.cat([torch.tensor([self._done_last.get(worker, True)]), done[:-1]])
            self.observations += [row["observation"][after_done], row["next", "observation"]]
            self._done_last[worker] = bool(done[-1])

    def count_mean(self) -> tuple[int, torch.Tensor]:
        x = torch.cat(self.observations).double()
        return x.shape[0], x.mean(0)


def merged_stats(sender: EnvStateSender) -> tuple[int, torch.Tensor]:
    return merged_stats_of(sender.state_dict())


def merged_stats_of(state: dict[str, Any]) -> tuple[int, torch.Tensor]:
    return int(state["env_state"]["stats.0.observation.count"]), state["env_state"]["stats.0.observation.mean"]


def loc_key(sender: EnvStateSender) -> str:
    """The env-state key of the ObservationNorm's ``loc``."""
    return next(k for k in sender.env_state_template().keys if k.endswith("loc"))
