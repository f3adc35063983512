"""A natively batched env (``batch_size=[n]``, one env object holding n worlds): "applied"
means the simulator holds the rows (``../shared/API.md``).

The env's apply is a built-in one (``envsync.apply.attributes()``), which writes every row a
safe point changes at once, at the safe point's end, then runs its ``finish``. A slow finish
that saves the env's array when it returns shows whether ``wait="applied"`` returned before
the write and its finish did.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import NativeCounterEnv, make_native_counters, start_method, unconfirmed_rollback
from tensordict import TensorDict
from torchrl.collectors import Collector, MultiSyncCollector

import envsync
from envsync import EnvStateSender, WorkerApplyError
from envsync.links.shared_memory import PREFIX, SHM_DIR

N = 6
ROUNDS = 12


class SlowSave:
    """A ``finish=`` that takes a while, then saves the env's difficulty rows to ``path``
    (what the simulator holds once the write and its finish returned)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, env: Any) -> None:
        time.sleep(0.03)
        np.save(self.path, env.difficulty.numpy())


def build(kind: str, sender: EnvStateSender) -> Any:
    factory = sender.env_fn(functools.partial(make_native_counters, N))
    if kind == "collector":
        return Collector(factory, None, frames_per_batch=4 * N, total_frames=-1, weight_sync_schemes=sender.schemes())
    with start_method("fork"):
        return MultiSyncCollector(
            [factory], None, frames_per_batch=4 * N, total_frames=-1, weight_sync_schemes=sender.schemes()
        )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["collector", "multisync"])
def test_applied_returns_once_the_write_and_its_finish_returned_for_every_row(kind: str, tmp_path: Path) -> None:
    saved = tmp_path / "difficulty.npy"
    apply = envsync.apply.attributes(finish=SlowSave(saved))
    sender = EnvStateSender(config={"difficulty": 0.0}, apply=apply, apply_at="step")
    collector = build(kind, sender)
    try:
        next(iter(collector))  # then idle: the worker loop applies
        for round_ in range(ROUNDS):
            rows = torch.arange(N, dtype=torch.float32) + 10.0 * (round_ + 1)
            sender.push(config=TensorDict(difficulty=rows, batch_size=[N]), wait="applied")
            held = np.load(saved)  # what the finish saw when it returned
            assert held.tolist() == pytest.approx(rows.tolist()), round_
            if kind == "collector":  # the env is in this process: read the simulator itself
                assert collector.env.difficulty.tolist() == pytest.approx(rows.tolist()), round_
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(120)
def test_a_write_the_user_makes_after_applied_is_never_overwritten() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply=envsync.apply.attributes(), apply_at="step")
    collector = build("collector", sender)
    try:
        next(iter(collector))
        for round_ in range(ROUNDS):
            rows = torch.full((N,), float(round_ + 1))
            sender.push(config=TensorDict(difficulty=rows, batch_size=[N]), wait="applied")
            collector.env.difficulty[:] = -1.0  # the user's own write, after the wait
            time.sleep(0.05)
            assert collector.env.difficulty.tolist() == [-1.0] * N, round_
    finally:
        collector.shutdown()
        sender.close()


def _semaphores() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("sem.")}


def _two_workers(sender: EnvStateSender, rows: int, *, frames: int) -> MultiSyncCollector:
    """A forked ``MultiSyncCollector`` of 2 workers, each a natively batched env of ``rows``
    counters (labelled from ``w * rows``), ``frames`` frames a batch."""
    factories = [sender.env_fn(functools.partial(make_native_counters, rows, w * rows)) for w in range(2)]
    with start_method("fork"):
        return MultiSyncCollector(
            factories, None, frames_per_batch=frames, total_frames=-1, weight_sync_schemes=sender.schemes()
        )


ROWS = 2048
"""Worlds per worker of the tests of thousands of worlds."""

Worlds = tuple[EnvStateSender, MultiSyncCollector, Iterator[Any]]


