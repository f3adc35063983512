"""envsync.sender.acks: waiting for acknowledgements and raising what the workers report, with real
collectors: a wait is checked and ends promptly, a failure reaches the waiter of its version
whoever raised it first, and a rollback puts back what each worker had."""

from __future__ import annotations

import threading
import time
from functools import partial

import pytest
import torch
from conftest import build
from helpers import make_counter_env, make_normed_counter_env, picky_on_worker_one, start_method

from envsync import AckTimeout, EnvStateSender, EnvSyncError, ValidationError, WorkerApplyError


@pytest.mark.timeout(60)
def test_a_wait_is_checked_and_ends_promptly_when_its_collector_or_sender_goes() -> None:
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
def test_a_failure_raised_by_another_push_still_reaches_its_waiter() -> None:
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


@pytest.mark.timeout(90)
def test_a_rollback_puts_back_each_workers_live_statistics() -> None:
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
