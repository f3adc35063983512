"""End to end: targeting workers, idle collectors, late joiners, checkpoints, clean-up."""

from __future__ import annotations

import gc
import os
import time
from functools import partial

import psutil
import pytest
import torch
from conftest import build
from helpers import check_truthful, make_counter_env, rows, start_method

from envsync import EnvStateSender, ValidationError
from envsync.links.shared_memory import SHM_DIR

WORKERS = 2


def labelled(max_steps: int = 1000) -> list[partial[object]]:
    return [partial(make_counter_env, label=i, max_steps=max_steps) for i in range(WORKERS)]


def difficulty_by_label(batch: torch.Tensor) -> dict[int, set[float]]:
    out: dict[int, set[float]] = {}
    for row in rows(batch):
        out.setdefault(int(row["observation"][0, 1]), set()).update(row["next", "observation"][:, 0].tolist())
    return out


@pytest.mark.timeout(120)
def test_workers_subset_and_push_each_leave_the_others_alone() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method("fork"):
        collector = build("sync", sender, labelled())
    try:
        batches = iter(collector)
        next(batches)
        v1 = sender.push(config={"difficulty": 1.0}, workers=[1], wait="applied")
        assert sender.versions() == [0, v1]
        assert difficulty_by_label(next(batches)) == {0: {0.0}, 1: {1.0}}
        v2 = sender.push_each({0: {"difficulty": 2.0}, 1: {"difficulty": 3.0}}, wait="applied")
        assert sender.versions() == [v2, v2]
        batch = next(batches)
        assert difficulty_by_label(batch) == {0: {2.0}, 1: {3.0}}
        v3 = sender.push_each({0: {"difficulty": 4.0}}, wait="applied")
        assert sender.versions() == [v3, v2]
        assert difficulty_by_label(next(batches)) == {0: {4.0}, 1: {3.0}}
        assert sender.desired_config(1)["difficulty"].item() == 3.0
        with pytest.raises(ValidationError, match="worker 2 does not exist"):
            sender.push(config={"difficulty": 9.0}, workers=[2])
        assert sender.version == v3 and sender.versions() == [v3, v2]
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(120)
def test_idle_collectors_take_pushes_as_the_modes_say() -> None:
    modes = ("step", "truncate", "reset")
    senders = {m: EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at=m) for m in modes}
    with start_method("fork"):  # what is checked does not depend on it; spawn is tested below
        collectors = {m: build("sync", senders[m], labelled(max_steps=30), frames_per_batch=40) for m in modes}
    try:
        iterators = {m: iter(c) for m, c in collectors.items()}
        for it in iterators.values():
            next(it)
        time.sleep(2)  # idle: four of the worker loops' wake-up periods, no push pending
        versions = {
            "step": senders["step"].push(config={"difficulty": 1.0}, wait="applied", timeout=10),
            "truncate": senders["truncate"].push(config={"difficulty": 1.0}, wait="applied", timeout=10),
            "reset": senders["reset"].push(config={"difficulty": 1.0}, wait="received", timeout=10),
        }
        assert senders["reset"].versions() == [0, 0]
        table = {0: 0.0, 1: 1.0}
        for mode, it in iterators.items():
            batch = next(it)
            check_truthful(batch, table, index=0)
            for row in rows(batch):
                if mode == "step":  # the very next step runs the new config, mid-episode
                    assert bool((row["next", "env_version"] == versions[mode]).all())
                    assert row["observation"][0, 2] > 0
                elif mode == "truncate":  # a fresh episode under the new config
                    assert row["env_version"][0] == versions[mode] and row["observation"][0, 2] == 0
                else:  # the old episode runs on until its reset, then the new config
                    nxt = row["next", "env_version"]
                    assert nxt[0] == 0 and nxt[-1] == versions[mode]
                    first_new = int(torch.nonzero(nxt).flatten()[0])
                    assert row["observation"][first_new, 2] == 0
        assert senders["reset"].versions() == [1, 1]
    finally:
        for mode in modes:
            collectors[mode].shutdown()
            senders[mode].close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_late_joiners_start_from_the_latest_desired_state(method: str) -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    sender.push(config={"difficulty": 0.5})
    latest = sender.push(config={"difficulty": 0.7})
    restored = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    assert restored.load_state_dict(sender.state_dict()) == latest
    sender.close()
    with start_method(method):
        collector = build("async", restored, labelled())
    try:
        batch = next(iter(collector))
        # from the very first frame: the reset observation and every step
        assert bool((batch["env_version"] == latest).all())
        assert bool((batch["observation"][..., 0] == 0.7).all())
        assert batch["observation"][0, 2] == 0
        assert restored.versions() == [latest, latest]
    finally:
        collector.shutdown()
        restored.close()


@pytest.mark.timeout(120)
def test_checkpoint_of_per_worker_configs_round_trips() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method("fork"):
        collector = build("sync", sender, labelled())
    try:
        batches = iter(collector)
        next(batches)
        sender.push_each({0: {"difficulty": 0.25}, 1: {"difficulty": 0.5}}, wait="applied")
        state = sender.state_dict()
        assert state["config"]["difficulty"].tolist() == [0.25, 0.5]
        sender.push(config={"difficulty": 0.9}, wait="applied")
        version = sender.load_state_dict(state)
        sender.wait(version, until="applied")
        assert difficulty_by_label(next(batches)) == {0: {0.25}, 1: {0.5}}
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(120)
def test_close_and_gc_leave_no_shared_memory_and_no_process() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    collector = build("async", sender, labelled())
    next(iter(collector))
    path = sender.port.links()[0].path
    pids = [p.pid for p in collector.procs]
    assert os.path.exists(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    collector.shutdown()
    sender.close()
    del collector, sender
    gc.collect()
    assert not os.path.exists(path)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not any(name.startswith(f"envsync-{os.getpid()}-") for name in os.listdir(SHM_DIR))


@pytest.mark.timeout(60)
def test_gc_of_an_unclosed_sender_removes_its_file() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    with start_method("fork"):  # a single Collector has no file: its link is in-process
        collector = build("sync", sender, partial(make_counter_env, label=0), workers=1)
    next(iter(collector))
    path = sender.port.links()[0].path
    collector.shutdown()
    del collector, sender
    gc.collect()
    assert not os.path.exists(path)
