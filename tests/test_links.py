"""envsync.links: slot layout, the slot lock, acks, errors, clean-up; both links alike."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from envsync.links.local import LocalLink
from envsync.links.shared_memory import PREFIX, SHM_DIR, SharedMemoryLink, sweep_stale
from envsync.links.slots import DRAIN_EVERY
from envsync.protocol import NO_FAILURE, Kind, Reply, Request, all_settled, any_owing
from envsync.state import tensor_of

LEAVES = {
    ("config", "difficulty"): torch.tensor(0.0),
    ("config", "level"): torch.tensor(1),
    ("env_state", "loc"): torch.zeros(3),
    ("stamp", "loc"): torch.tensor(0),
}


def make(kind: str, workers: int = 2) -> Any:
    if kind == "shm":
        return SharedMemoryLink(LEAVES, workers, ctx=mp.get_context("spawn"))
    return LocalLink(LEAVES, workers)


KINDS = ["shm", "local"]


def make_rows(kind: str, rows: int) -> Any:
    """A link of the ``rows`` rows of one natively batched env (one group: one lock, one wake-up)."""
    leaves = {("config", "x"): torch.zeros(())}
    if kind == "shm":
        return SharedMemoryLink(leaves, rows, ctx=mp.get_context("spawn"), group=rows)
    return LocalLink(leaves, rows, group=rows)


@pytest.mark.parametrize("kind", KINDS)
def test_writes_reach_only_the_targeted_worker(kind: str) -> None:
    link = make(kind)
    try:
        ends = [link.handle().open(w) for w in range(2)]
        link.write(1, 5, {("config", "difficulty"): torch.tensor(0.5)})
        first = ends[0].read_header()
        assert first.version == 0 and first.config["difficulty"] == 0.0
        header = ends[1].read_header()
        assert header.version == 5 and header.config["difficulty"] == 0.5 and header.config["level"] == 1
        assert link.status(1).target == 5 and link.status(0).target == 0
    finally:
        link.close()


@pytest.mark.parametrize("kind", KINDS)
def test_env_state_loads_straight_from_the_slot_while_the_version_holds(kind: str) -> None:
    link = make(kind, 1)
    try:
        end = link.handle().open(0)
        link.write(0, 1, {("env_state", "loc"): torch.ones(3), ("stamp", "loc"): torch.tensor(1)})
        header = end.read_header()
        assert header.stamps == {"loc": 1}
        into = torch.zeros(3)
        assert end.load_entries(header.version, ["loc"], lambda name, view: into.copy_(view))
        assert into.tolist() == [1.0, 1.0, 1.0]
        link.write(0, 2, {("config", "level"): torch.tensor(7)})
        assert not end.load_entries(header.version, ["loc"], lambda name, view: into.zero_())
        assert into.tolist() == [1.0, 1.0, 1.0]
    finally:
        link.close()


@pytest.mark.parametrize("kind", KINDS)
def test_acks_and_failure_text_travel_back(kind: str) -> None:
    link = make(kind, 1)
    try:
        end = link.handle().open(0)
        assert link.status(0).failed == NO_FAILURE
        end.ack_received(3)
        end.ack_applied(2)
        assert (link.status(0).received, link.status(0).applied) == (3, 2)
        end.report_failure(4, "Traceback: boom é")
        assert link.status(0).failed == 4 and link.error_text(0) == "Traceback: boom é"
        link.notify([0])
        assert end.wait_notice(1.0) and not end.wait_notice(0.01)
    finally:
        link.close()


def settled_rule(link: Any, slots: list[int], version: int) -> Any:
    """The waiter's rule acks.py gives a link: no slot of ``slots`` owes ``version``."""
    return lambda: not any_owing(link.counts(slots, applied=True), version)


