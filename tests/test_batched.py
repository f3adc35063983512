"""Batched envs: every sub-env of a SerialEnv or ParallelEnv (in a Collector, or in each worker
of a Multi* collector) is an env of the fleet, with real workers and real sub-processes.

The sub-envs are CounterEnvs whose observation is ``[difficulty, label, step]``, labelled with
their fleet env index, so every frame shows the config it ran under and the env that made it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import (
    make_batched_counters,
    make_native_counters,
    make_parallel_normed,
    picky_on_worker_one,
    push_to_a_killed_process,
    rows,
    start_method,
)
from tensordict import TensorDict, TensorDictBase
from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector

from envsync import EnvStateSender, ValidationError, WorkerApplyError, reinit

pytestmark = pytest.mark.timeout(180)

# name -> (collector class, workers, batched kind, sub-envs per worker, start method)
SETUPS = {
    "single-parallel": (Collector, 1, "parallel", 3, "fork"),
    "single-serial": (Collector, 1, "serial", 3, "spawn"),
    "single-native": (Collector, 1, "native", 3, "spawn"),
    "sync-serial-fork": (MultiSyncCollector, 2, "serial", 2, "fork"),
    "sync-native-spawn": (MultiSyncCollector, 2, "native", 2, "spawn"),
    "async-parallel-spawn": (MultiAsyncCollector, 2, "parallel", 2, "spawn"),
}
# not stepped by every test: the reset and truncate-mode tests' (spawn is the stepping tests')
EXTRA_SETUPS = {"async-parallel-fork": (MultiAsyncCollector, 2, "parallel", 2, "fork")}


def build(setup: str, sender: EnvStateSender, *, horizon: int = 0, frames: int = 48) -> Any:
    cls, workers, kind, n, method = {**SETUPS, **EXTRA_SETUPS}[setup]
    factories = [
        sender.env_fn(
            functools.partial(make_native_counters, n, w * n, horizon)
            if kind == "native"
            else functools.partial(make_batched_counters, kind, n, w * n, horizon)
        )
        for w in range(workers)
    ]
    with start_method(method):
        return cls(
            factories[0] if cls is Collector else factories,
            None,
            frames_per_batch=frames,
            total_frames=-1,
            weight_sync_schemes=sender.schemes(),
        )


def check_tags(batch: TensorDictBase, difficulty: dict[int, dict[int, float]]) -> None:
    """Every frame shows the difficulty of the version its tags name, for the env it names,
    and ``env_index`` is the label of the sub-env that produced it."""
    for row in rows(batch):
        assert row["env_index"].eq(row["observation"][:, 1].long()).all()
        assert row["next", "env_index"].eq(row["env_index"]).all()
        for tag, obs in (("env_version", "observation"), (("next", "env_version"), ("next", "observation"))):
            for env, version, value in zip(
                row["env_index"].tolist(), row[tag].tolist(), row[obs][:, 0].tolist(), strict=True
            ):
                assert abs(difficulty[env][version] - value) < 1e-5, (tag, env, version, value)


@pytest.fixture(scope="module", params=list(SETUPS))
def stepping(request: pytest.FixtureRequest) -> Iterator[tuple[str, EnvStateSender, Any, Iterator[Any]]]:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = build(request.param, sender)
    yield request.param, sender, collector, iter(collector)
    collector.shutdown()
    sender.close()


def test_fleet_counts_every_sub_env(stepping: Any) -> None:
    setup, sender, _, _ = stepping
    _, workers, _, n, _ = SETUPS[setup]
    assert (sender.num_workers, sender.num_envs) == (workers, workers * n)
    assert [(m.index, m.envs, m.first_env) for m in sender.fleet()] == [(w, n, w * n) for w in range(workers)]


def test_step_mode_gives_each_env_its_row_from_the_next_step(stepping: Any) -> None:
    """After push(wait="applied") with one row per env, every later frame of env i shows row i,
    and every frame's tags (root and next) name the version whose config it shows."""
    setup, sender, _, it = stepping
    # a MultiAsyncCollector may still hand out a batch queued (or begun) before the push
    later = 2 * SETUPS[setup][1] + 1 if SETUPS[setup][0] is MultiAsyncCollector else 2
    difficulty = {e: {0: 0.0} for e in range(sender.num_envs)}
    batch = next(it)
    for env in range(sender.num_envs):  # earlier tests of the module may have pushed
        for version in torch.cat([batch["env_version"].flatten(), batch["next", "env_version"].flatten()]).tolist():
            difficulty[env].setdefault(version, sender.desired_config(env=env)["difficulty"].item())
    for round_ in range(2):
        values = torch.arange(sender.num_envs, dtype=torch.float32) + 10.0 * (round_ + 1)
        version = sender.push(config={"difficulty": values}, wait="applied")
        for env in range(sender.num_envs):
            difficulty[env][version] = float(values[env])
        assert sender.env_versions() == [version] * sender.num_envs
        for _ in range(later):
            batch = next(it)
            check_tags(batch, difficulty)
        # collected after the push was applied: the new rows throughout
        assert batch["next", "env_version"].eq(version).all()
        for row in rows(batch):
            env = int(row["env_index"][0])
            assert row["next", "observation"][:, 0].eq(values[env]).all()


