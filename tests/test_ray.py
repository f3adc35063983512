"""End to end over Ray: a two-node local cluster, real actors, one RayCollector per test."""

from __future__ import annotations

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
from conftest import RAY_STORE, off_loopback
from helpers import kill_and_wait, make_counter_env, run_to_exit
from tensordict import TensorDict, TensorDictBase

from envsync import AckTimeout, EnvStateSender, ValidationError, WorkerApplyError
from envsync.links.local import LocalLink
from envsync.links.shared_memory import PREFIX, SHM_DIR

ray = pytest.importorskip("ray")
from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector  # noqa: E402
from torchrl.collectors.distributed import RayCollector  # noqa: E402

from envsync.links import ray_relay  # noqa: E402
from envsync.links.mailbox import Held, start_mailbox  # noqa: E402
from envsync.links.ray import RayLink  # noqa: E402
from envsync.links.ray_channel import Listener, connect  # noqa: E402
from envsync.links.ray_relay import RelayHandle  # noqa: E402
from envsync.links.ray_wire import CAUGHT_UP, post  # noqa: E402
from envsync.protocol import NO_FAILURE  # noqa: E402


def apply_checked(env: Any, config: TensorDictBase) -> None:
    """A config method that rejects negative difficulties (importable by Ray workers)."""
    difficulty = float(config["difficulty"])
    if difficulty < 0:
        raise ValueError(f"difficulty {difficulty} is negative")
    env.set_difficulty(difficulty)


def short_episodes() -> Any:
    return make_counter_env(max_steps=5)


def build(sender: EnvStateSender, kind: type, *, nodes: tuple[str, ...] = ("n0", "n1"), **kwargs: Any) -> Any:
    workers = 1 if kind is Collector else 2
    return RayCollector(
        [sender.env_fn(short_episodes)] * len(nodes),
        kwargs.pop("policy", None),
        collector_class=kind,
        num_workers_per_collector=workers,
        frames_per_batch=kwargs.pop("frames_per_batch", 20 * len(nodes)),
        total_frames=10**9,
        remote_configs=[{"num_cpus": 0.25, "memory": 150 * 2**20, "resources": {n: 0.01}} for n in nodes],
        **sender.ray_kwargs(start_method="fork"),
        **kwargs,
    )


def counting_puts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    put = ray.put

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return put(*args, **kwargs)

    monkeypatch.setattr(ray, "put", counted)
    return calls


def alive_actors() -> list[Any]:
    return [a for a in ray._private.state.actors().values() if a["State"] != "DEAD"]


def orphaned_files() -> list[str]:
    """envsync files in /dev/shm whose owner process is gone (other tests' live files pass)."""
    out = []
    for name in os.listdir(SHM_DIR):
        if name.startswith(PREFIX):
            try:
                os.kill(int(name[len(PREFIX) :].split("-")[0]), 0)
            except ProcessLookupError:
                out.append(name)
    return out


def semaphores() -> set[str]:
    """The named semaphores in /dev/shm now (torchrl's fork queues unlink theirs at once)."""
    return {name for name in os.listdir(SHM_DIR) if name.startswith("sem.")}


def observed(batch: TensorDictBase) -> dict[int, set[float]]:
    """Per fleet env index, the difficulties seen in the batch's next observations."""
    flat = batch.reshape(-1)
    out: dict[int, set[float]] = {}
    for index, obs in zip(flat["env_index"].tolist(), flat["next", "observation"][:, 0].tolist(), strict=True):
        out.setdefault(index, set()).add(round(obs, 3))
    return out