@pytest.mark.parametrize("kind", KINDS)
def test_an_ack_wakes_a_blocked_sender(kind: str) -> None:
    link = make(kind, 1)
    end = link.handle().open(0)
    try:
        timer = threading.Timer(0.05, end.ack_applied, args=(1,))
        start = time.monotonic()
        timer.start()
        assert link.wait_acks(5.0, applied=True)
        assert link.status(0).applied == 1 and time.monotonic() - start < 2.0
    finally:
        link.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_sender_waiting_on_slots_blocks_only_while_one_owes_the_version(kind: str) -> None:
    link = make(kind, 3)
    try:
        ends = [link.handle().open(w) for w in range(3)]
        for w in range(3):
            link.write(w, 1, {("config", "level"): torch.tensor(2)})
        ends[0].ack_applied(1)
        # slot 0's release is taken back (its counter shows it): slots 1 and 2 still owe
        assert not link.wait_acks(0.0, applied=True, done=settled_rule(link, [1, 2], 1))
        ends[1].ack_applied(1)
        assert link.wait_acks(0.0, applied=True)  # slot 1's release wakes a plain wait
        assert not link.wait_acks(0.0, applied=True, done=settled_rule(link, [2], 1))  # slot 2 still owes
        ends[2].ack_applied(1)
        # nobody owes version 1 any more: the wait returns at once
        assert link.wait_acks(0.0, applied=True, done=settled_rule(link, [0, 1, 2], 1))
        # a slot that failed the version owes nothing (its failure woke the sender)
        for w in range(3):
            link.write(w, 2, {("config", "level"): torch.tensor(3)})
        ends[0].ack_applied(2)
        ends[1].report_failure(2, "boom")
        assert link.wait_acks(0.0, applied=True, done=settled_rule(link, [1], 2))
        assert not link.wait_acks(0.0, applied=True, done=settled_rule(link, [1, 2], 2))
    finally:
        link.close()


@pytest.mark.parametrize("kind", KINDS)
def test_two_threads_waiting_on_one_link_are_each_woken(kind: str) -> None:
    """Threads waiting together do not take back each other's releases: each
    acknowledgement wakes one of them, and both wake."""
    link = make(kind, 2)
    writer = link  # the shared-memory link is a SlotWriter on its own table
    try:
        ends = [link.handle().open(w) for w in range(2)]
        for w in range(2):
            link.write(w, 1, {("config", "level"): torch.tensor(2)})
        woken: list[bool] = []
        rule = settled_rule(link, [0, 1], 1)
        waiters = [
            threading.Thread(target=lambda: woken.append(link.wait_acks(5.0, applied=True, done=rule))),
            threading.Thread(target=lambda: woken.append(link.wait_acks(5.0, applied=True))),
        ]
        for started, waiter in enumerate(waiters, 1):
            waiter.start()
            deadline = time.monotonic() + 5.0
            while writer._waiters < started and time.monotonic() < deadline:  # blocked in wait_acks
                time.sleep(0.005)
        ends[0].ack_applied(1)
        ends[1].ack_applied(1)
        for waiter in waiters:
            waiter.join(10.0)
        assert woken == [True, True]
    finally:
        link.close()


@pytest.mark.parametrize("kind", KINDS)
def test_reader_never_sees_a_torn_payload(kind: str) -> None:
    """A slot of many leaves, rewritten as fast as possible while read: every read sees one
    version's values throughout (leaves and target from the same write)."""
    leaves = {("config", f"x{i}"): torch.zeros(64) for i in range(16)}
    link = SharedMemoryLink(leaves, 1, ctx=mp.get_context("spawn")) if kind == "shm" else LocalLink(leaves, 1)
    stop = threading.Event()
    torn = []

    def writer() -> None:
        v = 0
        while not stop.is_set():
            v += 1
            link.write(0, v, {key: torch.full((64,), float(v)) for key in leaves})

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        end = link.handle().open(0)
        for _ in range(300):
            header = end.read_header()
            values = {float(v) for t in header.config.values() for v in tensor_of(t).unique()}
            if values != {float(header.version)} and header.version:
                torn.append((header.version, sorted(values)))
    finally:
        stop.set()
        thread.join()
        link.close()
    assert torn == []


def test_a_failed_write_is_undone_before_anyone_reads() -> None:
    link = LocalLink(LEAVES, 1)
    entries = {("config", "difficulty"): torch.tensor(0.5), ("env_state", "loc"): torch.ones(4)}  # bad shape
    with pytest.raises(ValueError, match="does not fit"):
        link.write(0, 1, entries)
    header = link.handle().open(0).read_header()
    assert header.version == 0 and header.config["difficulty"] == 0.0


def test_file_is_private_and_removed_on_close() -> None:
    link = make("shm")
    assert os.stat(link.path).st_mode & 0o777 == 0o600
    link.close()
    assert not os.path.exists(link.path)