def test_envs_subset_leaves_the_others_untouched(stepping: Any) -> None:
    setup, sender, _, it = stepping
    later = 2 * SETUPS[setup][1] + 1 if SETUPS[setup][0] is MultiAsyncCollector else 2
    before = {e: sender.desired_config(env=e)["difficulty"].item() for e in range(sender.num_envs)}
    old = sender.env_versions()
    version = sender.push(config={"difficulty": 77.0}, envs=torch.tensor([1]), wait="applied")  # ids as a tensor
    assert sender.env_versions() == [version if e == 1 else old[e] for e in range(sender.num_envs)]
    for _ in range(later):
        batch = next(it)
    for row in rows(batch):
        env = int(row["env_index"][0])
        expected = 77.0 if env == 1 else before[env]
        assert row["next", "observation"][:, 0].eq(expected).all(), (env, expected)


def test_bad_addressing_is_refused_in_main(stepping: Any) -> None:
    _, sender, _, _ = stepping
    version = sender.version
    with pytest.raises(ValidationError, match="one row per targeted env"):
        sender.push(config=TensorDict(difficulty=torch.zeros(7), batch_size=[7]))
    with pytest.raises(ValidationError, match="env 99 does not exist"):
        sender.push(config={"difficulty": 1.0}, envs=[99])
    with pytest.raises(ValidationError, match="env -1 does not exist"):
        sender.push(config={"difficulty": 1.0}, envs=torch.tensor([0, -1]))
    with pytest.raises(ValidationError, match=r"env 0\.5 does not exist"):
        sender.push(config={"difficulty": 1.0}, envs=torch.tensor([0.5]))
    with pytest.raises(ValidationError, match="not both"):
        sender.push(config={"difficulty": 1.0}, envs=[0], workers=[0])
    with pytest.raises(ValidationError, match="names no entry"):
        sender.gather(["transforms"])
    assert sender.version == version


def test_workers_target_every_env_of_a_worker(stepping: Any) -> None:
    setup, sender, _, _ = stepping
    n = SETUPS[setup][3]
    old = sender.env_versions()
    version = sender.push(config={"difficulty": 5.0}, workers=[0], wait="applied")
    assert sender.env_versions() == [version] * n + old[n:]
    assert sender.versions()[0] == version


# ---- reset mode: each sub-env at its own reset --------------------------------------------


