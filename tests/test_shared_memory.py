"""envsync.transports.shared_memory: layout, seqlock, acks, errors, clean-up."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import torch
from tensordict import TensorDict

from envsync.protocol import NO_FAILURE
from envsync.transports.shared_memory import PREFIX, SHM_DIR, SharedMemoryChannel, sweep_stale


def channel(workers: int = 2) -> SharedMemoryChannel:
    payload = TensorDict(
        config=TensorDict(difficulty=torch.tensor(0.0), level=torch.tensor(1)),
        env_state=TensorDict(loc=torch.zeros(3)),
        stamp=TensorDict(loc=torch.tensor(0)),
    )
    return SharedMemoryChannel(payload, workers, semaphores=[threading.Semaphore(0) for _ in range(workers)])


def test_writes_reach_only_the_targeted_worker() -> None:
    ch = channel()
    try:
        ends = [ch.handle().open(w) for w in range(2)]
        ch.write(1, 5, TensorDict(config=TensorDict(difficulty=torch.tensor(0.5))))
        assert ends[0].read()[0] == 0 and ends[0].read()[1]["config", "difficulty"] == 0.0
        version, payload = ends[1].read()
        assert version == 5 and payload["config", "difficulty"] == 0.5 and payload["config", "level"] == 1
        assert ch.status(1).target == 5 and ch.status(0).target == 0
    finally:
        ch.close()


def test_env_state_entries_are_read_only_when_newer_than_applied() -> None:
    ch = channel(1)
    try:
        end = ch.handle().open(0)
        ch.write(0, 1, TensorDict(env_state=TensorDict(loc=torch.ones(3)), stamp=TensorDict(loc=torch.tensor(1))))
        assert end.read(since=0)[1]["env_state", "loc"].tolist() == [1.0, 1.0, 1.0]
        ch.write(0, 2, TensorDict(config=TensorDict(level=torch.tensor(7))))
        assert "loc" not in end.read(since=1)[1]["env_state"].keys()
    finally:
        ch.close()


def test_acks_and_failure_text_travel_back() -> None:
    ch = channel(1)
    try:
        end = ch.handle().open(0)
        assert ch.status(0).failed == NO_FAILURE and ch.worker_pid(0) == os.getpid()
        end.ack_received(3)
        end.ack_applied(2)
        assert (ch.status(0).received, ch.status(0).applied) == (3, 2)
        end.report_failure(4, "Traceback: boom é")
        assert ch.status(0).failed == 4 and ch.error_text(0) == "Traceback: boom é"
        ch.notify(0)
        assert end.wait_notice(1.0) and not end.wait_notice(0.01)
    finally:
        ch.close()


def test_reader_never_sees_a_torn_payload() -> None:
    ch = channel(1)
    stop = threading.Event()
    torn = []

    def writer() -> None:
        v = 0
        while not stop.is_set():
            v += 1
            ch.write(0, v, TensorDict(env_state=TensorDict(loc=torch.full((3,), float(v)))))
            time.sleep(0)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        end = ch.handle().open(0)
        for _ in range(300):
            _, payload = end.read()
            loc = payload["env_state", "loc"]
            if not bool((loc == loc[0]).all()):
                torn.append(loc.tolist())
    finally:
        stop.set()
        thread.join()
        ch.close()
    assert torn == []


def test_file_is_private_and_removed_on_close() -> None:
    ch = channel()
    assert os.stat(ch.path).st_mode & 0o777 == 0o600
    ch.close()
    assert not os.path.exists(ch.path)


def test_files_of_a_dead_owner_are_swept() -> None:
    code = (
        "import threading, torch, os; from tensordict import TensorDict;"
        "from envsync.transports.shared_memory import SharedMemoryChannel;"
        "ch = SharedMemoryChannel(TensorDict(x=torch.zeros(1)), 1, semaphores=[threading.Semaphore(0)]);"
        "print(ch.path, flush=True); os._exit(0)"
    )
    path = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert os.path.basename(path).startswith(PREFIX) and os.path.exists(path)
    assert path in sweep_stale(SHM_DIR)
    assert not os.path.exists(path)
