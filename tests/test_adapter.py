"""envsync.integrations.torchrl.adapter: a receiver beside a torchrl env, with real
collectors: a truncate that lands after a rollout's last step flags that step, a reset that
fails after an idle truncate apply is reported as a failure, and a ``max_frames_per_traj``
rewrap that would bypass the hooks is refused with the reason."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
from conftest import build
from helpers import apply_breaking_reset, make_counter_env, make_fragile_env, make_normed_counter_env, start_method
from torchrl.collectors import Collector

from envsync import EnvStateSender, ValidationError, WorkerApplyError


class PushAfterRollout(Collector):
    """A torchrl Collector that runs a callback after each rollout, before returning it: a
    version that arrives after the last step of a rollout, deterministically."""

    after_rollout: Any = None

    def rollout(self) -> Any:
        batch = super().rollout()
        if self.after_rollout is not None:
            self.after_rollout()
            self.after_rollout = None
        return batch


@pytest.mark.timeout(60)
def test_a_truncate_that_arrives_after_the_last_step_flags_that_step() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="truncate")
    collector = PushAfterRollout(
        sender.env_fn(make_counter_env), None, frames_per_batch=8, total_frames=-1, weight_sync_schemes=sender.schemes()
    )
    try:
        batches = iter(collector)
        next(batches)
        pushed: list[int] = []
        collector.after_rollout = lambda: pushed.append(sender.push(config={"difficulty": 3.0}, wait=None))
        batch = next(batches)
        assert bool(batch["next", "truncated"][-1].all()) and bool(batch["next", "done"][-1].all())
        assert not bool(batch["next", "terminated"][-1].any())
        after = next(batches)
        assert after["observation"][0, 2] == 0  # a fresh episode
        assert set(after["env_version"].tolist()) == set(pushed) and set(after["observation"][:, 0].tolist()) == {3.0}
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(60)
def test_a_reset_that_fails_after_an_idle_truncate_apply_is_a_failure_not_a_success() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply=apply_breaking_reset, apply_at="truncate")
    with start_method("fork"):
        collector = build("sync", sender, [partial(make_fragile_env, label=i) for i in range(2)])
    try:
        batches = iter(collector)
        next(batches)
        with pytest.raises(WorkerApplyError, match="reset refused") as info:
            sender.push(config={"difficulty": 500.0}, wait="applied")
        sender.wait(info.value.rollback, until="applied")
        assert set(next(batches)["next", "observation"][..., 0].reshape(-1).tolist()) == {0.0}
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(180)
def test_a_transformed_env_rewrapped_for_max_frames_per_traj_is_refused_with_the_reason() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    try:
        with pytest.raises(ValidationError, match="add StepCounter"):
            build("single", sender, make_normed_counter_env, frames_per_batch=10, max_frames_per_traj=4)
    finally:
        sender.close()
