"""The seams between features (issue "Truthful and exact at every seam"): statistics in every
apply mode and after a failed sync, records that own their data, checkpoints that keep what
each worker was given, a receiver that never acknowledges what it did not load."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from conftest import build
from helpers import make_slow_vecnorm_env, rows, start_method

from envsync import AckTimeout, EnvStateSender

pytestmark = pytest.mark.timeout(180)


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
    state = sender.state_dict()["env_state"]
    return int(state["stats.0.observation.count"]), state["stats.0.observation.mean"]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_sync_stats_in_reset_mode_returns_and_counts_every_observation_once(kind: str) -> None:
    """Default apply_at="reset": a sync returns once every worker has the merge armed (it is
    applied at each env's next reset, on top of what the env saw since the gather); the merge
    counts every observation once, round after round."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    makers = [partial(make_slow_vecnorm_env, i, horizon=7) for i in range(2)]
    with start_method("fork"):
        collector = build(kind, sender, makers, frames_per_batch=20)
    seen = Seen()
    try:
        batches = iter(collector)
        for _ in range(4):
            for _ in range(2):
                seen.add(next(batches))
            if kind == "async":  # workers run on: count what they saw up to the gather below
                break
            sender.sync_stats("VecNormV2", timeout=20.0)
            count, mean = seen.count_mean()
            merged_count, merged_mean = merged_stats(sender)
            assert merged_count == count, "an observation counted twice, or lost"
            torch.testing.assert_close(merged_mean, mean, rtol=1e-5, atol=1e-5)
        if kind == "async":
            version = sender.sync_stats("VecNormV2", timeout=20.0)
            assert sender.version == version
            merged_count, _ = merged_stats(sender)
            assert merged_count >= seen.count_mean()[0]
    finally:
        collector.shutdown()
        sender.close()


def test_a_sync_that_times_out_counts_nothing_twice_in_the_next() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0, "delay": 0.0}, apply="set_difficulty", apply_at="step")
    makers = [partial(make_slow_vecnorm_env, i) for i in range(2)]
    with start_method("fork"):
        collector = build("sync", sender, makers, frames_per_batch=20)
    seen = Seen()
    try:
        batches = iter(collector)
        seen.add(next(batches))
        sender.push(config={"delay": 1.5}, wait="applied", timeout=20.0)  # every apply now takes 1.5 s
        seen.add(next(batches))
        with pytest.raises(AckTimeout):
            sender.sync_stats("VecNormV2", timeout=0.5)
        sender.push(config={"delay": 0.0}, wait="applied", timeout=20.0)
        seen.add(next(batches))
        sender.sync_stats("VecNormV2", timeout=20.0)
        count, mean = seen.count_mean()
        merged_count, merged_mean = merged_stats(sender)
        assert merged_count == count, "the timed-out sync's observations were counted again"
        torch.testing.assert_close(merged_mean, mean, rtol=1e-5, atol=1e-5)
    finally:
        collector.shutdown()
        sender.close()
