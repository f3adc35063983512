"""Fault injection with real collectors and real worker processes (no mocks).

Workers are killed (SIGKILL) or frozen (SIGSTOP) mid-apply and mid-rollout, the main process
is killed mid-push, the collector is shut down under a push, pushes race from several
threads, the sender is dropped while its workers run, an apply outlives the push timeout,
and nothing (shared-memory files, semaphores) may be left behind.

Every collector is built per test with the fork start method (about 0.1 s): a collector
shared across tests would keep its shared-memory file alive past a test, and every test
checks that none of this process's envsync files is left.
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from functools import partial
from multiprocessing import resource_tracker
from typing import Any

import psutil
import pytest
from conftest import build
from fault_helpers import (
    SLEEPY_CONFIG,
    envsync_files,
    make_endless_counter_env,
    make_slow_counter_env,
    shm_naming,
    sleepy_apply,
)
from helpers import check_truthful, rows, start_method
from tensordict import TensorDictBase
from torchrl.collectors import MultiSyncCollector

import envsync
from envsync import AckTimeout, EnvStateSender, EnvSyncError

WORKERS = 2
FRAMES = 20
PROMPT = 5.0
"""A dead worker must be reported well before the push timeout (30 s): within this many seconds."""
TESTS = pathlib.Path(__file__).parent


ENVSYNC_DIR = str(pathlib.Path(envsync.__file__).parent)
THREAD_CRASH = "an envsync thread crashed"


@pytest.fixture(autouse=True)
def no_envsync_files_left() -> Iterator[None]:
    yield
    gc.collect()
    assert envsync_files(os.getpid()) == []


@pytest.fixture(autouse=True)
def no_envsync_thread_crashes(capfd: pytest.CaptureFixture[str]) -> Iterator[None]:
    """Fail a test in which a thread died of an exception raised in envsync code, in this
    process or in a worker (fork workers inherit the hook and write to the captured stderr)."""
    previous = threading.excepthook

    def hook(args: Any) -> None:
        files = [frame.f_code.co_filename for frame, _ in traceback.walk_tb(args.exc_traceback)]
        if any(f.startswith(ENVSYNC_DIR) for f in files):
            text = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
            name = args.thread.name if args.thread is not None else "?"
            os.write(2, f"{THREAD_CRASH} (pid {os.getpid()}, thread {name}):\n{text}".encode())
        previous(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous
    err = capfd.readouterr().err
    sys.stderr.write(err)  # keep it in the report
    assert THREAD_CRASH not in err, err[err.index(THREAD_CRASH) :][:3000]


def endless(maker: Any = make_endless_counter_env) -> list[partial[Any]]:
    return [partial(maker, label=i) for i in range(WORKERS)]


def sleepy_sender() -> EnvStateSender:
    return EnvStateSender(config=SLEEPY_CONFIG, apply=sleepy_apply, apply_at="step")


class StepChecker:
    """Checks that each worker's step counter runs on without a gap across batches (episodes
    never end): a lost or duplicated frame breaks it."""

    def __init__(self) -> None:
        self.last_step: dict[int, float] = {}
        self.batches: dict[int, int] = {}

    def check(self, batch: TensorDictBase) -> None:
        for row in rows(batch):
            label = int(row["observation"][0, 1])
            steps = row["observation"][:, 2]
            assert steps[0].item() == self.last_step.get(label, 0.0), (label, steps[0].item(), self.last_step)
            assert bool((steps.diff() == 1).all()), (label, steps.tolist())
            assert bool((row["next", "observation"][:, 2] == steps + 1).all()), label
            self.last_step[label] = row["next", "observation"][-1, 2].item()
            self.batches[label] = self.batches.get(label, 0) + 1


def kill_and_reap(proc: Any) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(5)


# ---- kills and stops -------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_worker_killed_mid_apply_is_reported_dead_promptly() -> None:
    sender = sleepy_sender()
    with start_method("fork"):
        collector = build("sync", sender, endless(), frames_per_batch=FRAMES)
    try:
        next(iter(collector))
        # "step" mode, idle collector: each worker's loop applies at once, sleeping 2 s
        version = sender.push(config={"difficulty": 1.0, "sleep": 2.0}, wait="received", timeout=10)
        time.sleep(0.3)
        victim = collector.procs[1]
        os.kill(victim.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(AckTimeout) as info:
            sender.wait(version, until="applied", timeout=30)
        assert time.monotonic() - start < PROMPT
        assert info.value.dead == [1] and 1 in info.value.workers
        victim.join(5)
        start = time.monotonic()
        with pytest.raises(AckTimeout) as info:
            sender.push(config={"difficulty": 2.0, "sleep": 0.0}, wait="applied", timeout=30)
        assert time.monotonic() - start < PROMPT
        assert info.value.dead == [1] and 1 in info.value.workers
        # the survivor is not held hostage: it finishes and takes pushes aimed at it
        last = sender.push(config={"difficulty": 3.0, "sleep": 0.0}, workers=[0], wait="applied", timeout=10)
        assert sender.versions()[0] == last
    finally:
        collector.shutdown(raise_on_error=False)
        sender.close()


@pytest.mark.timeout(60)
def test_a_worker_killed_mid_rollout_is_reported_dead_promptly() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method("fork"):
        # 200 frames of 5 ms: a rollout lasts about a second
        collector = build("async", sender, endless(make_slow_counter_env), frames_per_batch=200)
    try:
        batch = next(iter(collector))
        # a MultiAsyncCollector tells a worker to go on before it yields that worker's batch
        label = int(rows(batch)[0]["observation"][0, 1])
        time.sleep(0.2)
        victim = collector.procs[label]
        kill_and_reap(victim)
        start = time.monotonic()
        with pytest.raises(AckTimeout) as info:
            sender.push(config={"difficulty": 1.0}, wait="applied", timeout=30)
        assert time.monotonic() - start < PROMPT
        assert info.value.dead == [label] and label in info.value.workers
        survivor = 1 - label
        sender.wait(sender.version, until="applied", workers=[survivor], timeout=10)
        assert sender.versions()[survivor] == sender.version
    finally:
        collector.shutdown(raise_on_error=False)
        sender.close()


@pytest.mark.timeout(90)
def test_a_stopped_worker_times_out_then_catches_up_without_losing_frames() -> None:
    """A MultiSyncCollector: a MultiAsyncCollector's workers keep collecting while this test's
    loop stalls through the stop, and torchrl drops a worker's batch when the output queue
    stays full past its put timeout (torchrl's behaviour, whatever envsync does)."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method("fork"):
        collector = build("sync", sender, endless(), frames_per_batch=FRAMES)
    checker = StepChecker()
    difficulty = {0: 0.0}
    try:
        batches = iter(collector)
        for _ in range(6):
            checker.check(next(batches))
        frozen = collector.procs[1]
        os.kill(frozen.pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic() + 5  # the stop takes effect asynchronously
            while psutil.Process(frozen.pid).status() != psutil.STATUS_STOPPED:
                assert time.monotonic() < stopped, psutil.Process(frozen.pid).status()
                time.sleep(0.005)
            start = time.monotonic()
            with pytest.raises(AckTimeout) as info:
                sender.push(config={"difficulty": 1.0}, wait="applied", timeout=1.0)
            assert 1.0 <= time.monotonic() - start < PROMPT
            assert info.value.workers == [1] and info.value.dead == [] and info.value.until == "applied"
            difficulty[sender.version] = 1.0
            latest = sender.push(config={"difficulty": 2.0}, wait=None)
            difficulty[latest] = 2.0
            time.sleep(0.5)
            assert sender.versions()[1] == 0  # frozen: nothing applied
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        sender.wait(latest, until="applied", timeout=10)
        assert sender.versions() == [latest, latest]
        before = dict(checker.batches)
        deadline = time.monotonic() + 30
        while checker.batches.get(1, 0) < before.get(1, 0) + 3 or checker.batches.get(0, 0) < before.get(0, 0) + 3:
            batch = next(batches)
            checker.check(batch)
            check_truthful(batch, difficulty, index=0)
            assert time.monotonic() < deadline, checker.batches
        # the last batch of worker 1 ran entirely under the latest version
        assert sender.versions() == [latest, latest]
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(90)
def test_the_main_process_killed_mid_push_leaves_no_workers_and_no_files(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "run.json"
    # the child imports the envsync this process runs, whatever is installed
    path = os.pathsep.join([str(pathlib.Path(envsync.__file__).parent.parent), str(TESTS)])
    log = tmp_path / "child.log"
    with log.open("w") as sink:  # not a pipe: orphaned workers would hold it open
        child = subprocess.run(
            [sys.executable, str(TESTS / "fault_helpers.py"), str(out)],
            cwd=TESTS.parent,
            env={**os.environ, "PYTHONPATH": path},
            stdout=sink,
            stderr=subprocess.STDOUT,
            timeout=60,
        )
    assert child.returncode == -signal.SIGKILL, log.read_text()[-3000:]
    record = json.loads(out.read_text())
    assert record["files"], "the killed run had no envsync file: nothing to check"
    deadline = time.monotonic() + 10
    lingering = list(record["workers"])
    while lingering and time.monotonic() < deadline:
        lingering = [pid for pid in lingering if _running(pid)]
        time.sleep(0.1)
    for pid in lingering:  # do not leave them behind whatever the verdict
        os.kill(pid, signal.SIGKILL)

    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method("fork"):
        collector = build("sync", sender, endless(), frames_per_batch=FRAMES)
    try:
        left = envsync_files(record["pid"])
    finally:
        collector.shutdown()
        sender.close()
    assert (lingering, left) == ([], []), (
        f"workers {lingering} outlived their killed main process by 10 s; its files left after a new attach: {left}"
    )


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ---- concurrency -----------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("apply_at", ["step", "truncate"])
@pytest.mark.parametrize("kind", ["single", "sync", "async"])
def test_a_shutdown_during_a_push_does_not_hang_the_push(kind: str, apply_at: str) -> None:
    """The shutdown returns and the push ends promptly with what really happened: a single
    ``Collector``'s apply runs in this process, so its shutdown waits for it and the push
    returns the version, applied; a Multi* collector's shutdown ends its workers mid-apply,
    so the push raises ``AckTimeout`` naming every worker dead (not late). No envsync thread
    dies of it (the worker loop applies while the collector shuts down; "truncate" also
    resets the env through the collector after the apply)."""
    sender = EnvStateSender(config=SLEEPY_CONFIG, apply=sleepy_apply, apply_at=apply_at)
    with start_method("fork"):
        collector = build(kind, sender, endless(), frames_per_batch=FRAMES)
    next(iter(collector))
    env = collector.env if kind == "single" else None  # the single collector's env, in this process
    shutdown_errors: list[BaseException] = []

    def shut() -> None:
        time.sleep(0.3)
        try:
            collector.shutdown()
        except BaseException as err:  # reported below
            shutdown_errors.append(err)

    closer = threading.Thread(target=shut, daemon=True)
    closer.start()
    start = time.monotonic()
    outcome: Any
    try:
        # each worker's apply sleeps 1 s: the shutdown lands in the middle of it
        outcome = sender.push(config={"difficulty": 1.0, "sleep": 1.0}, wait="applied", timeout=20)
    except EnvSyncError as err:
        outcome = err
    elapsed = time.monotonic() - start
    closer.join(20)
    time.sleep(max(0.0, start + 1.7 - time.monotonic()))  # let the interrupted apply end within the test
    try:
        assert not closer.is_alive(), "collector.shutdown() hangs"
        assert shutdown_errors == []
        assert elapsed < 15, (elapsed, outcome)
        if kind == "single":
            assert outcome == 1 and env.difficulty == 1.0, outcome
        else:
            assert isinstance(outcome, AckTimeout), outcome
            assert (outcome.version, outcome.until, outcome.workers, outcome.dead) == (1, "applied", [0, 1], [0, 1])
            assert str(outcome) == "version 1 not applied by workers [0, 1]; dead: [0, 1]"
    finally:
        collector.shutdown(raise_on_error=False)
        sender.close()


@pytest.mark.timeout(60)
def test_pushes_from_four_threads_all_succeed_with_unique_versions() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method("fork"):
        collector = build("sync", sender, endless(), frames_per_batch=FRAMES)
    threads, per_thread = 4, 20
    start = threading.Barrier(threads)
    pushed: list[tuple[int, float]] = []
    errors: list[BaseException] = []

    def pusher(t: int) -> None:
        start.wait()
        try:
            for i in range(per_thread):
                value = float(100 * (t + 1) + i)
                pushed.append((sender.push(config={"difficulty": value}, wait="applied", timeout=20), value))
        except BaseException as err:  # reported below
            errors.append(err)

    checker = StepChecker()
    try:
        batches = iter(collector)
        checker.check(next(batches))  # the collector is idle from here on
        workers = [threading.Thread(target=pusher, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(40)
        assert not any(w.is_alive() for w in workers), "a push hangs"
        assert errors == []
        versions = sorted(v for v, _ in pushed)
        assert versions == list(range(1, threads * per_thread + 1))
        assert sender.version == threads * per_thread
        assert sender.versions() == [sender.version] * WORKERS
        difficulty = {0: 0.0, **dict(pushed)}
        batch = next(batches)
        checker.check(batch)  # step mode: the episodes run on, nothing lost
        check_truthful(batch, difficulty, index=0)
        assert bool((batch["next", "env_version"] == sender.version).all())
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(60)
def test_dropping_the_sender_while_workers_run_leaves_the_collector_working() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method("fork"):
        collector = build("async", sender, endless(), frames_per_batch=FRAMES)
    dropped = weakref.ref(sender)
    checker = StepChecker()
    try:
        batches = iter(collector)
        checker.check(next(batches))
        sender.push(config={"difficulty": 1.0}, wait="applied")
        del sender
        gc.collect()
        for _ in range(8):
            checker.check(next(batches))
        assert all(count >= 2 for count in checker.batches.values()), checker.batches
    finally:
        collector.shutdown()
    del collector, batches
    gc.collect()
    assert dropped() is None, "the sender outlives its collector and every user reference"


@pytest.mark.timeout(60)
def test_an_apply_longer_than_the_push_timeout() -> None:
    """An apply that blocks past ``timeout`` makes the push raise ``AckTimeout`` naming that
    worker (not dead). The collector is not broken: the worker goes on with the apply, acks it
    when it ends (``sender.wait`` then returns and ``versions()`` shows it), and the frames it
    collects afterwards run under the new config. Meanwhile that worker's loop is busy, so
    it applies nothing else; a later push waits for it in turn."""
    sender = sleepy_sender()
    with start_method("fork"):
        collector = build("sync", sender, endless(), frames_per_batch=FRAMES)
    checker = StepChecker()
    try:
        batches = iter(collector)
        checker.check(next(batches))
        start = time.monotonic()
        with pytest.raises(AckTimeout) as info:
            sender.push(config={"difficulty": 1.0, "sleep": 3.0, "sleeper": 1.0}, wait="applied", timeout=1)
        assert 1.0 <= time.monotonic() - start < 2.5
        err = info.value
        assert (err.workers, err.dead, err.until) == ([1], [], "applied")
        version = err.version
        assert sender.versions() == [version, 0]
        sender.wait(version, until="applied", timeout=10)
        assert sender.versions() == [version, version]
        batch = next(batches)
        checker.check(batch)
        assert bool((batch["next", "observation"][..., 0] == 1.0).all())
        last = sender.push(config={"sleep": 0.0}, wait="applied", timeout=10)
        assert sender.versions() == [last, last]
    finally:
        collector.shutdown()
        sender.close()


# ---- leaks -----------------------------------------------------------------------------------


class SemaphoreLedger:
    """Records the named semaphores this process creates and unlinks.

    Under spawn, multiprocessing registers each named semaphore with its resource tracker
    when it creates it and unregisters it when it unlinks the name; under fork it unlinks the
    name at once and registers nothing. Watching those two calls attributes every
    ``/dev/shm/sem.mp-*`` file to its creator, so other processes on the machine do not count.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.created: set[str] = set()
        self.unlinked: set[str] = set()
        register, unregister = resource_tracker.register, resource_tracker.unregister

        def on_register(name: str, rtype: str) -> None:
            if rtype == "semaphore":
                self.created.add(name)
            register(name, rtype)

        def on_unregister(name: str, rtype: str) -> None:
            if rtype == "semaphore":
                self.unlinked.add(name)
            unregister(name, rtype)

        monkeypatch.setattr(resource_tracker, "register", on_register)
        monkeypatch.setattr(resource_tracker, "unregister", on_unregister)

    def left(self) -> set[str]:
        """The semaphores created and not unlinked whose file is still in /dev/shm."""
        directory, _ = shm_naming()
        return {n for n in self.created - self.unlinked if os.path.exists(f"{directory}/sem.{n.lstrip('/')}")}


def _semaphores_left(monkeypatch: pytest.MonkeyPatch, *, with_envsync: bool) -> set[str]:
    """Run a spawn MultiSyncCollector (with or without envsync), shut it down (and close the
    sender), and return the semaphores it created that are still in /dev/shm, while the user
    still holds the collector (as after ``collector.shutdown()`` in a training script)."""
    ledger = SemaphoreLedger(monkeypatch)
    sender = (
        EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step") if with_envsync else None
    )
    with start_method("spawn"):
        if sender is not None:
            collector = build("sync", sender, endless(), frames_per_batch=FRAMES)
        else:
            collector = MultiSyncCollector(endless(), None, frames_per_batch=FRAMES, total_frames=-1)
    try:
        next(iter(collector))
        if sender is not None:
            sender.push(config={"difficulty": 1.0}, wait="applied")
    finally:
        collector.shutdown()
        if sender is not None:
            sender.close()
    gc.collect()
    left = ledger.left()
    monkeypatch.undo()
    return left


@pytest.mark.timeout(120)
def test_shutdown_and_close_leave_no_semaphores_beyond_torchrls_own(monkeypatch: pytest.MonkeyPatch) -> None:
    baseline = _semaphores_left(monkeypatch, with_envsync=False)
    with_envsync = _semaphores_left(monkeypatch, with_envsync=True)
    assert len(with_envsync) <= len(baseline), (
        f"torchrl alone leaves {sorted(baseline)}, with envsync {sorted(with_envsync)}"
    )
