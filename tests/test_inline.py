"""The in-process link runs the worker loop's turn in the sender's thread
(:mod:`envsync.links.inline`): a push that waits, to an idle ``Collector``, is noticed, and
in ``"step"`` mode applied, in the sender's thread, with no hop to the loop's thread (one
with ``wait=None`` returns at once, and the loop's thread applies it); while the
collector's thread holds the env (inside a step), the push neither blocks nor applies: the
loop's thread takes the notice once the step ends; an apply that pushes does not recurse.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from helpers import CounterEnv, NativeCounterEnv
from torchrl.collectors import Collector

from envsync import EnvStateSender

N = 4


class Recorded:
    """Threads that ran the apply, and a step that can be held (the collector's thread then
    holds the env's owner inside ``env.step``)."""

    def __init__(self) -> None:
        self.threads: list[int] = []
        self.hold = threading.Event()
        self.stepping = threading.Event()
        self.released = threading.Event()
        self.released.set()

    def step_gate(self) -> None:
        if self.hold.is_set():
            self.stepping.set()
            self.released.wait(30)


class RecordedCounter(CounterEnv):
    def __init__(self, record: Recorded) -> None:
        super().__init__()
        self.record = record

    def set_difficulty(self, difficulty: float) -> None:
        self.record.threads.append(threading.get_ident())
        super().set_difficulty(difficulty)

    def _step(self, tensordict: Any) -> Any:
        self.record.step_gate()
        return super()._step(tensordict)


class RecordedWorlds(NativeCounterEnv):
    def __init__(self, record: Recorded) -> None:
        super().__init__(N)
        self.record = record

    def set_difficulty(self, difficulty: torch.Tensor, env_ids: torch.Tensor) -> None:
        self.record.threads.append(threading.get_ident())
        super().set_difficulty(difficulty, env_ids)

    def _step(self, tensordict: Any) -> Any:
        self.record.step_gate()
        return super()._step(tensordict)


def build(kind: str, record: Recorded) -> tuple[EnvStateSender, Collector, Any]:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    make = (lambda: RecordedWorlds(record)) if kind == "worlds" else (lambda: RecordedCounter(record))
    collector = Collector(
        sender.env_fn(make),
        None,
        frames_per_batch=4 * (N if kind == "worlds" else 1),
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
    )
    return sender, collector, iter(collector)


def difficulties(collector: Collector, kind: str) -> list[float]:
    env = collector.env
    return env.difficulty.tolist() if kind == "worlds" else [env.difficulty]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["plain", "worlds"])