@pytest.fixture
def step_worlds() -> Iterator[Worlds]:
    """2 x 2,048 worlds in step mode (:func:`_two_workers`, a world a frame), after their first
    batch: the sender, the collector and its batches."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = _two_workers(sender, ROWS, frames=2 * ROWS)
    try:
        iterator = iter(collector)
        next(iterator)
        yield sender, collector, iterator
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(180)
def test_thousands_of_worlds_per_worker_share_one_lock_and_wake_up_per_worker() -> None:
    """A ``MultiSyncCollector`` of 2 workers x 2,048 worlds: the link makes a handful of named
    semaphores, not three per world (each is a mapping in every process that opens it, and a
    process may hold 65,530: 2 x 32,768 worlds failed to attach with three a world); every
    world then takes its own row of a push, and its frames say so."""
    rows = 2048
    before = _semaphores()
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = _two_workers(sender, rows, frames=4 * rows)
    try:
        made = _semaphores() - before
        assert len(made) <= 10, len(made)  # per worker: a lock, a wake-up, a relay; two for acknowledgements
        iterator = iter(collector)
        next(iterator)
        values = torch.arange(2 * rows, dtype=torch.float32)
        version = sender.push(config=TensorDict(difficulty=values, batch_size=[2 * rows]), wait="applied")
        batch = next(iterator)
        tagged = batch["next", "env_version"] == version
        assert tagged.any(-1).all()  # every world ran the version within the batch
        observed = batch["next", "observation"][..., 0]
        index = batch["env_index"]
        assert torch.equal(observed[tagged], values[index[tagged]])
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(180)
def test_a_wait_the_worlds_answer_late_reads_columns_not_worlds() -> None:
    """4,096 worlds owe a version they apply only at their next reset (an idle collector: the
    reset-mode trap): the wait blocks until its timeout reading each link's counters as
    columns, and its liveness checks ask once per worker process, never world by world (it
    once walked every world each 50 ms slice: a core busy at 4,096 worlds, past its timeout
    at 65,536)."""
    rows = 2048
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="reset")
    collector = _two_workers(sender, rows, frames=2 * rows)
    try:
        next(iter(collector))
        link = sender.port.links()[0]
        calls = {"status": 0, "alive": 0}

        def counted(name: str) -> Any:
            method = getattr(link, name)

            def call(*args: Any, **kwargs: Any) -> Any:
                calls[name] += 1
                return method(*args, **kwargs)

            return call

        link.status, link.alive = counted("status"), counted("alive")  # type: ignore[method-assign]
        values = torch.arange(2 * rows, dtype=torch.float32)
        with pytest.raises(envsync.AckTimeout) as raised:
            sender.push(config=TensorDict(difficulty=values, batch_size=[2 * rows]), wait="applied", timeout=1.0)
        assert raised.value.workers == [0, 1] and raised.value.dead == []
        assert "apply_at='reset'" in str(raised.value)  # every late world received it: the trap, named
        assert calls["status"] == 0
        assert 0 < calls["alive"] <= 2 * 25, calls  # two worker processes, once each a slice (50 ms)
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(180)
def test_a_checkpoint_of_thousands_of_worlds_reads_each_collectors_columns(
    monkeypatch: pytest.MonkeyPatch, step_worlds: Worlds
) -> None:
    """``state_dict()`` of 2 x 2,048 worlds, each with its own pushed row: every world's
    config comes back in fleet order, read as columns from each collector's desired state
    (one row looked at per collector, to see that none has env state of its own), and a new
    sender loads it before its collector is built, as columns, whose worlds then each start
    from their row (a checkpoint of 65,536 worlds took 111 s when it made a row per world
    and found each world's worker by listing its envs; loading it, 1.8 s, and 0.35 s more at
    attach, when it made a row per world; saved again before its collector attached, 0.48 s
    at 16,384 worlds, a dict per world, now 0.1 ms)."""
    from envsync.sender.desired import Update
    from envsync.sender.mirror import Mirror

    sender, collector, _ = step_worlds
    values = torch.rand(2 * ROWS)
    sender.push(config=TensorDict(difficulty=values, batch_size=[2 * ROWS]), wait="applied")
    looked = []
    row = Mirror.row
    monkeypatch.setattr(Mirror, "row", lambda self, slot: looked.append(slot) or row(self, slot))
    state = sender.state_dict()
    assert len(looked) <= 2, len(looked)  # one per collector
    assert state["config"].batch_size == (2 * ROWS,) and torch.equal(state["config"]["difficulty"], values)
    assert "env_state_rows" not in state
    collector.shutdown()
    sender.close()
    # loaded before its collector is built (a new process resuming): kept as columns, each
    # world starts from its row (a row per world was made at load and stacked again at attach)
    from envsync.sender import desired

    made: list[int] = []
    leaves = desired.leaves
    monkeypatch.setattr(desired, "leaves", lambda *args: made.append(1) or leaves(*args))
    restored = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    try:
        restored.load_state_dict(state)
        per_env: list[int] = []
        row_of = Update.row
        monkeypatch.setattr(Update, "row", lambda self, position: per_env.append(1) or row_of(self, position))
        again = restored.state_dict()  # saved again before its collector attached: kept for the next one
        assert torch.equal(again["config"]["difficulty"], values) and again["config"].batch_size == (2 * ROWS,)
        assert len(per_env) < 16, len(per_env)  # as columns, not a row per world
        resumed = _two_workers(restored, ROWS, frames=2 * ROWS)
        try:
            batch = next(iter(resumed))
            observed, index = batch["next", "observation"][..., 0], batch["env_index"]
            assert torch.equal(observed, values[index])
        finally:
            resumed.shutdown()
        assert len(made) < 16, len(made)
    finally:
        restored.close()


@pytest.mark.timeout(180)
def test_a_checkpoint_of_thousands_of_worlds_loads_into_running_worlds_as_columns(
    monkeypatch: pytest.MonkeyPatch, step_worlds: Worlds
) -> None:
    """``load_state_dict`` of a checkpoint of 2 x 2,048 worlds into the running collector:
    every world gets its own row back, checked and pushed as columns in one version (it
    fitted and pushed a config per world: 1 s at 16,384 worlds, now 14 ms); a bad row is
    refused before anything is pushed."""
    from envsync import ValidationError
    from envsync.state import ConfigTemplate

    sender, _, iterator = step_worlds
    values = torch.rand(2 * ROWS)
    sender.push(config=TensorDict(difficulty=values, batch_size=[2 * ROWS]), wait="applied")
    state = sender.state_dict()
    sender.push(config={"difficulty": 5.0}, wait="applied")
    fits: list[int] = []
    fit = ConfigTemplate.fit

    def counted(self: ConfigTemplate, values: Any) -> Any:
        fits.append(1)
        return fit(self, values)

    monkeypatch.setattr(ConfigTemplate, "fit", counted)
    before = sender.version
    bad = dict(state, config=TensorDict(difficulty=torch.rand(2 * ROWS, 3), batch_size=[2 * ROWS]))
    with pytest.raises(ValidationError, match="difficulty"):
        sender.load_state_dict(bad)
    assert sender.version == before  # nothing pushed
    fits.clear()
    version = sender.load_state_dict(state)
    assert version == before + 1 and len(fits) <= 1  # one push of columns (the first row fitted alone: the default)
    sender.wait(version, until="applied", timeout=60)
    batch = next(iterator)
    observed, index = batch["next", "observation"][..., 0], batch["env_index"]
    assert torch.equal(observed, values[index])


@pytest.mark.timeout(180)
def test_push_each_gives_every_world_of_a_worker_its_config_with_one_update_per_worker(
    monkeypatch: pytest.MonkeyPatch, step_worlds: Worlds
) -> None:
    """``push_each`` to 2 workers of 2,048 worlds each: every world runs its worker's config
    from the next step, and the push made one set of leaves per worker (it made one per
    world: 310 ms for a worker of 65,536 worlds)."""
    from envsync.sender import desired

    sender, _, iterator = step_worlds
    made = []
    leaves = desired.leaves
    monkeypatch.setattr(desired, "leaves", lambda *args: made.append(1) or leaves(*args))
    version = sender.push_each({0: {"difficulty": 2.0}, 1: {"difficulty": 3.0}}, wait="applied")
    assert len(made) == 2
    batch = next(iterator)
    assert (batch["next", "env_version"] == version).all()
    expected = torch.where(batch["env_index"] < ROWS, 2.0, 3.0)
    assert torch.equal(batch["next", "observation"][..., 0], expected)


class CountingCounters(NativeCounterEnv):
    """A natively batched env that counts the calls of its config method and the rows each
    got, and refuses a negative difficulty after writing the rows it got (a half-done apply)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.calls: list[list[int]] = []

    def set_difficulty(self, difficulty: torch.Tensor, env_ids: torch.Tensor) -> None:
        self.calls.append(env_ids.tolist())
        self.difficulty[env_ids] = difficulty.to(torch.float32)
        if bool((difficulty < 0).any()):
            raise ValueError("a negative difficulty")


