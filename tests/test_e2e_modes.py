"""End to end: the three apply modes while a MultiAsyncCollector is iterated."""

from __future__ import annotations

from collections import defaultdict
from functools import partial

import pytest
import torch
from conftest import build
from helpers import check_truthful, make_counter_env, rows, start_method
from tensordict import TensorDictBase

from envsync import EnvStateSender
from envsync.envs import make_drift_env

WORKERS = 2


def counter_envs(max_steps: int = 1000) -> list[partial[object]]:
    return [partial(make_counter_env, label=i, max_steps=max_steps) for i in range(WORKERS)]


@pytest.mark.timeout(120)
def test_reset_mode_never_mixes_versions_in_a_trajectory() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="reset")
    with start_method("fork"):  # reset mode does not depend on it (spawn: test_e2e_collectors)
        collector = build("async", sender, make_drift_env, workers=WORKERS, frames_per_batch=100)
    difficulty = {0: 0.0}
    versions_per_traj: dict[int, set[int]] = defaultdict(set)
    try:
        for i, batch in enumerate(collector):
            if i % 3 == 2 and len(difficulty) < 6:
                version = sender.push(config={"difficulty": 0.1 * i}, wait="received")
                difficulty[version] = 0.1 * i
            check_truthful(batch, difficulty, index=1)
            for traj, root, nxt in zip(
                batch["collector", "traj_ids"].tolist(),
                batch["env_version"].tolist(),
                batch["next", "env_version"].tolist(),
                strict=True,
            ):
                versions_per_traj[traj].update((root, nxt))
            if len(difficulty) == 6 and sender.versions() == [max(difficulty)] * WORKERS or i > 200:
                break
        assert sender.versions() == [max(difficulty)] * WORKERS
        assert all(len(v) == 1 for v in versions_per_traj.values())
        assert len({v for vs in versions_per_traj.values() for v in vs}) > 2
    finally:
        collector.shutdown()
        sender.close()


def streams_by_label(batches: list[TensorDictBase]) -> dict[int, TensorDictBase]:
    """Concatenate, per worker (the label in observation[1]), that worker's frames in order."""
    per_label: dict[int, list[TensorDictBase]] = defaultdict(list)
    for batch in batches:
        for row in rows(batch):
            per_label[int(row["observation"][0, 1])].append(row)
    return {label: torch.cat(parts) for label, parts in per_label.items()}


@pytest.mark.timeout(120)
def test_step_mode_changes_config_mid_episode() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method("fork"):
        collector = build("async", sender, counter_envs(), frames_per_batch=40)
    difficulty = {0: 0.0}
    batches = []
    try:
        for i, batch in enumerate(collector):
            batches.append(batch.clone())
            if i == 2:
                version = sender.push(config={"difficulty": 3.0}, wait=None)
                difficulty[version] = 3.0
            check_truthful(batch, difficulty, index=0)
            if i > 4 and sender.versions() == [version] * WORKERS:
                batches.append(next(iter(collector)).clone())
                break
            assert i < 50
    finally:
        collector.shutdown()
        sender.close()
    for stream in streams_by_label(batches).values():
        nxt = stream["next", "env_version"]
        changes = torch.nonzero(nxt[1:] != nxt[:-1]).flatten().tolist()
        assert len(changes) == 1
        t = changes[0] + 1
        # the config changed between two steps of one episode: no done, no reset
        assert not bool(stream["next", "done"][t - 1])
        assert stream["observation"][t, 2] == stream["next", "observation"][t - 1, 2]
        assert stream["next", "observation"][t, 2] == stream["observation"][t, 2] + 1
        assert stream["env_version"][t] == 0 and nxt[t] == version
        assert stream["observation"][t, 0] == 0.0 and stream["next", "observation"][t, 0] == 3.0


@pytest.mark.timeout(120)
def test_truncate_mode_ends_the_episode_as_truncated() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="truncate")
    with start_method("fork"):
        collector = build("async", sender, counter_envs(), frames_per_batch=200)
    difficulty = {0: 0.0}
    batches = []
    try:
        for i, batch in enumerate(collector):
            batches.append(batch.clone())
            if i % 2 == 1 and len(difficulty) < 6:
                version = sender.push(config={"difficulty": 0.5 + i}, wait=None)
                difficulty[version] = 0.5 + i
            check_truthful(batch, difficulty, index=0)
            if len(difficulty) == 6 and sender.versions() == [version] * WORKERS:
                break
            assert i < 100
    finally:
        collector.shutdown()
        sender.close()
    truncated_in_flight = 0
    for stream in streams_by_label(batches).values():
        nxt = stream["next", "env_version"]
        for t in (torch.nonzero(nxt[1:] != nxt[:-1]).flatten() + 1).tolist():
            # the new version starts with a fresh episode ...
            assert stream["observation"][t, 2] == 0.0 and stream["env_version"][t] == nxt[t]
            # ... and the old one ended as truncated, not terminated, unless the push found
            # the worker between two rollouts (idle: applied at once, env reset, no mark)
            if bool(stream["next", "truncated"][t - 1]):
                assert not bool(stream["next", "terminated"][t - 1])
                truncated_in_flight += 1
            else:
                assert t % 200 == 0
        # envsync's truncations are the only ones (episodes last 1000 steps otherwise)
        assert int(stream["next", "truncated"].sum()) <= len(difficulty) - 1
    assert truncated_in_flight >= 1
