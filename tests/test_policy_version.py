"""An env push through torchrl's ``update_policy_weights_(..., model_id="env")`` leaves the
policy version alone (``track_policy_version=True``), on torchrl 0.14.1 and on the nightly
(``make test-nightly``); a policy update still moves it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import build
from helpers import start_method
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from envsync import EnvStateSender
from envsync.envs import make_drift_env


def tags(batches: Any) -> list[int]:
    """The policy versions the frames of the next batch carry (written by the workers'
    ``PolicyVersion`` transforms)."""
    return sorted(set(next(batches)["next", "policy_version"].flatten().tolist()))


def env_push(difficulty: float) -> TensorDict:
    return TensorDict(config={"difficulty": difficulty})


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["single", "sync"])
def test_an_env_push_through_update_policy_weights_never_moves_the_policy_version(kind: str) -> None:
    torch.manual_seed(0)
    policy = TensorDictModule(nn.Linear(2, 1), in_keys=["observation"], out_keys=["action"])
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method("fork"):
        collector = build(kind, sender, make_drift_env, policy=policy, frames_per_batch=16, track_policy_version=True)
    # torchrl 0.14.1's multi-process collectors keep no aggregate version (it stays put);
    # the nightly's count one (it has worker_policy_versions); a single Collector counts
    counts = kind == "single" or hasattr(collector, "worker_policy_versions")
    try:
        batches = iter(collector)
        assert tags(batches) == [0] and collector.policy_version == 0
        collector.update_policy_weights_(weights=env_push(0.5), model_id="env")
        collector.update_policy_weights_(env_push(0.6), model_id="env", worker_ids=[0])  # one worker
        sender.wait(sender.version, until="applied", envs=[0])
        assert collector.policy_version == 0
        assert tags(batches) == [0] and tags(batches) == [0]
        assert sender.version == 2

        collector.update_policy_weights_()  # a policy update still counts
        tags(batches)
        assert tags(batches) == [1] and collector.policy_version == (1 if counts else 0)

        # env and policy in one call: counted once, for the policy
        both = {"env": env_push(0.7), "policy": TensorDict.from_module(policy)}
        collector.update_policy_weights_(weights_dict=both)
        tags(batches)
        assert tags(batches) == [2] and collector.policy_version == (2 if counts else 0)
        assert sender.version == 3
        sender.wait(3, until="applied")
    finally:
        collector.shutdown()
        sender.close()