def test_a_push_that_waits_is_applied_in_the_senders_thread_and_one_that_does_not_in_the_loops(kind: str) -> None:
    record = Recorded()
    sender, collector, batches = build(kind, record)
    try:
        next(batches)
        record.threads.clear()
        here = 0
        for i in range(1, 21):
            version = sender.push(config={"difficulty": i / 10}, wait="received")
            # the turn ran here: the env holds it already (step mode, idle) and says so
            held = difficulties(collector, kind) == pytest.approx([i / 10] * len(difficulties(collector, kind)))
            here += held and sender.versions() == [version] * len(sender.versions())
            sender.wait(version, until="applied", timeout=10)
        # every one, but for a push that met the loop's periodic turn holding the env (it then
        # leaves the notice to the loop's thread): one in hundreds of runs
        assert here >= 18 and record.threads.count(threading.get_ident()) >= 18, (here, record.threads)
        record.threads.clear()
        version = sender.push(config={"difficulty": 3.0}, wait=None)
        sender.wait(version, until="applied", timeout=10)
        assert len(record.threads) == 1 and record.threads[0] != threading.get_ident()  # the loop's thread
        batch = next(batches)  # every step ran under it (the first observation came before it)
        assert (batch["next", "env_version"] == sender.version).all()
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["plain", "worlds"])
def test_a_push_while_another_thread_steps_the_env_neither_blocks_the_sender_nor_applies_inside_the_step(
    kind: str,
) -> None:
    record = Recorded()
    sender, collector, batches = build(kind, record)
    try:
        next(batches)
        record.hold.set()
        record.released.clear()
        got: list[Any] = []
        thread = threading.Thread(target=lambda: got.append(next(batches)))
        thread.start()
        assert record.stepping.wait(20)  # the collector's thread is inside env.step, holding the env
        record.threads.clear()
        pushed: list[int] = []
        pusher = threading.Thread(target=lambda: pushed.append(sender.push(config={"difficulty": 0.5}, timeout=20)))
        pusher.start()
        time.sleep(0.3)
        start = time.monotonic()
        before = sender.versions()  # the sender's lock is free: the push did not wait for the env in it
        assert time.monotonic() - start < 1.0
        assert record.threads == []  # nothing applied during the step
        # "received" came or not (a natively batched env's steps take no lock: its group notices
        # during the step; a plain env's notice waits for the step's end), never "applied"
        assert sender.versions() == before
        record.hold.clear()
        record.released.set()
        thread.join(30)
        pusher.join(30)
        assert pushed and got
        assert before != [pushed[0]] * len(before)
        batch = next(batches)
        assert (batch["next", "env_version"] == pushed[0]).all()
        assert record.threads  # applied since, at a safe point
    finally:
        record.released.set()
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(60)
def test_an_apply_that_pushes_does_not_run_the_next_push_inside_itself() -> None:
    depth = {"now": 0, "most": 0}
    senders: list[EnvStateSender] = []

    def apply(env: Any, config: Any) -> None:
        depth["now"] += 1
        depth["most"] = max(depth["most"], depth["now"])
        try:
            value = float(config["difficulty"])
            if value == 1.0:  # pushes the next version from inside its own apply
                senders[0].push(config={"difficulty": 2.0}, wait=None)
            env.set_difficulty(value)
        finally:
            depth["now"] -= 1

    sender = EnvStateSender(config={"difficulty": 0.0}, apply=apply, apply_at="step")
    senders.append(sender)
    collector = Collector(
        sender.env_fn(CounterEnv), None, frames_per_batch=4, total_frames=-1, weight_sync_schemes=sender.schemes()
    )
    try:
        next(iter(collector))
        sender.push(config={"difficulty": 1.0}, wait="applied", timeout=10)
        sender.wait(sender.version, until="applied", timeout=10)
        assert sender.version == 2
        assert collector.env.difficulty == 2.0
        assert depth["most"] == 1
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(60)
def test_an_apply_run_in_the_senders_thread_holds_its_env_not_the_sender() -> None:
    started, release = threading.Event(), threading.Event()

    def apply(env: Any, config: Any) -> None:
        value = float(config["difficulty"])
        if value == 7.0:  # a slow apply (a simulator's setters, a re-init's rollout)
            started.set()
            release.wait(20)
        env.set_difficulty(value)

    sender = EnvStateSender(config={"difficulty": 0.0}, apply=apply, apply_at="step")
    collector = Collector(
        sender.env_fn(CounterEnv), None, frames_per_batch=4, total_frames=-1, weight_sync_schemes=sender.schemes()
    )
    try:
        next(iter(collector))
        pushed: list[int] = []
        pusher = threading.Thread(
            target=lambda: pushed.append(sender.push(config={"difficulty": 7.0}, wait="applied", timeout=20))
        )
        pusher.start()
        assert started.wait(20)  # the apply runs in the pusher's thread, inside its push
        start = time.monotonic()
        before = sender.versions()  # the sender's lock is free meanwhile
        assert time.monotonic() - start < 1.0
        assert before == [0] and not pushed
        release.set()
        pusher.join(20)
        assert pushed == [1] and sender.versions() == [1] and collector.env.difficulty == 7.0
    finally:
        release.set()
        collector.shutdown()
        sender.close()