@pytest.mark.timeout(120)
def test_every_row_a_safe_point_changes_is_given_its_config_in_one_call() -> None:
    n = 512
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = Collector(
        sender.env_fn(lambda: CountingCounters(n)),
        None,
        frames_per_batch=2 * n,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
    )
    try:
        next(iter(collector))
        env = collector.env
        env.calls.clear()
        chosen = list(range(0, n, 3))
        values = torch.arange(len(chosen), dtype=torch.float32)
        sender.push(config=TensorDict(difficulty=values, batch_size=[len(chosen)]), envs=chosen, wait="applied")
        assert env.calls == [chosen]  # one call, every changed row, none other
        assert env.difficulty[chosen].tolist() == values.tolist()
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(120)
def test_a_call_that_fails_gives_every_row_of_it_its_previous_config_back_and_the_push_raises() -> None:
    n = 64
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = Collector(
        sender.env_fn(lambda: CountingCounters(n)),
        None,
        frames_per_batch=2 * n,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
    )
    try:
        iterator = iter(collector)
        next(iterator)
        env = collector.env
        good = torch.full((n,), 2.0)
        v1 = sender.push(config=TensorDict(difficulty=good, batch_size=[n]), wait="applied")
        bad = good.clone() + 1.0
        bad[7] = -1.0  # one row fails the whole call
        with pytest.raises(WorkerApplyError) as raised:
            sender.push(config=TensorDict(difficulty=bad, batch_size=[n]), wait="applied")
        assert "a negative difficulty" in raised.value.remote_traceback
        assert env.difficulty.tolist() == good.tolist()  # every row of the call is back on its previous config
        assert set(sender.env_versions()) == {raised.value.version + 1}  # the rollback, holding v1's config
        batch = next(iterator)
        assert batch["next", "observation"][..., 0].eq(2.0).all()
        assert sender.config_at(0, v1)["difficulty"].item() == 2.0
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(120)
def test_a_failing_push_fails_only_its_own_rows_when_another_pushs_rows_reset_with_them() -> None:
    """Two pushes pending in ``"reset"`` mode on disjoint rows, the second marked to fail, and
    one reset of every row: the first call (both versions' rows) fails; each version is then
    applied alone, so the good push holds its rows and only the bad one fails and rolls back
    (found by the model-based test's 1,024-row cells: a failing push failed the version that
    reset beside it)."""
    n = 8
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="reset")
    collector = Collector(
        sender.env_fn(lambda: CountingCounters(n)),
        None,
        frames_per_batch=n,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
    )
    try:
        next(iter(collector))
        env = collector.env
        good = sender.push(config=TensorDict(difficulty=torch.full((4,), 5.0), batch_size=[4]), envs=[0, 1, 2, 3])
        bad_rows = torch.full((4,), 6.0)
        bad_rows[1] = -1.0
        bad = sender.push(config=TensorDict(difficulty=bad_rows, batch_size=[4]), envs=[4, 5, 6, 7])
        env.calls.clear()
        collector.reset()  # every row resets at once: both versions' rows in one safe point
        with pytest.raises(WorkerApplyError) as raised:
            sender.wait(bad, until="applied", timeout=30)
        assert raised.value.version == bad
        # the rollback is armed for each row's next reset, which an idle collector never
        # reaches: it is confirmed as received (it waited 5 s for "applied", then said so)
        assert not unconfirmed_rollback(raised.value)
        sender.wait(raised.value.rollback, until="received", timeout=1)
        every, first, second = list(range(8)), [0, 1, 2, 3], [4, 5, 6, 7]
        # together (and restored), then each version alone: the good one holds, the bad one restored
        assert env.calls == [every, every, first, second, second]
        assert env.difficulty[:4].tolist() == [5.0] * 4  # the good push holds its rows
        assert env.difficulty[4:].tolist() == [0.0] * 4  # the bad one's rows are back on their config
        assert sender.env_versions()[:4] == [good] * 4
    finally:
        collector.shutdown()
        sender.close()


