"""End to end: policies, max_frames_per_traj, torchrl's update path, env state, failures."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from conftest import build
from helpers import check_truthful, make_normed_counter_env, rows, start_method
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from envsync import EnvStateSender, ValidationError
from envsync.envs import make_drift_env

CASES = [("single", "spawn"), ("sync", "spawn"), ("async", "fork")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("kind", "method"), CASES)
def test_module_policy_max_frames_and_torchrl_update_path(kind: str, method: str) -> None:
    torch.manual_seed(0)
    policy = TensorDictModule(nn.Linear(2, 1), in_keys=["observation"], out_keys=["action"])
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method(method):
        collector = build(kind, sender, make_drift_env, policy=policy, max_frames_per_traj=10)
    workers = 1 if kind == "single" else 2
    try:
        batches = iter(collector)
        batch = next(batches)
        with torch.no_grad():
            assert torch.allclose(batch["action"], policy.module(batch["observation"]), atol=1e-5)
            policy.module.weight.fill_(0.5)
        collector.update_policy_weights_()
        collector.update_policy_weights_(weights=TensorDict(config={"difficulty": 0.5}), model_id="env")
        assert sender.version == 1
        sender.wait(1, until="applied")
        assert sender.versions() == [1] * workers
        for _ in range(2 * workers + 1):
            batch = next(batches)
            check_truthful(batch, {0: 0.0, 1: 0.5}, index=1)
        assert bool((batch["next", "env_version"] == 1).all())
        with torch.no_grad():
            assert torch.allclose(batch["action"], policy.module(batch["observation"]), atol=1e-5)
        # the StepCounter of max_frames_per_traj still truncates every 10 steps
        assert int(batch["next", "step_count"].max()) <= 10
        assert bool(batch["next", "truncated"].any())
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(120)
def test_env_state_is_loaded_in_place_and_validated() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    makers = [partial(make_normed_counter_env, label=i) for i in range(2)]
    with start_method("fork"):
        collector = build("sync", sender, makers)
    try:
        batches = iter(collector)
        next(batches)
        with pytest.raises(ValidationError, match="not in the env's state_dict"):
            sender.push(env_state={"mean": torch.zeros(3)})
        with pytest.raises(ValidationError, match="shape"):
            sender.push(env_state={"loc": torch.zeros(2)})
        loc = torch.tensor([1.0, 0.0, 0.0])
        v1 = sender.push(config={"difficulty": 3.0}, env_state={"loc": loc}, wait="applied")
        batch = next(batches)
        assert bool((batch["next", "env_version"] == v1).all())
        assert bool((batch["next", "observation"][..., 0] == 2.0).all())
        # a later config-only push keeps the loaded state (it is not re-applied, not reset)
        v2 = sender.push(config={"difficulty": 5.0}, wait="applied")
        batch = next(batches)
        assert bool((batch["next", "env_version"] == v2).all())
        assert bool((batch["next", "observation"][..., 0] == 4.0).all())
    finally:
        collector.shutdown()
        sender.close()


def test_rows_helper_splits_multi_worker_batches() -> None:
    batch = TensorDict(x=torch.arange(6).reshape(2, 3), batch_size=[2, 3])
    assert [r["x"].tolist() for r in rows(batch)] == [[0, 1, 2], [3, 4, 5]]
