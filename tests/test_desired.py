"""envsync.sender.desired: the sender's records of desired state own their data: a pushed tensor
is copied at the push, and a collector that joins later is given the copy."""

from __future__ import annotations

import pytest
import torch
from conftest import build
from env_state_checks import loc_key
from helpers import make_normed_counter_env, start_method

from envsync import EnvStateSender


@pytest.mark.timeout(180)
def test_pushed_tensors_are_copied_at_the_push() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    first = build("single", sender, make_normed_counter_env, frames_per_batch=10)
    key = loc_key(sender)
    loc = torch.full((3,), 2.0)
    try:
        sender.push(env_state={key: loc}, wait="applied")
        loc.fill_(99.0)  # the caller reuses its tensor
        assert sender.state_dict()["env_state"][key].tolist() == [2.0] * 3
        with start_method("fork"):
            late = build("sync", sender, [make_normed_counter_env], frames_per_batch=10)  # joins later
        try:
            gathered = sender.gather([key], workers=[1])
            assert gathered[0].get(tuple(key.split("."))).tolist() == [2.0] * 3
        finally:
            late.shutdown()
    finally:
        first.shutdown()
        sender.close()
