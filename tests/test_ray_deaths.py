"""A remote collector's death over Ray: once Ray reports its actor dead, none of its
acknowledgements count, though its process (and its relay) may outlive the report a moment.

The end-to-end scenario is a race (``ray.kill`` marks the actor dead tens of milliseconds
before its process exits); ``ENVSYNC_RAY_DEATH_REPEATS`` runs it that many times per
collector class (default 1; ``ENVSYNC_RAY_DEATH_REPEATS=30 pytest -m wide
tests/test_ray_deaths.py`` is the check it was fixed against).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import numpy as np
import pytest
import torch
from helpers import make_counter_env

from envsync import AckTimeout, EnvStateSender

ray = pytest.importorskip("ray")
from torchrl.collectors import Collector, MultiSyncCollector  # noqa: E402
from torchrl.collectors.distributed import RayCollector  # noqa: E402

from envsync.links.ray import RayLink  # noqa: E402
from envsync.links.ray_channel import Channel, connect  # noqa: E402
from envsync.links.ray_deaths import Deaths  # noqa: E402
from envsync.links.ray_wire import CAUGHT_UP  # noqa: E402
from envsync.protocol import NO_FAILURE, any_owing  # noqa: E402

REPEATS = int(os.environ.get("ENVSYNC_RAY_DEATH_REPEATS", "1"))
ALIVE, DEAD = 2, 4  # Ray's ActorTableData.ActorState values


class ViewedActor:
    """An actor handle whose state, as Ray in this process sees it, the test sets."""

    def __init__(self) -> None:
        self.state = ALIVE

    def _get_local_state(self) -> int:
        return self.state


def joined(link: RayLink, collector: int) -> Channel:
    """A relay's end of the connection, once it caught up with what was posted."""
    handle = link.handle()
    channel = connect(handle.address, handle.token, collector)
    while channel.recv() != CAUGHT_UP:
        pass
    return channel


def report(channel: Channel, received: int, applied: int) -> None:
    acks = np.array([[received], [applied], [NO_FAILURE], [1], [0], [applied]], dtype=np.int64)
    channel.send((acks, [], []))  # the acknowledgement columns of its one worker


def settle(link: RayLink, worker: int, applied: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while link.status(worker).applied != applied:
        assert time.monotonic() < deadline, f"worker {worker} never reported version {applied}"
        time.sleep(0.01)


@pytest.mark.timeout(60)
def test_a_death_is_concluded_once_from_rays_view_in_this_process() -> None:
    actors = [ViewedActor(), ViewedActor()]
    concluded: list[int] = []
    deaths = Deaths(actors, 2, on_death=concluded.append)
    assert not deaths.known(1)
    actors[1].state = DEAD
    assert deaths.known(1) and deaths.known(1) and deaths.pinged(1)
    assert not deaths.known(0) and concluded == [1]


@pytest.mark.timeout(60)
def test_a_collector_ray_reported_dead_is_posted_nothing_and_its_reports_are_dropped() -> None:
    key = ("config", "difficulty")
    actors = [ViewedActor(), ViewedActor()]
    link = RayLink({key: torch.zeros(())}, [1, 1], actors=actors, host="127.0.0.1")
    try:
        link.flush(0)
        relays = [joined(link, 0), joined(link, 1)]
        for relay in relays:
            report(relay, 0, 0)
        actors[1].state = DEAD  # its process still runs: its relay reads and reports on
        assert not link.alive(1) and link.alive(0)
        for worker in (0, 1):
            link.write(worker, 1, {key: torch.ones(())})
        link.flush(1)
        seq, rows = relays[0].recv()
        assert [w for workers, *_ in rows for w in workers.tolist()] == [0]
        relays[1].sock.settimeout(0.5)
        with pytest.raises(socket.timeout):
            relays[1].recv()
        report(relays[1], 1, 1)  # as if it had applied the push
        time.sleep(0.2)  # read first: the link reads its connections from one thread
        report(relays[0], 1, 1)
        settle(link, 0, 1)
        assert link.status(1).applied == 0 and any_owing(link.counts([1], applied=True), 1)
        for relay in relays:
            relay.close()
    finally:
        link.close()


def short_episodes() -> Any:
    return make_counter_env(max_steps=5)


def killed_and_reported_dead(actor: Any) -> None:
    """Kill ``actor`` and return once Ray fails a call to it as dead (at once, while its
    process may still run)."""
    ray.kill(actor)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=10)
        except ray.exceptions.ActorDiedError:
            return
    raise AssertionError("Ray never reported the killed actor dead")


@pytest.mark.wide
@pytest.mark.timeout(120)
@pytest.mark.parametrize("run", range(REPEATS))
@pytest.mark.parametrize("kind", [MultiSyncCollector, Collector], ids=["sync", "single"])
def test_a_push_after_ray_reports_an_actor_dead_never_counts_its_acknowledgements(
    cluster: Any, kind: type, run: int
) -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = RayCollector(
        [sender.env_fn(short_episodes)] * 2,
        None,
        collector_class=kind,
        num_workers_per_collector=1,
        frames_per_batch=40,
        total_frames=10**9,
        remote_configs=[{"num_cpus": 0.25, "memory": 150 * 2**20, "resources": {n: 0.01}} for n in ("n0", "n1")],
        **sender.ray_kwargs(start_method="fork"),
    )
    try:
        before = sender.push(config={"difficulty": 0.2}, wait="applied", timeout=30)
        killed_and_reported_dead(collector.remote_collectors[1])
        start = time.monotonic()
        with pytest.raises(AckTimeout) as info:
            sender.push(config={"difficulty": 0.4}, wait="applied", timeout=30)
        assert time.monotonic() - start < 2.0
        # worker 0 may still be applying when the dead one is found: it is late, not dead
        assert info.value.dead == [1] and info.value.workers in ([1], [0, 1])
        assert sender.versions()[1] == before
        sender.wait(info.value.version, workers=[0], timeout=30)
        time.sleep(0.5)  # the killed process has exited: whatever its relay said last has arrived
        assert sender.versions() == [info.value.version, before]
    finally:
        collector.shutdown()
        sender.close()
