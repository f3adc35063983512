"""The sender's record of past configs: lookup by (env, version), pruning, and the sender's hooks."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from helpers import make_native_counters
from tensordict import TensorDict
from torchrl.collectors import Collector

from envsync import EnvStateSender, ValidationError
from envsync.envs import make_drift_env
from envsync.sender.history import ConfigHistory


def leaves(value: float) -> dict[tuple[str, str], np.ndarray]:
    return {("config", "difficulty"): np.array(value, dtype=np.float32), ("env_state", "loc"): np.zeros(1)}


def test_lookup_is_the_latest_version_published_to_the_env_at_or_before() -> None:
    history = ConfigHistory()
    history.record(0, {0: leaves(0.0), 1: leaves(0.0)})
    history.record(2, {1: leaves(0.2)})
    history.record(5, {0: leaves(0.5), 1: leaves(0.6)})
    assert [history.config(0, v)["difficulty"].item() for v in range(7)] == [0.0] * 5 + [0.5, 0.5]
    env_1 = [round(history.config(1, v)["difficulty"].item(), 3) for v in range(7)]
    assert env_1 == [0.0, 0.0, 0.2, 0.2, 0.2, 0.6, 0.6]
    assert list(history.config(0, 0).keys()) == ["difficulty"], "only the config section is kept"


def test_unknown_env_or_version_is_a_validation_error() -> None:
    history = ConfigHistory()
    history.record(3, {0: leaves(0.3)})
    with pytest.raises(ValidationError, match="env 1 has no recorded config"):
        history.config(1, 3)
    with pytest.raises(ValidationError, match="no config at version 2.*oldest kept version is 3"):
        history.config(0, 2)
    with pytest.raises(ValidationError, match="keep"):
        ConfigHistory(keep=-1)


def applied_at(version: int) -> Callable[[np.ndarray], np.ndarray]:
    """Every env applied ``version`` (the history asks for many envs at once)."""
    return lambda envs: np.full(len(envs), version, dtype=np.int64)


def test_pruning_keeps_what_is_in_effect_at_the_applied_version_and_keep_older() -> None:
    history = ConfigHistory(keep=2)
    for version in range(20):
        history.record(version, {0: leaves(version / 10)}, applied_at(0))
    assert history.versions(0) == list(range(20)), "nothing applied yet: everything can still arrive"
    history.record(20, {0: leaves(2.0)})
    history.prune(applied_at(15))
    assert history.versions(0) == list(range(13, 21)), "two entries older than the applied one are kept"
    assert history.config(0, 13)["difficulty"].item() == pytest.approx(1.3)
    with pytest.raises(ValidationError, match="pruned"):
        history.config(0, 12)


def test_pruning_follows_each_envs_own_applied_version() -> None:
    """Envs of one record are pruned each by its own applied version: a record stays while
    any of its envs may still need it."""
    history = ConfigHistory(keep=0)
    for version in range(6):
        history.record(version, {0: leaves(version), 1: leaves(-version)})
    history.prune(lambda envs: np.where(envs == 0, 5, 2))
    assert history.versions(0) == [5]
    assert history.versions(1) == [2, 3, 4, 5]
    assert history.config(1, 2)["difficulty"].item() == -2.0


def test_pruning_is_bounded_per_env() -> None:
    history = ConfigHistory(keep=3)
    for version in range(200):
        history.record(version, {0: leaves(float(version)), 1: leaves(0.0)}, applied_at(199))
    # keep older ones, the one in effect, and at most 16 more before a prune (history.SLACK)
    assert all(len(history.versions(env)) <= 3 + 1 + 16 for env in (0, 1))


def test_older_entries_of_a_large_config_are_kept_within_keep_bytes() -> None:
    """A 1 MB config pushed 40 times with keep=64: the entries older than the one in effect
    hold at most keep_bytes (3 MB: three of them), not 64 MB; an unchanged leaf shared by
    every entry is counted once."""
    history = ConfigHistory(keep=64, keep_bytes=3 << 20)
    fixed = torch.zeros(1 << 18)  # 1 MB, the same object in every entry
    for version in range(40):
        big = {("config", "w"): torch.full((1 << 18,), float(version)), ("config", "fixed"): fixed}
        history.record(version, {0: big}, applied_at(39))
    assert history.versions(0) == list(range(36, 40))
    assert history.config(0, 36)["w"][0].item() == 36.0
    with pytest.raises(ValidationError, match="pruned"):
        history.config(0, 35)
    with pytest.raises(ValidationError, match="keep_bytes"):
        ConfigHistory(keep_bytes=-1)


def test_lookups_walk_records_chained_as_a_whole_and_row_by_row() -> None:
    """Pushes to every env in order chain their records by two numbers; a push to some envs,
    or to every env in another order, chains row by row: look-ups walk both alike."""
    history = ConfigHistory()
    values = {0: [0.0, 0.1, 0.2], 1: [1.0, 1.1, 1.2], 3: [3.0, 3.1, 3.2]}
    for version, row in values.items():
        history.record(version, {env: leaves(value) for env, value in enumerate(row)})
    history.record(4, {1: leaves(4.1)})
    history.record(5, {env: leaves(5.0 + env / 10) for env in (2, 1, 0)})  # another order
    history.record(6, {env: leaves(6.0 + env / 10) for env in range(3)})
    expected = {0: [0.0, 1.0, 1.0, 3.0, 3.0, 5.0, 6.0], 1: [0.1, 1.1, 1.1, 3.1, 4.1, 5.1, 6.1]}
    for env, per_version in expected.items():
        got = [history.config(env, version)["difficulty"].item() for version in range(7)]
        assert got == pytest.approx(per_version), env
    assert history.versions(2) == [0, 1, 3, 5, 6]


@pytest.mark.parametrize("seed", range(4))
def test_both_ways_of_pruning_keep_the_same_entries(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prune walks records of many rows and sorts records of a few: on the same random
    history (pushes to random envs, some to every env in order, a large shared leaf now and
    then, each env's own applied version) both keep exactly the same versions of every env."""
    import envsync.sender.pruning as module

    kept = []
    for walk in (0, 1 << 30):  # always walk, always sort
        monkeypatch.setattr(module, "WALK", walk)
        rng = np.random.default_rng(seed)  # the same history both times
        history = ConfigHistory(keep=3, keep_bytes=3 << 12)
        big = torch.zeros(1 << 10)  # 4 KB, shared by the records that carry it
        for version in range(60):
            envs = np.arange(8) if version % 7 == 0 else np.sort(rng.choice(8, rng.integers(1, 8), replace=False))
            shared = {"w": big} if version % 5 == 0 else {"w": torch.full((1 << 10,), float(version))}
            history.record_rows(version, envs, shared, {"difficulty": torch.rand(len(envs))})
        applied = rng.integers(20, 60, size=8)
        history.prune(lambda envs, applied=applied: applied[envs])
        kept.append([history.versions(env) for env in range(8)])
    assert kept[0] == kept[1]
    assert any(len(v) < 10 for v in kept[0]), "something was pruned"