@pytest.mark.parametrize("setup", ["single-serial", "single-native", "sync-serial-fork", "async-parallel-fork"])
def test_reset_mode_switches_each_sub_env_at_its_own_reset(setup: str) -> None:
    """Sub-env i has episodes of 6 + 2i steps: each switches exactly at its own next reset,
    no trajectory holds two versions, and none waits for another's reset."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="reset")
    collector = build(setup, sender, horizon=6, frames=60 if setup == "single-serial" else 48)
    try:
        it = iter(collector)
        next(it)
        version = sender.push(config={"difficulty": 3.0}, wait="received")
        difficulty = {e: {0: 0.0, version: 3.0} for e in range(sender.num_envs)}
        deadline = time.monotonic() + 60
        seen: dict[int, list[TensorDictBase]] = {}
        while time.monotonic() < deadline and not all(
            any(r["next", "env_version"].eq(version).all() for r in seen.get(e, [])) for e in range(sender.num_envs)
        ):
            batch = next(it)
            check_tags(batch, difficulty)
            for row in rows(batch):
                seen.setdefault(int(row["env_index"][0]), []).append(row)
        switch_frames = set()
        for env, env_rows in seen.items():
            stream = torch.cat(env_rows, 0)
            tags = stream["next", "env_version"]
            steps = stream["observation"][:, 2]  # the step count of the root observation
            assert tags.eq(version).any(), f"env {env} never switched"
            for t in torch.nonzero(tags.diff() != 0).flatten().tolist():
                # the first frame of the new version starts an episode (root step 0)
                assert steps[t + 1] == 0, (env, t)
                switch_frames.add((env, int(stream["next", "observation"][t, 2])))
            traj = stream["collector", "traj_ids"]
            for trajectory in traj.unique().tolist():
                assert tags[traj == trajectory].unique().numel() == 1, (env, trajectory)
        # different horizons: the sub-envs did not all switch at once (none waited)
        assert len({length for _, length in switch_frames}) > 1
    finally:
        collector.shutdown()
        sender.close()


# ---- truncate mode: every targeted sub-env's episode ends as truncated ----------------------


def test_truncate_mode_ends_each_targeted_episode_as_truncated() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="truncate")
    collector = build("async-parallel-fork", sender, frames=32)
    stop = threading.Event()
    try:
        it = iter(collector)
        next(it)
        versions = []

        def pusher() -> None:
            for i in range(4):
                if stop.is_set():
                    return
                versions.append(sender.push(config={"difficulty": float(i + 1)}, envs=[0, 3], wait="applied"))
                time.sleep(0.05)

        thread = threading.Thread(target=pusher)
        thread.start()
        changes = 0
        while thread.is_alive() or changes == 0:
            batch = next(it)
            for row in rows(batch):
                tags = row["next", "env_version"]
                for t in torch.nonzero(tags.diff() != 0).flatten().tolist():
                    changes += 1
                    assert int(row["env_index"][0]) in (0, 3)
                    assert bool(row["next", "truncated"][t].all()), "the old version's last frame is truncated"
                    assert int(row["observation"][t + 1, 2]) == 0, "the new version starts a fresh episode"
        thread.join()
        assert sender.env_versions()[1] == 0 and sender.env_versions()[2] == 0
    finally:
        stop.set()
        collector.shutdown()
        sender.close()


# ---- failures --------------------------------------------------------------------------------


def test_one_sub_env_failing_rolls_back_every_targeted_env() -> None:
    """Sub-env 1 refuses a negative difficulty: the push raises WorkerApplyError naming fleet
    env 1, and every env runs the previous config again."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply=picky_on_worker_one, apply_at="step")
    collector = build("single-parallel", sender)
    try:
        it = iter(collector)
        next(it)
        good = sender.push(config={"difficulty": 2.0}, wait="applied")
        with pytest.raises(WorkerApplyError) as info:
            sender.push(config={"difficulty": -1.0}, wait="applied")
        assert info.value.env == 1 and info.value.worker == 0
        assert "worker one refuses" in info.value.remote_traceback
        assert info.value.rollback is not None
        sender.wait(info.value.rollback, until="applied")
        next(it)
        batch = next(it)
        assert batch["next", "observation"][..., 0].eq(2.0).all()
        assert batch["next", "env_version"].ne(good + 1).all()
    finally:
        collector.shutdown()
        sender.close()


def test_a_started_batched_env_is_refused_with_the_reason() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    started = make_batched_counters("serial", 2)
    started.reset()
    try:
        with pytest.raises(ValidationError, match="started before envsync saw it"):
            sender.env_fn(started)
    finally:
        started.close()
        sender.close()


