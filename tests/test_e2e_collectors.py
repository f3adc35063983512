"""End to end: each collector kind and start method, real workers, real gymnasium envs."""

from __future__ import annotations

import pytest
from conftest import build
from helpers import check_truthful, start_method, tags_non_decreasing

from envsync import EnvStateSender
from envsync.envs import make_drift_env

MATRIX = [("single", "spawn"), ("sync", "spawn"), ("async", "spawn"), ("sync", "fork"), ("async", "fork")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("kind", "method"), MATRIX)
def test_frames_after_applied_push_run_the_new_config(kind: str, method: str) -> None:
    workers = 1 if kind == "single" else 2
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method(method):
        collector = build(kind, sender, make_drift_env, workers=workers)
    difficulty = {0: 0.0}
    try:
        batches = iter(collector)
        check_truthful(next(batches), difficulty, index=1)
        for step in (1, 2, 3):
            version = sender.push(config={"difficulty": 0.25 * step}, wait="applied")
            difficulty[version] = 0.25 * step
            # a MultiAsyncCollector may still deliver, per worker, one queued batch and the
            # one in progress when the push returned; they hold older frames, truthfully tagged
            in_flight = 2 * workers if kind == "async" else 0
            for i in range(in_flight + 2):
                batch = next(batches)
                check_truthful(batch, difficulty, index=1)
                assert tags_non_decreasing(batch)
                if i >= in_flight:
                    assert bool((batch["next", "env_version"] >= version).all())
                    assert bool((batch["next", "observation"][..., 1] == 0.25 * step).all())
        assert sender.versions() == [version] * workers
    finally:
        collector.shutdown()
        sender.close()
