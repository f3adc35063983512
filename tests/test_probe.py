"""envsync.sender.probe: the env in the main process that stands for the workers' envs: refused
when its env cannot take the apply mode, never built when the template is declared."""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch
from conftest import build
from helpers import built_in_main_refused, start_method

from envsync import EnvStateSender, ValidationError


@pytest.mark.timeout(60)
def test_a_declared_env_state_template_builds_no_env_in_the_main_process() -> None:
    sender = EnvStateSender(
        config={"difficulty": 0.0},
        apply="set_difficulty",
        apply_at="step",
        env_state_template={"loc": torch.zeros(3), "scale": torch.ones(3)},
    )
    factory = partial(built_in_main_refused, main_pid=os.getpid())
    with start_method("fork"):
        collector = build("sync", sender, [factory] * 2)
    try:
        version = sender.push(env_state={"loc": torch.full((3,), 2.0)}, wait="applied")
        assert sender.versions() == [version] * 2
        assert [t.tolist() for t in collector.get_distant_attr("env.transform.loc")] == [[2.0] * 3] * 2
        with pytest.raises(ValidationError, match="'transforms.1.loc' is not in the env's state_dict"):
            sender.push(env_state={"transforms.1.loc": torch.zeros(3)})
    finally:
        collector.shutdown()
        sender.close()


def test_a_truncate_mode_env_without_a_truncated_key_is_refused() -> None:
    from helpers import NoTruncationEnv

    sender = EnvStateSender(config={}, apply_at="truncate")
    sender.env_fn(NoTruncationEnv)
    with pytest.raises(ValidationError, match="truncated"):
        sender.env_state_template()
    sender.close()
