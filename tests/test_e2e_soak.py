"""End to end: 200 pushes while a MultiAsyncCollector is iterated without pause."""

from __future__ import annotations

import itertools
from functools import partial

import pytest
from conftest import build
from helpers import check_truthful, make_counter_env, rows, start_method

from envsync import EnvStateSender

WORKERS = 2
FRAMES = 20
PUSHES = 200


@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_pushes_while_iterating_lose_nothing(method: str) -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    makers = [partial(make_counter_env, label=i, max_steps=10**9) for i in range(WORKERS)]
    with start_method(method):
        collector = build("async", sender, makers, frames_per_batch=FRAMES)
    waits = itertools.cycle(["received", None, "applied"])
    difficulty = {0: 0.0}
    last_step = dict.fromkeys(range(WORKERS), 0.0)
    last_version = dict.fromkeys(range(WORKERS), 0)
    batches = frames = 0
    try:
        for batch in collector:
            batches += 1
            frames += batch.numel()
            if len(difficulty) <= PUSHES:
                value = float(len(difficulty))
                version = sender.push(config={"difficulty": value}, wait=next(waits))
                difficulty[version] = value
            check_truthful(batch, difficulty, index=0)
            for row in rows(batch):
                worker = int(row["observation"][0, 1])
                steps = row["observation"][:, 2]
                # the episode never ends, so each worker's step counter runs on without a gap:
                # a dropped or duplicated batch would break it
                assert steps[0].item() == last_step[worker]
                assert bool((steps.diff() == 1).all())
                last_step[worker] = row["next", "observation"][-1, 2].item()
                versions = row["next", "env_version"]
                assert versions[0].item() >= last_version[worker]
                assert bool((versions.diff() >= 0).all())
                last_version[worker] = versions[-1].item()
            if len(difficulty) > PUSHES and sender.versions() == [PUSHES] * WORKERS:
                break
            assert batches < 20 * PUSHES
    finally:
        collector.shutdown()
        sender.close()
    assert sender.version == PUSHES
    assert frames == batches * FRAMES
    assert sum(last_step.values()) == frames
