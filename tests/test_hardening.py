"""One test per defect found in review (issue 12), each with real collectors where a worker
is involved: every one of them failed on the code before the attachment redesign."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref
from functools import partial
from typing import Any

import pytest
import torch
from conftest import build
from helpers import (
    apply_breaking_reset,
    built_in_main_refused,
    make_counter_env,
    make_fragile_env,
    make_normed_counter_env,
    picky_on_worker_one,
    start_method,
)
from torchrl.collectors import Collector

from envsync import AckTimeout, EnvStateSender, EnvSyncError, ValidationError, WorkerApplyError
from envsync.links.local import LocalLink
from envsync.links.shared_memory import SHM_DIR, SharedMemoryLink


@pytest.mark.timeout(60)
def test_1_a_late_built_collector_starts_on_the_latest_version() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    version = sender.push(config={"difficulty": 4.0}, wait=None)
    collector = build("single", sender, make_counter_env, frames_per_batch=16)
    try:
        batch = next(iter(collector))
        assert bool((batch["observation"][:, 0] == 4.0).all())
        assert bool((batch["env_version"] == version).all())
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(90)
def test_2_one_sender_reaches_several_collectors_without_detaching_any() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method("fork"):
        train = build("sync", sender, [partial(make_counter_env, label=i) for i in range(2)])
    evaluation = build("single", sender, partial(make_counter_env, label=7), frames_per_batch=16)
    try:
        assert [(m.index, m.collector, m.worker) for m in sender.fleet()] == [(0, 0, 0), (1, 0, 1), (2, 1, 0)]
        assert sender.num_workers == 3
        version = sender.push(config={"difficulty": 5.0}, wait="applied")
        assert sender.versions() == [version] * 3
        assert set(next(iter(train))["next", "observation"][..., 0].reshape(-1).tolist()) == {5.0}
        assert set(next(iter(evaluation))["next", "observation"][:, 0].tolist()) == {5.0}
        only_eval = sender.push(config={"difficulty": 6.0}, workers=[2], wait="applied")
        assert sender.versions() == [version, version, only_eval]
        assert set(next(iter(evaluation))["env_index"].tolist()) == {2}
        evaluation.shutdown()
        assert [m.index for m in sender.fleet()] == [0, 1]  # indices of the others unchanged
        with pytest.raises(ValidationError, match="worker 2 does not exist"):
            sender.push(config={"difficulty": 1.0}, workers=[2])
    finally:
        train.shutdown()
        evaluation.shutdown()
        sender.close()


@pytest.mark.timeout(60)
def test_3_shutdown_and_close_free_the_collector() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    with start_method("fork"):
        collector = build("sync", sender, [partial(make_counter_env, label=i) for i in range(2)])
    next(iter(collector))
    ref = weakref.ref(collector)
    collector.shutdown()
    sender.close()
    del collector, sender
    gc.collect()
    assert ref() is None


@pytest.mark.timeout(90)
def test_4_a_rollback_puts_back_each_workers_live_statistics() -> None:
    """A first-time env_state push that fails on worker 1 restores what each worker had,
    not the probe's build-time values."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply=picky_on_worker_one, apply_at="step")
    with start_method("fork"):
        collector = build("sync", sender, [partial(make_normed_counter_env, label=i) for i in range(2)])
    try:
        next(iter(collector))
        live = [torch.tensor([float(i + 1)] * 3) for i in range(2)]
        collector.map_fn("env.transform.loc.copy_", [(t,) for t in live])  # live stats differ per worker
        with pytest.raises(WorkerApplyError, match="worker 1 failed") as info:
            bad = {"loc": torch.full((3,), 9.0)}
            sender.push(config={"difficulty": -1.0}, env_state=bad, wait="applied")
        sender.wait(info.value.rollback, until="applied")
        after = collector.get_distant_attr("env.transform.loc")
        assert [t.tolist() for t in after] == [t.tolist() for t in live]
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(60)
def test_5_a_reset_that_fails_after_an_idle_truncate_apply_is_a_failure_not_a_success() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply=apply_breaking_reset, apply_at="truncate")
    with start_method("fork"):
        collector = build("sync", sender, [partial(make_fragile_env, label=i) for i in range(2)])
    try:
        batches = iter(collector)
        next(batches)
        with pytest.raises(WorkerApplyError, match="reset refused") as info:
            sender.push(config={"difficulty": 500.0}, wait="applied")
        sender.wait(info.value.rollback, until="applied")
        assert set(next(batches)["next", "observation"][..., 0].reshape(-1).tolist()) == {0.0}
    finally:
        collector.shutdown()
        sender.close()


def test_6_a_write_that_fails_half_way_is_never_seen_and_reads_never_spin() -> None:
    link = LocalLink({("config", "a"): torch.zeros(2), ("config", "b"): torch.zeros(2)}, 1)
    with pytest.raises(ValueError, match="does not fit"):
        link.write(0, 1, {("config", "a"): torch.ones(2), ("config", "b"): torch.ones(5)})
    header = link.handle().open(0).read_header()
    assert header.version == 0 and header.config["a"].tolist() == [0.0, 0.0]


@pytest.mark.timeout(90)
def test_7_idle_applies_never_run_inside_torchrls_own_worker_commands() -> None:
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