def _shm_bytes() -> int:
    """The bytes envsync's files in /dev/shm hold (allocated pages, not their sizes)."""
    return sum(path.stat().st_blocks * 512 for path in Path(SHM_DIR).glob(f"{PREFIX}*"))


def _native_under_a_tripwire(n: int) -> Any:
    """A natively batched env of ``n`` worlds under a batched level: the model test's
    tripwire (its ``check``, the level's re-init policy, raises while ``armed``)."""
    from model_envs import _tripwire
    from torchrl.envs import TransformedEnv

    return TransformedEnv(make_native_counters(n), _tripwire())


@pytest.mark.timeout(180)
def test_thousands_of_worlds_under_a_batched_level_are_acknowledged_and_failed_as_columns() -> None:
    """4,096 worlds under their env's own transforms in a spawned-free ``MultiSyncCollector``
    worker: the level acknowledges every world's version in one vector write (the push returns
    "applied" with every world on its row), and when the level fails a version every world
    fails it with one error text, written once (one row's error area, not 4,096), and the push
    rolls back."""
    rows = 4096
    sender = EnvStateSender(
        config={"difficulty": 0.0},
        apply="set_difficulty",
        apply_at="step",
        reinit={"batched.Tripwire": envsync.reinit.call("check")},
    )
    with start_method("fork"):
        collector = MultiSyncCollector(
            [sender.env_fn(functools.partial(_native_under_a_tripwire, rows))],
            None,
            frames_per_batch=2 * rows,
            total_frames=-1,
            weight_sync_schemes=sender.schemes(),
        )
    try:
        iterator = iter(collector)
        next(iterator)
        values = torch.arange(rows, dtype=torch.float32)
        version = sender.push(config=TensorDict(difficulty=values, batch_size=[rows]), wait="applied")
        assert set(sender.env_versions()) == {version}
        batch = next(iterator)
        tagged = batch["next", "env_version"] == version
        assert tagged.all()
        assert torch.equal(batch["next", "observation"][..., 0][tagged], values[batch["env_index"][tagged]])
        before = _shm_bytes()
        with pytest.raises(WorkerApplyError) as raised:
            sender.push(env_state={"batched.armed": torch.ones(())}, wait="applied")
        assert "the tripwire of the batched level is armed" in raised.value.remote_traceback
        # one text for every world: a page or two of the link's file, not a page per world (16 MB)
        assert _shm_bytes() - before < 1 << 20, _shm_bytes() - before
        assert set(sender.env_versions()) == {raised.value.version + 1}  # the rollback, everywhere
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [N, 1024])  # 1,024 rows x 16 frames: tags filled by one torch call
def test_tags_of_a_reused_buffer_are_written_again_after_the_user_changes_them_in_place(n: int) -> None:
    """With ``return_same_td=True`` the batch is the collector's buffer: a rollout whose rows
    kept their versions may leave the tags it holds as they are, but never tags the user
    changed in place."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    factory = sender.env_fn(functools.partial(make_native_counters, n))
    collector = Collector(
        factory,
        None,
        frames_per_batch=16 * n,
        total_frames=-1,
        return_same_td=True,
        weight_sync_schemes=sender.schemes(),
    )
    try:
        batches = iter(collector)
        next(batches)
        odd = torch.arange(1, n, 2)
        sender.push(config=TensorDict(difficulty=torch.ones(len(odd)), batch_size=[len(odd)]), envs=odd, wait="applied")
        expected = torch.zeros(n, dtype=torch.int64)
        expected[odd] = 1  # rows at different versions: filled from a column
        next(batches)  # its first root observations came from before the push
        for round_ in range(4):
            batch = next(batches)
            for key in ("env_version", ("next", "env_version")):
                tags = batch.get(key)
                assert (tags == expected.unsqueeze(-1)).all(), (round_, key)
                observed = batch.get(("next", "observation"))[..., 0]  # each row's difficulty
                assert (observed == expected.unsqueeze(-1).float()).all(), round_
                tags.fill_(-1) if round_ % 2 else tags.zero_()  # the user's own in-place change
        sender.push(config={"difficulty": 2.0}, wait="applied")  # every row at one version: a memset
        next(batches)
        for round_ in range(3):
            batch = next(batches)
            version = sender.versions()[0]
            for key in ("env_version", ("next", "env_version")):
                assert (batch.get(key) == version).all(), (round_, key)
                batch.get(key).add_(5)
    finally:
        collector.shutdown()
        sender.close()