def test_files_no_live_link_holds_are_swept_and_live_ones_kept() -> None:
    code = (
        "import multiprocessing as mp, torch, os;"
        "from envsync.links.shared_memory import SharedMemoryLink;"
        "link = SharedMemoryLink({('config', 'x'): torch.zeros(1)}, 1, ctx=mp.get_context('spawn'));"
        "print(link.path, flush=True); os._exit(0)"
    )
    path = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert os.path.basename(path).startswith(PREFIX) and os.path.exists(path)
    live = make("shm")  # creating a link sweeps too
    try:
        assert not os.path.exists(path)
        assert live.path not in sweep_stale(SHM_DIR) and os.path.exists(live.path)
    finally:
        live.close()


def test_a_killed_owners_file_and_semaphores_are_swept_while_its_forked_child_lives() -> None:
    # as when Ray kills an actor: no exit handler runs, its resource tracker dies with it, and
    # a worker it forked outlives it for a while (its output closed: run() waits for EOF)
    code = (
        "import multiprocessing as mp, torch, os, signal, time;"
        "from multiprocessing import resource_tracker;"
        "from envsync.links.shared_memory import SharedMemoryLink;"
        "link = SharedMemoryLink({('config', 'x'): torch.zeros(1)}, 2, ctx=mp.get_context('spawn'));"
        "h = link.handle(); names = [s._semlock.name for s in (*h.locks, *h.wakes, *h.acks)];"
        "child = os.fork()\n"
        "if child == 0: os.close(1); os.close(2); time.sleep(60); os._exit(0)\n"
        "os.kill(resource_tracker._resource_tracker._pid, signal.SIGKILL);"
        "print(link.path, child, *names, flush=True); os._exit(0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    path, child, names = out[0], int(out[1]), out[2:]
    semaphores = [f"{SHM_DIR}/sem.{n.lstrip('/')}" for n in names]
    try:
        # 2 slots: a lock, a wake-up and a relay each; 2 acknowledgement semaphores
        assert len(semaphores) == 8 and all(os.path.exists(p) for p in [path, *semaphores])
        assert os.path.exists(f"/proc/{child}")
        removed = sweep_stale(SHM_DIR)
        assert path in removed and set(semaphores) <= set(removed)
        assert not any(os.path.exists(p) for p in [path, *semaphores])
    finally:
        os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("kind", KINDS)
def test_a_broadcast_is_written_once_and_read_by_every_worker_until_overwritten(kind: str) -> None:
    """A value shared by every slot of the link goes once to the broadcast region."""
    link = make(kind)
    try:
        ends = [link.handle().open(w) for w in range(2)]
        stamp = {("stamp", "loc"): torch.tensor(1)}
        link.write_rows(np.arange(2), 1, {("env_state", "loc"): torch.full((3,), 7.0), **stamp}, {})
        seen = []
        for end in ends:
            assert end.load_entries(1, ["loc"], lambda name, view: seen.append(view.clone()))
        assert [t.tolist() for t in seen] == [[7.0] * 3] * 2
        link.write(1, 2, {("env_state", "loc"): torch.full((3,), 2.0), ("stamp", "loc"): torch.tensor(2)})
        own: list[torch.Tensor] = []
        assert ends[1].load_entries(2, ["loc"], lambda name, view: own.append(view.clone()))
        assert own[0].tolist() == [2.0] * 3  # its own value again, not the broadcast
        assert link.read_back(0)[("env_state", "loc")].tolist() == [7.0] * 3
        assert link.read_back(1)[("env_state", "loc")].tolist() == [2.0] * 3
    finally:
        link.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_config_takes_the_broadcast_path_and_is_copied_out_once_per_write(kind: str) -> None:
    """Config names take env state's path: one write to the region for every worker, each
    worker's own row in its slot; a worker copies a name out only when it was written since
    its last read (a big config is not copied again at every later version)."""
    link = make(kind)
    try:
        ends = [link.handle().open(w) for w in range(2)]
        link.write_rows(np.arange(2), 1, {("config", "difficulty"): torch.tensor(7.0)}, {})
        firsts = [end.read_header() for end in ends]
        assert [h.config["difficulty"] for h in firsts] == [7.0, 7.0]
        assert link.read_back(0)[("config", "difficulty")].item() == 7.0
        link.write(1, 2, {("config", "level"): torch.tensor(3)})
        again = ends[1].read_header()
        assert again.version == 2 and again.config["level"] == 3 and again.config["difficulty"] == 7.0
        assert again.config["difficulty"] is firsts[1].config["difficulty"]  # not written: not copied
        link.write(1, 3, {("config", "difficulty"): torch.tensor(2.0)})
        assert ends[1].read_header().config["difficulty"] == 2.0  # its own row, not the broadcast
        assert ends[0].read_header().config["difficulty"] == 7.0
        assert link.read_back(1)[("config", "difficulty")].item() == 2.0
    finally:
        link.close()


def test_acknowledgements_nobody_waits_for_do_not_pile_up() -> None:
    # a program that waits only for "applied" (or never) leaves every "received" release
    # untaken; past 2**31 - 1 a worker's next release would fail
    link = make("shm", 2)
    ends = [link.handle().open(w) for w in range(2)]
    pushes = 3 * DRAIN_EVERY + 5
    try:
        for version in range(1, pushes + 1):
            link.write(0, version, {})
            link.write(1, version, {})
            link.flush(version)
            for end in ends:
                end.ack_applied(version)  # one release of each kind
        # taken back at every DRAIN_EVERY-th push, before its acknowledgements: 2 workers x the
        # 6 pushes acknowledged since the last take-back (3,072nd to 3,077th), not 2 x 3,077
        assert [acks.get_value() for acks in link._acks] == [2 * 6, 2 * 6]
        # the counters, not the releases, tell a later waiter who acknowledged
        assert all_settled(link.counts([0, 1], applied=True), pushes)
        assert link.wait_acks(0.5, applied=True, done=settled_rule(link, [0, 1], pushes))
    finally:
        link.close()


def test_the_sweep_keeps_live_files_whatever_their_pid_says() -> None:
    link = SharedMemoryLink({("config", "x"): torch.zeros(1)}, 1, ctx=mp.get_context("spawn"))
    # the same name under a pid that is not running (as seen from another PID namespace)
    alias = os.path.join(SHM_DIR, "envsync-999999999-alias")
    os.link(link.path, alias)
    try:
        assert alias not in sweep_stale() and os.path.exists(alias)  # a live owner holds its lock
    finally:
        os.unlink(alias)
        link.close()


@pytest.mark.parametrize("kind", KINDS)
def test_an_end_reads_counters_as_copies_that_follow_the_sender_and_hand_out_no_table(kind: str) -> None:
    link = make(kind, 2)
    try:
        end = link.handle().open(0)
        (before,) = end.read_counters(("target",), 2)
        link.write(1, 3, {("config", "level"): torch.tensor(2)})
        (after,) = end.read_counters(("target",), 2)
        assert before.tolist() == [0, 0] and after.tolist() == [0, 3]
        after[0] = 5  # a copy: writing it changes nothing the link holds
        assert end.read_counters(("target",), 2)[0].tolist() == [0, 3] and end.target() == 0
    finally:
        link.close()


def test_a_closed_shared_memory_link_refuses_every_write_wake_and_wait() -> None:
    link = make("shm", 2)
    link.close()
    for use in (
        lambda: link.write(0, 1, {("config", "level"): torch.tensor(2)}),
        lambda: link.notify([0]),
        lambda: link.wait_acks(0.01, applied=True),
        lambda: link.handle(),
    ):
        with pytest.raises(RuntimeError, match="link is closed"):
            use()


@pytest.mark.parametrize("kind", KINDS)
def test_an_acknowledgement_of_an_older_version_never_moves_reached_back(kind: str) -> None:
    """A batched level's gate acknowledges the version it read an env reached; the env, in its
    own process, may have reached a newer one since: that one stays reached."""
    link = make(kind, 1)
    try:
        env, gate_side = link.handle().open(0).gated(wake_group=False), link.handle().open(0)
        for version in (1, 2):
            link.write(0, version, {("config", "level"): torch.tensor(version)})
        env.ack_applied(2)  # the env reached 2 ...
        gate_side.ack_applied(1)  # ... while its level acknowledged the 1 it had read
        status = link.status(0)
        assert (status.reached, status.applied) == (2, 1)
        assert gate_side.read_stamps()[0] == 2
    finally:
        link.close()


@pytest.mark.parametrize("kind", KINDS)
def test_the_rows_of_a_group_get_a_request_written_once_and_answer_it_with_one_reply(kind: str) -> None:
    """A gather of every row of a natively batched env writes its request once, in the rows'
    mailbox (each row's ``ask_at`` names the first asked: a request to 65,536 worlds touches
    one page, not one per world)
    and reads the rows' one reply back as columns, in the rows' order; a row asked alone
    reads the same way."""
    link = make_rows(kind, 6)
    try:
        rows = link.handle().open_rows(0, 6)
        request = Request(5, Kind.ATTRIBUTES, {"paths": ["mass"]})
        asked = np.array([1, 2, 4, 5])
        link.send_request(asked, request)
        counters = link.table.counters
        assert counters["ask_len"][asked].tolist() == [counters["ask_len"][1], 0, 0, 0]
        assert counters["ask_at"][asked].tolist() == [2, 2, 2, 2]  # slot 1's, for all (in the rows' mailbox)
        which, ids = rows.asked()
        assert which.tolist() == asked.tolist() and ids.tolist() == [5] * 4
        assert rows.request(4) == request
        rows.reply(which, Reply(5, {"mass": torch.tensor([1.0, 2.0, 4.0, 5.0])}))
        [(slots, reply)] = link.replies(np.array([5, 1, 4]), 5)
        assert slots.tolist() == [1, 4, 5] and reply.result["mass"].tolist() == [1.0, 4.0, 5.0]
        assert link.reply(2, 5).result["mass"].item() == 2.0  # one row, as a Ray relay reads it
    finally:
        link.close()


@pytest.mark.parametrize("kind", KINDS)
def test_the_rows_of_a_group_share_one_mailbox_not_one_per_world(kind: str) -> None:
    """The rows of one natively batched env get one error, request and reply area between
    them, sized for their rows: a link of 65,536 worlds takes ~1.3 KB of table a world (a
    mailbox per world took ~115 KB of address space, and as much of /dev/shm's file size),
    and a read of every world's value still fits its one reply."""
    worlds = 65536
    link = make_rows(kind, worlds)
    try:
        size = link.table.raw.numel()
        assert size / worlds < 2048, size / worlds
        if kind == "shm":
            assert os.path.getsize(link.path) / worlds < 2048
        rows = link.handle().open_rows(0, worlds)
        link.send_request(np.arange(worlds), Request(7, Kind.ATTRIBUTES, {"paths": ["mass"]}))
        which, _ = rows.asked()
        assert rows.request(int(which[0])) is not None
        masses = torch.arange(worlds, dtype=torch.float64)
        rows.reply(which, Reply(7, {"mass": masses}))
        [(slots, reply)] = link.replies(np.arange(worlds), 7)
        assert reply.error is None and torch.equal(reply.result["mass"], masses) and len(slots) == worlds
    finally:
        link.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_request_a_newer_one_overwrote_in_the_rows_mailbox_is_dropped_not_read_again(kind: str) -> None:
    """Two gathers to disjoint rows of one env, the first not answered before the second was
    written over it in the rows' one mailbox: the first's rows mark it answered (no reply:
    its sender gives up at its timeout) instead of decoding the other request at every safe
    point; the second is answered as usual."""
    link = make_rows(kind, 6)
    try:
        rows = link.handle().open_rows(0, 6)
        link.send_request(np.array([0, 1, 2]), Request(3, Kind.ATTRIBUTES, {"paths": ["mass"]}))
        link.send_request(np.array([3, 4]), Request(4, Kind.ATTRIBUTES, {"paths": ["mass"]}))
        which, ids = rows.asked()
        assert which.tolist() == [0, 1, 2, 3, 4] and ids.tolist() == [3, 3, 3, 4, 4]
        assert rows.request(0) is None  # the mailbox holds request 4 now
        which, ids = rows.asked()
        assert which.tolist() == [3, 4] and ids.tolist() == [4, 4]
        assert rows.request(3) == Request(4, Kind.ATTRIBUTES, {"paths": ["mass"]})
        rows.reply(which, Reply(4, {"mass": torch.tensor([3.0, 4.0])}))
        assert link.replies(np.array([0, 1, 2]), 3) == []
        [(slots, reply)] = link.replies(np.array([3, 4]), 4)
        assert slots.tolist() == [3, 4] and reply.result["mass"].tolist() == [3.0, 4.0]
    finally:
        link.close()


@pytest.mark.parametrize("kind", KINDS)
def test_rows_that_found_none_asked_see_every_request_written_after(kind: str) -> None:
    """With nothing asked, the rows' ``asked()`` reads one integer (the link's count of
    requests) until a request comes, to them or to another env's rows: none is missed, and
    one to other rows of the link is told apart by the one vector read that follows."""
    link = make_rows(kind, 6)
    try:
        rows = link.handle().open_rows(0, 3)  # rows 0-2; 3-5 another reader's
        others = link.handle().open_rows(3, 3)
        for _ in range(3):
            assert rows.asked()[0].tolist() == [] and others.asked()[0].tolist() == []
        link.send_request(np.array([4]), Request(7, Kind.ATTRIBUTES, {"paths": ["mass"]}))
        assert rows.asked()[0].tolist() == []
        which, ids = others.asked()
        assert which.tolist() == [1] and ids.tolist() == [7]
        others.reply(which, Reply(7, {"mass": torch.tensor([4.0])}))
        assert others.asked()[0].tolist() == []
        link.send_request(np.array([0, 2]), Request(8, Kind.ATTRIBUTES, {"paths": ["mass"]}))
        which, ids = rows.asked()
        assert which.tolist() == [0, 2] and ids.tolist() == [8, 8]
        assert rows.asked()[0].tolist() == [0, 2]  # still asked until answered
        rows.reply(which, Reply(8, {"mass": torch.tensor([0.0, 2.0])}))
        assert rows.asked()[0].tolist() == [] and others.asked()[0].tolist() == []
    finally:
        link.close()


@pytest.mark.parametrize("kind", KINDS)
def test_rows_that_fail_one_apply_share_one_error_text(kind: str) -> None:
    """A failure of many rows writes its traceback once, into the rows' one mailbox (each
    failed row's ``error_at`` names where: 65,536 failed worlds touch one page of /dev/shm,
    not 65,536); every row reads that text, and a later failure of one row alone writes its
    own text after it, without touching the others'."""
    link = make_rows(kind, 6)
    try:
        rows = link.handle().open_rows(0, 6)
        failed = np.array([1, 3, 4])
        text = "Traceback: the rows' apply raised"
        rows.report_failure(failed, np.array([2, 2, 2]), text)
        counters = link.table.counters
        assert counters["error_end"].tolist() == [4 + len(text), 0, 0, 0, 0, 0]  # one record, written once
        assert set(counters["error_at"][failed].tolist()) == {1} and counters["error_at"][[0, 2, 5]].tolist() == [0] * 3
        assert [link.status(w).failed for w in range(6)] == [NO_FAILURE, 2, NO_FAILURE, 2, 2, NO_FAILURE]
        assert link.error_text(0) == ""
        assert {link.error_text(w) for w in failed.tolist()} == {"Traceback: the rows' apply raised"}
        rows.report_failure(np.array([4]), np.array([3]), "Traceback: row 4 alone")
        assert link.error_text(4) == "Traceback: row 4 alone"
        assert link.error_text(1) == link.error_text(3) == "Traceback: the rows' apply raised"
    finally:
        link.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_failure_of_many_rows_reads_back_as_one_text_with_its_rows(kind: str) -> None:
    # what a Ray relay reports of its rows: each text once, with every row whose failure it is
    # (at 4,096 worlds, one traceback, not 4,096 copies of it)
    link = make_rows(kind, 6)
    try:
        rows = link.handle().open_rows(0, 6)
        rows.report_failure(np.array([0, 2, 3]), np.array([4, 4, 4]), "Traceback: one push failed")
        rows.report_failure(np.array([5]), np.array([6]), "Traceback: another")
        texts = link.error_texts(np.arange(6))
        assert [(slots.tolist(), text) for slots, text in texts] == [
            ([1, 4], ""),
            ([0, 2, 3], "Traceback: one push failed"),
            ([5], "Traceback: another"),
        ]
        assert {text: slots.tolist() for slots, text in link.error_texts(np.array([5, 3]))} == {
            "Traceback: one push failed": [3],
            "Traceback: another": [5],
        }
        assert link.alive_slots(np.arange(6)).tolist() == [True] * 6  # one process opened them all: asked once
        assert [c.tolist() for c in link.acks_columns()] == [[0, 0, 0, 0, 0, 0]] * 2 + [
            [4, -1, 4, 4, -1, 6],
            [0] * 6,
        ]
    finally:
        link.close()
