""" "Applied" covers the batched level: a batched env's own transforms (a ``TransformedEnv``
around a ``SerialEnv``/``ParallelEnv``, or a natively batched env's) hold a version before
``wait="applied"`` returns, and a failure there is raised by that push, rolled back at every
level, and never tags a frame.

Each worker's batched env carries a ``Flaky`` transform (tests/helpers.py) whose ``recount``
runs as the batched level's ``reinit`` policy: it appends a line to a log file per worker (so
the test sees from outside when the batched level applied) and fails once while a flag file
exists.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import make_flaky_batched, rows, start_method
from torchrl.collectors import Collector, MultiSyncCollector

from envsync import EnvStateSender, WorkerApplyError, reinit

pytestmark = pytest.mark.timeout(240)

N = 2  # envs per worker

# name -> (collector class, workers, batched kind)
SETUPS = {
    "collector-parallel": (Collector, 1, "parallel"),
    "collector-serial": (Collector, 1, "serial"),
    "sync-serial": (MultiSyncCollector, 2, "serial"),
    "collector-native": (Collector, 1, "native"),
}


@pytest.fixture(scope="module", params=list(SETUPS))
def fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    cls, workers, kind = SETUPS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    sender = EnvStateSender(
        config={"difficulty": 0.0},
        apply="set_difficulty",
        apply_at="step",
        reinit={"batched.Flaky": reinit.call("recount")},
    )
    factories = [
        sender.env_fn(functools.partial(make_flaky_batched, kind, N, w * N, str(folder))) for w in range(workers)
    ]
    with start_method("fork"):
        collector = cls(
            factories[0] if cls is Collector else factories,
            None,
            frames_per_batch=10 * N * workers,
            total_frames=-1,
            weight_sync_schemes=sender.schemes(),
        )
    it = iter(collector)
    next(it)
    yield sender, it, folder, workers
    collector.shutdown()
    sender.close()


def runs(folder: Path, worker: int) -> int:
    """How often worker ``worker``'s batched level ran its ``reinit`` policy successfully."""
    log = folder / f"log-{worker * N}"
    return len(log.read_text().splitlines()) if log.exists() else 0


def check_frames(batch: Any, version: int, difficulty: float) -> None:
    """Every step ran ``version`` and shows its difficulty (a root observation may come from
    the step before the push: ``"step"`` mode goes on with the episode)."""
    for row in rows(batch):
        assert row["next", "env_version"].eq(version).all(), row["next", "env_version"].tolist()
        seen = row["next", "observation"][..., 0]
        assert (seen - difficulty).abs().max() < 1e-6, seen.tolist()


def test_applied_returns_only_once_the_batched_level_applied(fleet: Any) -> None:
    sender, it, folder, workers = fleet
    before = [runs(folder, w) for w in range(workers)]
    version = sender.push(config={"difficulty": 1.0}, wait="applied")
    # read at once, with the collector idle: nothing else could run the level's policy now
    assert [runs(folder, w) for w in range(workers)] == [b + 1 for b in before]
    check_frames(next(it), version, 1.0)


def test_a_failure_of_the_batched_level_is_raised_by_its_push_and_rolled_back_everywhere(fleet: Any) -> None:
    sender, it, folder, workers = fleet
    previous = sender.push(config={"difficulty": 1.5}, wait="applied")
    (folder / "flag-0").touch()  # worker 0's batched level fails once
    with pytest.raises(WorkerApplyError) as raised:
        sender.push(config={"difficulty": 2.0}, wait="applied")
    err = raised.value
    assert err.worker == 0 and err.version == previous + 1
    assert "flaky batched level refuses" in err.remote_traceback
    assert "batched env's own transforms" in err.remote_traceback
    assert err.rollback == previous + 2
    assert not (folder / "flag-0").exists()
    # every level runs the previous version again: frames, tags and config_at agree
    for env in range(sender.num_envs or 0):
        assert float(sender.config_at(env, err.rollback)["difficulty"]) == 1.5
    assert sender.env_versions() == [err.rollback] * (sender.num_envs or 0)
    for _ in range(2):
        check_frames(next(it), err.rollback, 1.5)
    # and the next push applies at every level
    before = [runs(folder, w) for w in range(workers)]
    version = sender.push(config={"difficulty": 3.0}, wait="applied")
    assert [runs(folder, w) for w in range(workers)] == [b + 1 for b in before]
    check_frames(next(it), version, 3.0)


@pytest.mark.parametrize("kind", ["serial", "parallel", "native"])
@pytest.mark.parametrize("level_reinit", [False, True], ids=["no-level-reinit", "level-reinit"])
def test_an_env_that_applied_at_its_own_reset_is_applied_while_a_sibling_waits_for_its_reset(
    kind: str, level_reinit: bool, tmp_path: Path
) -> None:
    """Reset mode, one push to both envs of a batched env under a batched level: env 0 resets
    (and applies), env 1 does not yet. Where the version carries nothing for the batched
    level and the level has no ``reinit``, the level holds it already: env 0 is *applied* at
    once. With a batched-level ``reinit``, the level must run it for the version, which it
    does once every env holds it: env 0 waits for env 1's reset."""
    sender = EnvStateSender(
        config={"difficulty": 0.0},
        apply="set_difficulty",
        apply_at="reset",
        reinit={"batched.Flaky": reinit.call("recount")} if level_reinit else None,
    )
    with start_method("fork"):
        collector = Collector(
            sender.env_fn(functools.partial(make_flaky_batched, kind, N, 0, str(tmp_path))),
            None,
            frames_per_batch=4 * N,
            total_frames=-1,
            weight_sync_schemes=sender.schemes(),
        )
    try:
        next(iter(collector))
        version = sender.push(config={"difficulty": 4.0}, wait="received")
        collector.reset(index=[0])
        deadline = time.monotonic() + 3.0  # the worker loop acknowledges within half a second
        while sender.env_versions()[0] != version and time.monotonic() < deadline:
            time.sleep(0.05)
        if level_reinit:
            assert sender.env_versions() == [0, 0]
            assert runs(tmp_path, 0) == 0
            collector.reset(index=[1])
            sender.wait(version, until="applied", timeout=5.0)
            assert runs(tmp_path, 0) == 1
        else:
            assert sender.env_versions() == [version, 0]
        collector.reset()
        sender.wait(version, until="applied", timeout=5.0)
        assert sender.env_versions() == [version, version]
    finally:
        collector.shutdown()
        sender.close()
