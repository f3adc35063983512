"""End to end: each collector kind and start method, real workers, real gymnasium envs."""

from __future__ import annotations

import pytest
from conftest import build
from helpers import check_truthful, start_method, tags_non_decreasing

from envsync import EnvStateSender
from envsync.envs import make_drift_env
from envsync.integrations.torchrl.tags import TAG_KEYS, tags_set_aside

MATRIX = [
    ("single", "spawn"),
    pytest.param("sync", "spawn", marks=pytest.mark.wide),  # ~8 s; make test keeps a spawned MultiAsyncCollector
    ("async", "spawn"),
    ("sync", "fork"),
    ("async", "fork"),
]


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


@pytest.mark.timeout(60)
def test_tags_stay_out_of_the_buffer_while_steps_are_stacked_and_keep_their_storage() -> None:
    # torchrl looks every buffer key up in every step it stacks; the steps never carry the
    # tags, so the rollout runs with them set aside and gets the very same tensors back
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = build("single", sender, make_drift_env, frames_per_batch=20)
    try:
        batches = iter(collector)
        next(batches)
        buffer = collector._final_rollout
        tags = {key: buffer.get(key) for key in TAG_KEYS}
        with tags_set_aside(collector):
            assert not [key for key in TAG_KEYS if buffer.get(key, None) is not None]
        assert all(buffer.get(key) is tensor for key, tensor in tags.items())
        version = sender.push(config={"difficulty": 0.5}, wait=None)
        batch = next(batches)
        check_truthful(batch, {0: 0.0, version: 0.5}, index=1)
        assert bool((batch["next", "env_version"] == version).all())
        assert all(buffer.get(key) is tensor for key, tensor in tags.items())  # filled in place
        assert bool((tags[("next", "env_version")] == version).all())
    finally:
        collector.shutdown()
        sender.close()
