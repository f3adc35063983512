"""A worker that fails while answering a gather: gather raises promptly, naming the worker
and carrying its traceback; no version is marked failed and nothing is rolled back."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import pytest
from conftest import build
from helpers import arm_flaky_read, make_batched_flaky, make_flaky_env, start_method

from envsync import EnvStateSender, GatherError

CASES = {  # per case: one factory per worker, every env labelled with its fleet index
    "single": [partial(make_flaky_env, label=0)],
    "sync": [partial(make_flaky_env, label=w) for w in range(2)],
    "async": [partial(make_flaky_env, label=w) for w in range(2)],
    "single-parallel-env": [partial(make_batched_flaky, "parallel", 2, 0)],
    "sync-serial-env": [partial(make_batched_flaky, "serial", 2, 2 * w) for w in range(2)],
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_a_failure_while_answering_a_gather_raises_from_gather_and_fails_no_version(case: str) -> None:
    makers = CASES[case]
    kind = case.split("-")[0]
    sender = EnvStateSender(config={"difficulty": 0.0, "fail_read": 0.0}, apply=arm_flaky_read, apply_at="step")
    with start_method("fork"):
        collector: Any = build(kind, sender, makers, frames_per_batch=8)
    try:
        next(iter(collector))
        last = (sender.num_envs or 0) - 1  # the one env whose next read fails, once
        armed = sender.push(config={"difficulty": 1.0, "fail_read": last + 1.0}, wait="applied")
        start = time.monotonic()
        with pytest.raises(GatherError) as caught:
            sender.gather(env_state=["level"])
        assert time.monotonic() - start < 2.0
        err = caught.value
        assert err.env == last and err.worker in range(sender.num_workers or 0)
        assert "transient failure reading the transform's state" in err.remote_traceback
        assert f"worker {err.worker}" in str(err)
        # the gather failed; the apply did not: every env still runs the armed version
        assert sender.env_versions() == [armed] * len(sender.env_versions())
        after = sender.push(config={"difficulty": 2.0, "fail_read": 0.0}, wait="applied")
        assert after == armed + 1  # no rollback version was published in between
        assert sender.env_versions() == [after] * len(sender.env_versions())
        assert sender.desired_config()["difficulty"].item() == 2.0
        assert sender.gather(env_state=["level"])["level"].shape[0] == len(sender.env_versions())
    finally:
        collector.shutdown()
        sender.close()