def test_a_native_env_without_env_ids_changes_all_rows_and_refuses_per_env_reset() -> None:
    """An apply method without env_ids is called with the whole batch: it works in "step"
    mode, and per-env "reset" mode is refused at attach with the reason."""
    refused = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty_all", apply_at="reset")
    with pytest.raises(ValidationError, match="takes no env_ids keyword"):
        refused.env_fn(make_native_counters(3))
    refused.close()
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty_all", apply_at="step")
    collector = Collector(
        sender.env_fn(make_native_counters(3)),
        None,
        frames_per_batch=30,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
    )
    try:
        it = iter(collector)
        next(it)
        values = torch.tensor([4.0, 5.0, 6.0])
        version = sender.push(config={"difficulty": values}, wait="applied")
        next(it)
        batch = next(it)
        assert batch["next", "env_version"].eq(version).all()
        assert batch["next", "observation"][..., 0].eq(values.unsqueeze(-1)).all()
        version = sender.push(config={"difficulty": 9.0}, envs=[2], wait="applied")
        next(it)
        batch = next(it)
        assert batch["next", "observation"][..., 0].eq(torch.tensor([[4.0], [5.0], [9.0]])).all()
        with pytest.raises(ValidationError, match=r"not in the env.s state_dict; known: \[\]"):
            sender.push(env_state={"transforms.0.loc": torch.zeros(3)})
    finally:
        collector.shutdown()
        sender.close()


def test_an_idle_truncate_resets_only_the_targeted_sub_envs() -> None:
    """With the collector idle, a "truncate" push resets exactly the targeted sub-envs (a
    partial reset through the collector): their next frames start fresh episodes under the
    new version; the others run on, undisturbed."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="truncate")
    collector = build("single-parallel", sender, frames=30)
    try:
        it = iter(collector)
        before = next(it)
        version = sender.push(config={"difficulty": 8.0}, envs=[0, 2], wait="applied")
        after = next(it)
        check_tags(after, {0: {0: 0.0, version: 8.0}, 1: {0: 0.0}, 2: {0: 0.0, version: 8.0}})
        for env in (0, 2):
            assert after["env_version"][env].eq(version).all()
            assert int(after["observation"][env, 0, 2]) == 0, "a fresh episode"
        last_step = int(before["next", "observation"][1, -1, 2])
        assert int(after["observation"][1, 0, 2]) == last_step, "sub-env 1's episode goes on"
        assert after["env_version"][1].eq(0).all()
    finally:
        collector.shutdown()
        sender.close()


def test_reinit_recomputes_each_sub_envs_statistics_in_its_own_process() -> None:
    """An ObservationNorm inside each sub-env of a ParallelEnv is recomputed in that sub-env,
    under its new config: afterwards each sub-env's constant dims (its difficulty and its own
    label) normalise to 0; a shared or unrecomputed statistic would leave them at 5 and 1."""
    sender = EnvStateSender(
        config={"difficulty": 0.0},
        apply="set_difficulty",
        apply_at="step",
        reinit={"ObservationNorm": reinit.recompute(num_iter=8)},
    )
    with start_method("fork"):
        collector = Collector(
            sender.env_fn(make_parallel_normed),
            None,
            frames_per_batch=20,
            total_frames=-1,
            weight_sync_schemes=sender.schemes(),
        )
    try:
        it = iter(collector)
        before = next(it)
        assert before["next", "observation"][1, :, 1].eq(1.0).all()  # label 1, loc 0, scale 1
        version = sender.push(config={"difficulty": 5.0}, wait="applied")
        after = next(it)
        assert after["next", "env_version"].eq(version).all()
        assert after["next", "observation"][..., :2].abs().max() < 1e-3
    finally:
        collector.shutdown()
        sender.close()


def test_a_dead_parallel_env_sub_process_is_reported_dead_promptly() -> None:
    """A sub-env's process dies (SIGKILL): a push waiting for it raises AckTimeout at once,
    naming its worker as dead and the env as late, not after the full timeout."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = build("single-parallel", sender, frames=30)
    try:
        next(iter(collector))
        timeout, took = push_to_a_killed_process(sender, collector.env._workers[1], timeout=20.0)
        assert took < 5.0
        assert timeout.dead == [0] and 1 in timeout.envs
    finally:
        with contextlib.suppress(Exception):  # the ParallelEnv lost a sub-process: its shutdown may complain
            collector.shutdown()
        sender.close()