@pytest.mark.parametrize("seed", range(24))
def test_a_walk_that_stops_early_keeps_what_the_sort_keeps(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A walk stops once every env is past its entry in effect and ``keep`` older ones (the
    records left are dropped whole): on random histories, often pushed to every env, pruned
    now and then along the way, with ``keep`` from 0 to 4 and a byte budget or none, the walk
    and the sort keep exactly the same versions of every env."""
    import envsync.sender.pruning as module

    kept = []
    for walk in (0, 1 << 30):  # always walk, always sort
        monkeypatch.setattr(module, "WALK", walk)
        rng = np.random.default_rng(seed)
        history = ConfigHistory(keep=int(rng.integers(0, 5)), keep_bytes=int(rng.choice([3 << 12, 1 << 30])))
        count = int(rng.integers(2, 12))
        big = torch.zeros(1 << 10)

        def applied(envs: np.ndarray, versions: np.ndarray) -> np.ndarray:
            # the history asks for every index its columns hold (grown by doubling): none beyond
            return np.concatenate([versions, np.zeros(max(0, len(envs) - len(versions)), dtype=np.int64)])[envs]

        for version in range(int(rng.integers(10, 80))):
            every = rng.random() < 0.4
            envs = np.arange(count) if every else np.sort(rng.choice(count, rng.integers(1, count + 1), replace=False))
            shared = {"w": big} if version % 5 == 0 else {"w": torch.full((1 << 10,), float(version))}
            history.record_rows(version, envs, shared, {"difficulty": torch.rand(len(envs))})
            if rng.random() < 0.1:
                versions = rng.integers(0, version + 1, size=count)
                history.prune(lambda envs, versions=versions: applied(envs, versions))
        versions = rng.integers(0, 80, size=count)
        history.prune(lambda envs, versions=versions: applied(envs, versions))
        kept.append([history.versions(env) for env in range(count)])
    assert kept[0] == kept[1]


@pytest.mark.parametrize("seed", range(12))
def test_records_of_runs_pushed_again_link_each_env_to_its_own_previous_entry(seed: int) -> None:
    """A record of the same run of envs as the record before it is linked to it by two numbers,
    with no pass over the envs: on random histories of pushes to every env, to a run of them
    (often the same run again), to a random set, and now and then a version numbered again,
    every env's versions and its config at every version are those of a plain model of it."""
    rng = np.random.default_rng(seed)
    count = int(rng.integers(3, 10))
    history = ConfigHistory(keep=1 << 20)
    model: dict[int, list[tuple[int, float]]] = {env: [] for env in range(count)}
    version, run = 0, np.arange(count)
    for _ in range(int(rng.integers(20, 60))):
        kind = rng.random()
        if kind < 0.3:
            envs = np.arange(count)
        elif kind < 0.7:  # a run, most often the previous one again
            if rng.random() < 0.4:
                first = int(rng.integers(0, count))
                run = np.arange(first, int(rng.integers(first + 1, count + 1)))
            envs = run
        else:
            envs = np.sort(rng.choice(count, int(rng.integers(1, count + 1)), replace=False))
        version = version + 1 if rng.random() < 0.9 else max(0, version - int(rng.integers(0, 3)))
        values = torch.rand(len(envs))
        history.record_rows(version, envs, {}, {"difficulty": values})
        for env, value in zip(envs.tolist(), values.tolist(), strict=True):
            model[env] = [entry for entry in model[env] if entry[0] < version] + [(version, value)]
    for env, entries in model.items():
        assert history.versions(env) == [v for v, _ in entries], env
        for asked in range(version + 1):
            held = [value for v, value in entries if v <= asked]
            if held:
                assert history.config(env, asked)["difficulty"].item() == pytest.approx(held[-1]), (env, asked)
            else:
                with pytest.raises(ValidationError):
                    history.config(env, asked)


def test_an_env_numbered_again_starts_over() -> None:
    history = ConfigHistory()
    history.record(0, {0: leaves(0.0)})
    history.record(4, {0: leaves(0.4)})
    history.record(4, {0: leaves(0.9)})
    assert history.versions(0) == [0, 4]
    assert history.config(0, 4)["difficulty"].item() == pytest.approx(0.9)


@pytest.fixture(scope="module")
def native() -> Iterator[tuple[EnvStateSender, Collector]]:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = Collector(
        sender.env_fn(lambda: make_native_counters(3)),
        None,
        frames_per_batch=30,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
    )
    yield sender, collector
    collector.shutdown()
    sender.close()


@pytest.mark.timeout(60)
def test_every_frame_of_a_real_collector_names_its_config(native: tuple[EnvStateSender, Collector]) -> None:
    sender, collector = native
    batches = iter(collector)
    sender.push(config=TensorDict(difficulty=torch.tensor([0.1, 0.2, 0.3]), batch_size=[3]))
    sender.push(config={"difficulty": 0.7}, envs=[1])
    seen = set()
    for _ in range(3):
        batch = next(batches).reshape(-1)
        sender.push(config=TensorDict(difficulty=torch.rand(2), batch_size=[2]), envs=[0, 2])
        for env, version, shown in zip(
            batch["next", "env_index"].tolist(),
            batch["next", "env_version"].tolist(),
            batch["next", "observation"][:, 0].tolist(),
            strict=True,
        ):
            assert sender.config_at(env, version)["difficulty"].item() == pytest.approx(shown)
            seen.add((env, version))
    assert len({v for _, v in seen}) >= 3


@pytest.mark.timeout(60)
def test_the_sender_records_the_version_an_env_starts_from() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    sender.push(config={"difficulty": 0.4})
    collector = Collector(
        sender.env_fn(make_drift_env), None, frames_per_batch=4, total_frames=-1, weight_sync_schemes=sender.schemes()
    )
    try:
        batch = next(iter(collector))
        assert batch["next", "env_version"].unique().tolist() == [1]
        assert sender.config_at(0, 1)["difficulty"].item() == pytest.approx(batch["observation"][0, 1].item())
    finally:
        collector.shutdown()
        sender.close()