@pytest.mark.timeout(60)
def test_9_a_declared_env_state_template_builds_no_env_in_the_main_process() -> None:
    sender = EnvStateSender(
        config={"difficulty": 0.0},
        apply="set_difficulty",
        apply_at="step",
        env_state_template={"loc": torch.zeros(3), "scale": torch.ones(3)},
    )
    factory = partial(built_in_main_refused, main_pid=os.getpid())
    with start_method("fork"):
        collector = build("sync", sender, [factory] * 2)
    try:
        version = sender.push(env_state={"loc": torch.full((3,), 2.0)}, wait="applied")
        assert sender.versions() == [version] * 2
        assert [t.tolist() for t in collector.get_distant_attr("env.transform.loc")] == [[2.0] * 3] * 2
        with pytest.raises(ValidationError, match="'transforms.1.loc' is not in the env's state_dict"):
            sender.push(env_state={"transforms.1.loc": torch.zeros(3)})
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(60)
def test_10_waits_are_checked_and_end_promptly() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    collector = build("single", sender, make_counter_env, frames_per_batch=16)
    try:
        next(iter(collector))
        with pytest.raises(ValidationError, match="version 7 was never published"):
            sender.wait(7)
        version = sender.push(config={"difficulty": 1.0}, wait=None)  # reset mode: idle, pending
        threading.Timer(0.2, collector.shutdown).start()
        start = time.monotonic()
        with pytest.raises(AckTimeout) as info:  # the collector left the fleet: no full timeout
            sender.wait(version, until="applied", timeout=20)
        assert info.value.dead == [0] and time.monotonic() - start < 5
    finally:
        collector.shutdown()
        sender.close()
    racer = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    collector = build("single", racer, make_counter_env, frames_per_batch=16)
    try:
        next(iter(collector))
        version = racer.push(config={"difficulty": 1.0}, wait=None)
        threading.Timer(0.2, racer.close).start()
        with pytest.raises(EnvSyncError):
            racer.wait(version, until="applied", timeout=20)
    finally:
        collector.shutdown()
        racer.close()


@pytest.mark.timeout(60)
def test_10_a_failure_raised_by_another_push_still_reaches_its_waiter() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply=picky_on_worker_one, apply_at="step")
    with start_method("fork"):
        collector = build("sync", sender, [partial(make_counter_env, label=i) for i in range(2)])
    try:
        next(iter(collector))
        bad = sender.push(config={"difficulty": -1.0}, wait=None)
        time.sleep(0.5)
        with pytest.raises(WorkerApplyError):
            sender.push(config={"difficulty": 1.0}, wait=None)  # raises bad's failure first
        with pytest.raises(WorkerApplyError) as info:
            sender.wait(bad, until="applied")  # the waiter of bad still sees it
        assert info.value.version == bad
    finally:
        collector.shutdown()
        sender.close()


def test_11_the_sweep_keeps_live_files_whatever_their_pid_says() -> None:
    import multiprocessing as mp

    from envsync.links.shared_memory import sweep_stale

    link = SharedMemoryLink({("config", "x"): torch.zeros(1)}, 1, ctx=mp.get_context("spawn"))
    # the same name under a pid that is not running (as seen from another PID namespace)
    alias = os.path.join(SHM_DIR, "envsync-999999999-alias")
    os.link(link.path, alias)
    try:
        assert alias not in sweep_stale() and os.path.exists(alias)  # a live owner holds its lock
    finally:
        os.unlink(alias)
        link.close()


def test_12_truncate_check_reaches_its_error_path() -> None:
    """Was test_sender.py's truncate test, which could not fail; see that test now."""
    from helpers import NoTruncationEnv

    sender = EnvStateSender(config={}, apply_at="truncate")
    sender.env_fn(NoTruncationEnv)
    with pytest.raises(ValidationError, match="truncated"):
        sender.env_state_template()
    sender.close()


def test_single_collector_uses_an_in_process_link() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = Collector(
        sender.env_fn(make_counter_env), None, frames_per_batch=8, total_frames=-1, weight_sync_schemes=sender.schemes()
    )
    try:
        assert isinstance(sender.port.links()[0], LocalLink)
        version = sender.push(config={"difficulty": 2.0}, wait="applied")
        assert set(next(iter(collector))["next", "observation"][:, 0].tolist()) == {2.0}
        assert sender.versions() == [version]
    finally:
        collector.shutdown()
        sender.close()


class PushAfterRollout(Collector):
    """A torchrl Collector that runs a callback after each rollout, before returning it: a
    version that arrives after the last step of a rollout, deterministically."""

    after_rollout: Any = None

    def rollout(self) -> Any:
        batch = super().rollout()
        if self.after_rollout is not None:
            self.after_rollout()
            self.after_rollout = None
        return batch


@pytest.mark.timeout(60)
def test_8_a_truncate_that_arrives_after_the_last_step_flags_that_step() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="truncate")
    collector = PushAfterRollout(
        sender.env_fn(make_counter_env), None, frames_per_batch=8, total_frames=-1, weight_sync_schemes=sender.schemes()
    )
    try:
        batches = iter(collector)
        next(batches)
        pushed: list[int] = []
        collector.after_rollout = lambda: pushed.append(sender.push(config={"difficulty": 3.0}, wait=None))
        batch = next(batches)
        assert bool(batch["next", "truncated"][-1].all()) and bool(batch["next", "done"][-1].all())
        assert not bool(batch["next", "terminated"][-1].any())
        after = next(batches)
        assert after["observation"][0, 2] == 0  # a fresh episode
        assert set(after["env_version"].tolist()) == set(pushed) and set(after["observation"][:, 0].tolist()) == {3.0}
    finally:
        collector.shutdown()
        sender.close()