@pytest.mark.timeout(60)
def test_import_envsync_never_imports_ray() -> None:
    # torchrl 0.14.1 itself imports ray whenever it is installed (torchrl.data's ray replay
    # buffer), so "ray not in sys.modules" cannot hold here: check instead that envsync
    # works with ray unimportable and loads none of its Ray modules on import
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "import envsync\n"
        "sender = envsync.EnvStateSender(config={'x': 0.0}); sender.push(config={'x': 1.0}); sender.close()\n"
        "assert not [m for m in sys.modules if m.startswith('envsync') and m.endswith('.ray')]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(MultiSyncCollector, id="sync", marks=pytest.mark.wide),  # make test keeps one kind (~9 s each)
        pytest.param(MultiAsyncCollector, id="async"),
        pytest.param(Collector, id="single", marks=pytest.mark.wide),  # a Collector's Ray cells stay in make test
    ],
)
def test_push_reaches_every_env_on_every_node_and_a_killed_actor_is_reported_dead(
    cluster: Any, kind: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    before_semaphores = semaphores()
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = build(sender, kind)
    try:
        size = 2 if kind is Collector else 4
        assert sender.num_workers == size
        assert [m.index for m in sender.fleet()] == list(range(size))
        per_collector = size // 2  # two remote collectors
        expected = [(i // per_collector, i % per_collector) for i in range(size)]
        assert [(m.collector, m.worker) for m in sender.fleet()] == expected
        link = sender.port.links()[0]
        before = [t.objects for t in link.traffic]  # the starting state's shares

        def shares() -> list[int]:
            return [t.objects - b for t, b in zip(link.traffic, before, strict=True)]

        puts = counting_puts(monkeypatch)
        version = sender.push(config={"difficulty": 0.5}, wait="applied", timeout=30)
        assert sender.versions() == [version] * size
        # one share per node, and a small one travels in the post (no object-store put)
        assert shares() == [1, 1] and not puts
        last = size - 1
        each = sender.push_each({0: {"difficulty": 0.1}, last: {"difficulty": 0.9}}, wait="applied", timeout=30)
        assert shares() == [2, 2] and not puts  # each node's own row
        assert sender.versions() == [each] + [version] * (size - 2) + [each]
        seen: dict[int, set[float]] = {}
        for i, batch in enumerate(collector):
            for index, values in observed(batch).items():
                seen.setdefault(index, set()).update(values)
            if i >= 3 and len(seen) == size:
                break
        assert seen[0] == {0.1} and seen[last] == {0.9}
        assert all(seen[w] == {0.5} for w in range(1, last))

        kill_and_wait(collector.remote_collectors[1])  # ray.kill returns before the actor is dead
        start = time.monotonic()
        with pytest.raises(AckTimeout) as info:
            sender.push(config={"difficulty": 0.4}, wait="applied", timeout=30)
        assert time.monotonic() - start < 5.0
        # the actor's env processes may outlive it for a moment, and one may still apply
        # the push: every worker of the killed actor that owes it is reported dead
        assert info.value.dead and info.value.dead == info.value.workers
        assert set(info.value.dead) <= set(range(per_collector, size))  # the second remote collector's
    finally:
        collector.shutdown()
        sender.close()
    assert orphaned_files() == [] and semaphores() - before_semaphores == set()


@pytest.mark.timeout(120)
def test_push_while_iterating_keeps_every_batch_and_policy_sync(cluster: Any) -> None:
    from tensordict.nn import TensorDictModule

    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    policy = TensorDictModule(torch.nn.Linear(3, 1), ["observation"], ["action"])
    collector = build(sender, MultiAsyncCollector, policy=policy, sync=True)
    try:
        collector.update_policy_weights_()
        version, acked_at, steps = 0, None, {}
        for i, batch in enumerate(collector):
            assert batch.numel() == 40
            flat = batch.reshape(-1)
            for index in flat["env_index"].unique().tolist():
                stream = flat[flat["env_index"] == index]
                count = stream["next", "observation"][:, 2]
                # episodes of 5 steps: the counter goes 1..5 and restarts, never skips
                assert ((count[1:] - count[:-1] == 1) | (count[1:] == 1)).all()
                steps[index] = steps.get(index, 0) + len(stream)
            if i == 1:
                version = sender.push(config={"difficulty": 0.25}, wait=None)
            if i == 2 and acked_at is None:
                sender.wait(version, until="received", timeout=10)
                acked_at = i
                collector.update_policy_weights_()  # policy sync keeps working beside envsync
            tags = batch["next", "env_version"].reshape(-1)
            # every frame shows the difficulty its tag names (0.0 before the push)
            expected = torch.tensor([0.25 if version and tag == version else 0.0 for tag in tags.tolist()])
            assert torch.equal(batch["next", "observation"][..., 0].reshape(-1), expected)
            # each actor's MultiAsyncCollector runs its workers batches ahead of the consumer:
            # the version shows within a few batches of being received
            if (i >= 4 and bool((tags == version).any())) or i >= 16:
                break
        assert bool((tags == version).any()) and acked_at == 2 and sorted(steps) == [0, 1, 2, 3]
        sender.wait(version, until="applied", timeout=30)
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(90)
def test_remote_apply_error_raises_and_rolls_back(cluster: Any) -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply=apply_checked, apply_at="step")
    collector = build(sender, MultiSyncCollector)
    try:
        good = sender.push(config={"difficulty": 0.3}, wait="applied", timeout=30)
        with pytest.raises(WorkerApplyError) as info:
            sender.push(config={"difficulty": -1.0}, workers=[3], wait="applied", timeout=30)
        assert info.value.worker == 3 and "difficulty -1.0 is negative" in info.value.remote_traceback
        assert info.value.rollback is not None
        sender.wait(info.value.rollback, until="applied", timeout=30)
        assert sender.versions()[:3] == [good] * 3
        assert float(sender.desired_config(3)["difficulty"]) == pytest.approx(0.3)
        batch = next(iter(collector))
        assert observed(batch).get(3, {0.3}) == {0.3}
    finally:
        collector.shutdown()
        sender.close()


def actor_pid(actor: Any) -> int:
    return int(ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=30))


@pytest.mark.wide  # ~8 s; make test stays under 8 minutes (CI runs it in make wide)
@pytest.mark.timeout(90)
def test_a_stalled_actor_is_late_not_dead_and_catches_up(cluster: Any) -> None:
    # a loaded machine can hold a relay's reports back for seconds: silence alone must not
    # make live workers dead (the actor is frozen here, as a starved process would be)
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = build(sender, MultiSyncCollector)
    pid = actor_pid(collector.remote_collectors[1])
    try:
        sender.push(config={"difficulty": 0.2}, wait="applied", timeout=30)
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(AckTimeout) as info:
                sender.push(config={"difficulty": 0.4}, wait="received", timeout=4.0)
            assert info.value.dead == [] and info.value.workers == [2, 3]
        finally:
            os.kill(pid, signal.SIGCONT)
        sender.wait(info.value.version, until="applied", timeout=30)
        assert sender.versions() == [info.value.version] * 4
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(MultiSyncCollector, id="sync"),
        pytest.param(MultiAsyncCollector, id="async", marks=pytest.mark.wide),  # make test keeps one kind
        pytest.param(Collector, id="single", marks=pytest.mark.wide),
    ],
)
def test_lost_node_is_reported_dead_and_shutdown_leaves_nothing(cluster: Any, kind: type) -> None:
    node = cluster.add_node(num_cpus=1, object_store_memory=RAY_STORE, resources={"n2": 1})
    before = semaphores()
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = build(sender, kind, nodes=("n0", "n2"))
    per_collector = 1 if kind is Collector else 2
    try:
        sender.push(config={"difficulty": 0.2}, wait="applied", timeout=30)
        cluster.remove_node(node)
        start = time.monotonic()
        with pytest.raises(AckTimeout) as info:
            sender.push(config={"difficulty": 0.4}, wait="applied", timeout=30)
        assert time.monotonic() - start < 5.0
        # the actor's env processes may outlive it for a moment, and one may still apply
        # the push: every worker of the killed actor that owes it is reported dead
        assert info.value.dead and info.value.dead == info.value.workers
        assert set(info.value.dead) <= set(range(per_collector, 2 * per_collector))  # the lost node's
    finally:
        collector.shutdown()
        sender.close()
    deadline = time.monotonic() + 10
    while (alive_actors() or orphaned_files() or semaphores() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    # killed actors unlink nothing themselves: their link files and semaphores are swept
    assert alive_actors() == [] and orphaned_files() == [] and semaphores() - before == set()


def local_collector(sender: EnvStateSender) -> Collector:
    """A collector in this process, attached to ``sender`` beside the Ray ones."""
    return Collector(
        sender.env_fn(short_episodes), None, frames_per_batch=10, total_frames=-1, weight_sync_schemes=sender.schemes()
    )


def two_remote_collectors(factories: list[Any], kwargs: dict[str, Any]) -> Any:
    """A RayCollector of a ``Collector`` on each node, from ``kwargs`` made earlier."""
    return RayCollector(
        factories,
        None,
        collector_class=Collector,
        frames_per_batch=20,
        total_frames=10**9,
        remote_configs=[{"num_cpus": 0.25, "memory": 150 * 2**20, "resources": {n: 0.01}} for n in ("n0", "n1")],
        **kwargs,
    )


@pytest.mark.timeout(120)
def test_ray_attaches_after_a_departed_local_collector(cluster: Any) -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    stays = local_collector(sender)
    leaves = local_collector(sender)
    leaves.shutdown()  # fleet index 1 leaves; it is not reused while index 0 lives
    collector = build(sender, MultiSyncCollector)
    try:
        fleet = [(m.index, m.collector, m.worker, m.first_env) for m in sender.fleet()]
        assert fleet == [(0, 0, 0, 0), (2, 2, 0, 2), (3, 2, 1, 3), (4, 3, 0, 4), (5, 3, 1, 5)]
        version = sender.push(config={"difficulty": 0.5}, wait="applied", timeout=30)
        assert sender.versions() == [version] * 5
        only = sender.push(config={"difficulty": 0.7}, workers=[3], wait="applied", timeout=30)
        # remote collector 1 holds fleet workers 4 and 5
        collector.update_policy_weights_(weights=TensorDict(config={"difficulty": 0.9}), model_id="env", worker_ids=[1])
        last = sender.version
        sender.wait(last, until="applied", timeout=30)
        assert sender.versions() == [version, version, only, last, last]
        seen: dict[int, set[float]] = {}
        for i, batch in enumerate(collector):
            for index, values in observed(batch).items():
                seen.setdefault(index, set()).update(values)
            if i >= 3 and len(seen) == 4:
                break
        assert seen == {2: {0.5}, 3: {0.7}, 4: {0.9}, 5: {0.9}}
        local = next(iter(stays))
        assert set(local["env_index"].tolist()) == {0} and set(local["next", "observation"][:, 0].tolist()) == {0.5}
    finally:
        collector.shutdown()
        stays.shutdown()
        sender.close()


@pytest.mark.timeout(120)
def test_ray_keeps_its_indices_when_the_last_local_collector_leaves_before_it_starts(cluster: Any) -> None:
    # ray_kwargs() numbers the remote workers before the RayCollector attaches; a collector
    # leaving in between (here the only one, after which numbering would restart at 0) must
    # not make those numbers wrong
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    local = local_collector(sender)
    local.shutdown()
    local = local_collector(sender)
    factories = [sender.env_fn(short_episodes)] * 2
    kwargs = sender.ray_kwargs(start_method="fork")
    local.shutdown()
    collector = two_remote_collectors(factories, kwargs)
    try:
        assert [(m.index, m.first_env) for m in sender.fleet()] == [(1, 1), (2, 2)]
        version = sender.push(config={"difficulty": 0.5}, workers=[2], wait="applied", timeout=30)
        assert sender.versions() == [0, version]
        seen: dict[int, set[float]] = {}
        for i, batch in enumerate(collector):
            for index, values in observed(batch).items():
                seen.setdefault(index, set()).update(values)
            if i >= 2 and len(seen) == 2:
                break
        assert seen == {1: {0.0}, 2: {0.5}}
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(120)
def test_a_collector_attached_after_ray_kwargs_makes_the_ray_collector_refused(cluster: Any) -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    factories = [sender.env_fn(short_episodes)] * 2
    kwargs = sender.ray_kwargs(start_method="fork")
    local = local_collector(sender)  # takes fleet index 0, which the remote workers carry
    try:
        with pytest.raises(ValidationError, match=r"numbered from 0.*call ray_kwargs\(\) right before"):
            two_remote_collectors(factories, kwargs)
        assert [m.index for m in sender.fleet()] == [0]
        deadline = time.monotonic() + 10
        while alive_actors() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert alive_actors() == []  # the remote collectors and the mailbox were killed
    finally:
        local.shutdown()
        sender.close()


@pytest.mark.timeout(60)
def test_the_mailbox_starts_without_torch(cluster: Any) -> None:
    # it starts beside the remote collectors' actors: importing torch there would cost the
    # main process's node seconds of CPU
    def heavy_modules(actor: Any) -> list[str]:  # local: Ray sends it by value, not by module
        return [m for m in ("torch", "tensordict", "torchrl", "envsync.sender.sender") if m in sys.modules]

    mailbox = start_mailbox()
    try:
        ray.get(mailbox.hold.remote(1, 0, [ray.put({0: (1, 0, {("config", "x"): np.ones(2)})})], [0]), timeout=30)
        assert ray.get(mailbox.__ray_call__.remote(heavy_modules), timeout=30) == []
    finally:
        ray.kill(mailbox)


@pytest.mark.timeout(60)
def test_the_mailbox_holds_a_share_until_each_of_its_relays_took_it_or_stopped(cluster: Any) -> None:
    mailbox = start_mailbox()
    try:
        waiting = mailbox.take.remote(1, 0, 0, 20.0)  # asked before it is held: waits for it
        ray.get(mailbox.hold.remote(1, 0, ["rows of post 1"], [0, 1]), timeout=30)
        assert ray.get(waiting, timeout=30) == ["rows of post 1"]
        assert ray.get(mailbox.held.remote()) == 1  # collector 1 has not taken it yet
        ray.get(mailbox.hold.remote(2, 1, ["rows of post 2"], [1, 2]), timeout=30)
        ray.get(mailbox.forget.remote(1), timeout=30)  # collector 1 shuts down
        assert ray.get(mailbox.held.remote()) == 1
        assert ray.get(mailbox.take.remote(2, 1, 2, 1.0), timeout=30) == ["rows of post 2"]
        assert ray.get(mailbox.held.remote()) == 0
        assert ray.get(mailbox.take.remote(3, 0, 0, 0.2), timeout=30) is None  # never held
    finally:
        ray.kill(mailbox)


class RecordingLink(LocalLink):
    """An in-process node link that remembers the version of every write a relay makes."""

    def __init__(self, leaves: Any, num_workers: int) -> None:
        super().__init__(leaves, num_workers)
        self.written: list[int] = []

    def write_rows(self, slots: Any, version: int, shared: Any, rows: Any, *, undo: int = 0) -> None:
        self.written.append(version)
        super().write_rows(slots, version, shared, rows, undo=undo)


@pytest.mark.timeout(60)
def test_relay_catches_up_then_writes_each_post_once_in_order(cluster: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    key = ("config", "difficulty")
    mailbox = start_mailbox()
    listener = Listener("127.0.0.1")
    node = RecordingLink({key: torch.zeros(())}, 1)
    relay = RelayHandle(listener.address, listener.token, mailbox, [1], [0]).relay(0, node)
    rows = {v: [(np.array([0]), v, 0, {key: torch.tensor(float(v))}, {})] for v in (1, 2, 3)}
    starting = threading.Thread(target=relay.start)
    starting.start()
    try:
        collector, channel = listener.accept() or (None, None)
        assert collector == 0 and channel is not None
        # what it missed: post 1 in the post itself, post 2 held by the mailbox (the way a
        # large share of a node with several relays goes)
        channel.send((1, rows[1]))
        mailbox.hold.remote(2, 0, [ray.put(rows[2])], [0])
        channel.send(post(2, Held(0)))
        channel.send(CAUGHT_UP)
        starting.join(30)
        assert node.written == [1, 2]  # start() returns once it caught up
        acks, errors, answers = channel.recv()  # its first report (no worker reads this link)
        assert acks.ravel().tolist() == [0, 0, NO_FAILURE, 1, 0, 0] and errors == [] and answers == []
        channel.send((3, rows[3]))
        # a post it cannot deliver (not rows; a held share the mailbox never got) costs that
        # post, not the next
        monkeypatch.setattr(ray_relay, "TAKE_GIVE_UP", 0.5)
        channel.send((4, "not rows"))
        channel.send(post(4, Held(0)))
        channel.send((5, [(np.array([0]), 5, 0, {key: torch.tensor(5.0)}, {})]))
        deadline = time.monotonic() + 10
        while len(node.written) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert node.written == [1, 2, 3, 5]
        assert float(node.handle().open(0).read_header().config["difficulty"]) == 5.0
        assert ray.get(mailbox.held.remote(), timeout=30) == 0  # taken, so dropped
    finally:
        relay.stop()
        listener.close()
        ray.kill(mailbox)


@pytest.mark.timeout(60)
def test_rows_travel_as_columns_and_a_report_is_read_as_columns() -> None:
    # a collector of 1,024 workers (a natively batched env's rows) takes a push of a row each
    # as one chunk of arrays, and its relay's report of them as six columns (no entry per row)
    key, count = ("config", "difficulty"), 1024
    link = RayLink({key: torch.zeros(())}, [count, 2], host="127.0.0.1")
    try:
        handle = link.handle()
        channel = connect(handle.address, handle.token, 0)
        assert channel.recv() == CAUGHT_UP  # nothing posted yet
        slots = np.arange(count)
        link.write_rows(slots, 1, {}, {key: torch.arange(count, dtype=torch.float32)})
        link.flush(1)
        seq, rows = channel.recv()  # the starting state and the push: one write of each row
        ((workers, version, undo, shared, per_row),) = rows
        assert workers.tolist() == list(range(count)) and (version, undo, shared) == (1, 0, {})
        assert isinstance(per_row[key], np.ndarray) and per_row[key].tolist() == list(range(count))
        acks = np.zeros((6, count), dtype=np.int64)
        acks[:2], acks[2], acks[3], acks[5] = 1, NO_FAILURE, 1, 1  # received, applied, failed, alive, reached
        acks[1, 7] = 0  # one row has not applied it yet
        channel.send((acks, [], []))
        deadline = time.monotonic() + 10
        while link.status(0).applied != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        target, applied, failed = link.counts(slots, applied=True)
        assert target.tolist() == [1] * count and failed.tolist() == [NO_FAILURE] * count
        assert np.flatnonzero(applied != 1).tolist() == [7]
        assert link.counts(np.array([count, count + 1]), applied=True)[0].tolist() == [0, 0]  # not pushed
        channel.close()
    finally:
        link.close()


@pytest.mark.timeout(60)
def test_a_relay_that_connects_late_gets_what_was_pushed_not_what_the_buffers_hold_now() -> None:
    # the link's frames view the pushed tensors, and the sender reuses its buffers for later
    # pushes: what waits for a relay not connected yet must be a copy (no cluster needed)
    key = ("config", "table")
    link = RayLink({key: torch.zeros(4)}, [1, 1], host="127.0.0.1")
    try:
        pushed = torch.ones(4)
        for worker in (0, 1):
            link.write(worker, 1, {key: pushed})
        link.flush(1)
        handle = link.handle()
        early = connect(handle.address, handle.token, 0)
        _, rows = early.recv()  # the starting state with push 1 on top, as one post
        # one chunk (workers, version, ...) of its own worker: the starting state and push 1, one write
        assert [(c[0].tolist(), c[1]) for c in rows] == [([0], 1)]
        assert rows[0][3][key].tolist() == [1.0] * 4
        assert early.recv() == CAUGHT_UP
        pushed.fill_(9.0)  # the buffer reused by a later push
        late = connect(handle.address, handle.token, 1)
        _, rows = late.recv()
        assert [(c[0].tolist(), c[1]) for c in rows] == [([1], 1)]
        assert rows[0][3][key].tolist() == [1.0] * 4
        assert late.recv() == CAUGHT_UP
        with pytest.raises(EOFError):  # one connection per relay: a second one is closed
            connect(handle.address, handle.token, 1).recv()
        early.close()
        late.close()
    finally:
        link.close()


RAY_EXIT_CHECK = """
import sys
import ray
from helpers import make_counter_env
from torchrl.collectors import Collector
from torchrl.collectors.distributed import RayCollector
from envsync import EnvStateSender

ray.init(address=sys.argv[1], log_to_driver=False)
print("node address:", ray.util.get_node_ip_address())
sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
collector = RayCollector(
    [sender.env_fn(make_counter_env)], None, collector_class=Collector, frames_per_batch=20,
    total_frames=10**9, remote_configs=[{"num_cpus": 0.25, "memory": 150 * 2**20, "resources": {"n0": 0.01}}],
    **sender.ray_kwargs(start_method="fork"),
)
sender.push(config={"difficulty": 1.0}, wait="applied", timeout=60)
print("link listens on:", sender.port.links()[0].handle().address[0])
print("running:", envsync_threads())
# neither the collector nor the sender is closed
"""


@pytest.mark.wide  # ~8 s; make test stays under 8 minutes (CI runs it in make wide)
@pytest.mark.timeout(180)
def test_a_program_that_never_closes_its_sender_exits_cleanly(cluster: Any) -> None:
    # the link's reading thread ends before the interpreter finalises (a daemon thread
    # stopped there while it frees a tensor aborts the process: guarantee 29)
    lines = run_to_exit(RAY_EXIT_CHECK, cluster.address)
    # it inherits this run's environment, so it too connects and listens on loopback only
    assert off_loopback([lines["node address"], lines["link listens on"]]) == []
    assert "envsync-ray-link" in lines["running"]
    assert lines["threads at exit"] == "[]"
