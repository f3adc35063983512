"""One owner per env: an apply never overlaps a step or reset of the same env, whatever
thread applies (the collector's own, a worker's loop, a ``ParallelEnv`` sub-process's
loop), so a frame's tag always names the config its observation came from.

The sub-envs' config method changes the difficulty first and then takes 0, 2 or 50 ms: a step
that ran during an apply would show the new difficulty under the old tag.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
from conftest import build
from helpers import make_normed_counter_env, make_slow_batched, rows, start_method
from torchrl.collectors import Collector, MultiAsyncCollector

from envsync import EnvStateSender

pytestmark = pytest.mark.timeout(240)

# name -> (collector class, workers, batched kind, sub-envs per worker)
SETUPS = {
    "single-parallel": (Collector, 1, "parallel", 2),
    "single-serial": (Collector, 1, "serial", 2),
    "async-2x-parallel": (MultiAsyncCollector, 2, "parallel", 2),
}
DELAYS = (0.0, 0.002, 0.05)


@pytest.fixture(scope="module", params=list(SETUPS))
def stepping(request: pytest.FixtureRequest) -> Iterator[tuple[EnvStateSender, Iterator[Any], dict[int, float]]]:
    cls, workers, kind, n = SETUPS[request.param]
    sender = EnvStateSender(config={"difficulty": 0.0, "delay": 0.0}, apply="set_difficulty", apply_at="step")
    factories = [sender.env_fn(functools.partial(make_slow_batched, kind, n, w * n)) for w in range(workers)]
    with start_method("fork"):
        collector = cls(
            factories[0] if cls is Collector else factories,
            None,
            frames_per_batch=40,
            total_frames=-1,
            weight_sync_schemes=sender.schemes(),
        )
    yield sender, iter(collector), {0: 0.0}  # the difficulty of every version pushed
    collector.shutdown()
    sender.close()


def mistagged(batch: Any, difficulty: dict[int, float]) -> int:
    """How many frames show another difficulty than the version their tag names."""
    bad = 0
    for row in rows(batch):
        for tag, obs in (("env_version", "observation"), (("next", "env_version"), ("next", "observation"))):
            for version, value in zip(row[tag].tolist(), row[obs][:, 0].tolist(), strict=True):
                bad += abs(difficulty[version] - value) > 1e-6
    return bad


@pytest.mark.parametrize("delay", DELAYS)
def test_no_frame_is_mistagged_while_pushes_land_mid_rollout(stepping: Any, delay: float) -> None:
    sender, it, difficulty = stepping
    bad = frames = 0
    for _ in range(12):
        value = float(sender.version + 1 + 1000 * delay)
        version = sender.push(config={"difficulty": value, "delay": delay}, wait="received")
        difficulty[version] = value
        batch = next(it)
        frames += batch.numel()
        bad += mistagged(batch, difficulty)
    assert frames and bad == 0, f"{bad} of {2 * frames} tags name another config than the frame's"


@pytest.mark.timeout(90)
def test_idle_applies_never_run_inside_torchrls_own_worker_commands() -> None:
    """``collector.state_dict()`` runs torchrl's command on the worker's env while pushes
    apply idle: the receiver is marked busy for it, so both complete and nothing is lost."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method("fork"):
        collector = build("sync", sender, [partial(make_normed_counter_env, label=i) for i in range(2)])
    try:
        next(iter(collector))
        stop = threading.Event()
        errors: list[BaseException] = []

        def push_forever() -> None:
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    sender.push(config={"difficulty": float(i)}, wait="applied", timeout=20)
                except BaseException as err:  # noqa: BLE001 - reported below
                    errors.append(err)
                    return

        thread = threading.Thread(target=push_forever)
        thread.start()
        for _ in range(20):
            collector.state_dict()
        stop.set()
        thread.join()
        assert errors == []
        assert sender.versions() == [sender.version] * 2
    finally:
        collector.shutdown()
        sender.close()


def test_an_owner_marks_once_per_drive_and_nested_applies_keep_applying_until_the_outermost_ends() -> None:
    from envsync.worker.owner import Owner

    marks: list[bool] = []
    owner = Owner(marks.append)
    with owner.driving(), owner.driving():  # a rollout, and one of torchrl's commands inside it
        assert owner.state == "driven"
    assert marks == [True, False] and owner.state == "idle"
    with owner.lock, owner.applying():  # a row's apply; the level's apply inside the same owner
        with owner.applying():
            assert owner.is_applying
        assert owner.is_applying  # the inner apply's end does not end the outer one
    assert owner.state == "idle"


def test_the_rows_of_a_natively_batched_env_and_its_level_share_the_envs_owner_and_its_fast_path() -> None:
    """A natively batched env is one env object: its rows' receivers, its level's and its group
    go through one owner, whose fast path an idle apply of a row unsettles."""
    from helpers import make_native_counters
    from torchrl.envs import Compose, TransformedEnv

    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = Collector(
        sender.env_fn(lambda: TransformedEnv(make_native_counters(3), Compose())),
        None,
        frames_per_batch=6,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
    )
    try:
        it = iter(collector)
        next(it)
        from envsync.integrations.torchrl.batched import BatchedHooks

        found = BatchedHooks.of(collector.env)
        assert found is not None
        hooks = found[1]
        owner = hooks.owner
        assert hooks.group is not None and hooks.group.owner is owner and hooks.group.level is not None
        assert hooks.rows is not None and hooks.rows.owner is owner and hooks.group.level.owner is owner
        owner.settled = True
        version = sender.push(config={"difficulty": 2.0}, envs=[1], wait="applied")  # applied while idle
        assert not owner.settled  # the next step reads what changed
        batch = next(it)
        assert batch["next", "env_version"][1].eq(version).all()
        assert batch["next", "observation"][1, :, 0].eq(2.0).all()
        assert batch["next", "env_version"][0].eq(0).all()
    finally:
        collector.shutdown()
        sender.close()


def test_a_hooked_env_deep_copies_into_another_env_with_an_owner_of_its_own() -> None:
    """torchrl deep-copies transforms with their parent env (a probe of a batched env's own
    transforms does): the copy's owner is a fresh one, idle, and its steps take its lock."""
    import copy

    from envsync.envs import make_drift_env
    from envsync.integrations.torchrl.adapter import EnvHooks
    from envsync.protocol import ApplyAt
    from envsync.spec import ApplySpec

    env = make_drift_env()
    hooks = EnvHooks.install(env, ApplySpec(None, ApplyAt.RESET), None)
    with hooks.owner.driving():
        twin = copy.deepcopy(env)
    copied = twin.__dict__["_envsync_hooks"]
    assert copied.owner is not hooks.owner and copied.owner.state == "idle"
    assert hooks.owner.state == "idle"
    assert twin.rollout(3).shape == (3,)
