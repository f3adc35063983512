"""Over Ray, on the two-node local cluster: gather, exact sync_stats, checkpoints loaded
before a RayCollector is built, the "reset" and "truncate" apply modes, and what each node
fetches and decodes per push."""

from __future__ import annotations

import time
from collections import defaultdict
from functools import partial
from typing import Any

import pytest
import torch
from helpers import kill_and_wait, make_batched_counters, make_counter_env, make_vecnorm_env, rows
from tensordict import TensorDict, TensorDictBase

from envsync import AckTimeout, EnvStateSender

ray = pytest.importorskip("ray")
from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector  # noqa: E402
from torchrl.collectors.distributed import RayCollector  # noqa: E402

from envsync.integrations.torchrl.ray import relay_traffic  # noqa: E402
from envsync.links.ray_wire import INLINE, Traffic  # noqa: E402

WORKERS = 4  # 2 nodes x a MultiSyncCollector of 2 workers


def set_spread(env: Any, config: TensorDictBase) -> None:
    """Give an OffsetNoiseEnv the observation distribution of label ``spread`` (and show it
    in the first feature): offset 3 * spread, scale 1 + spread."""
    base = env.base_env
    base.label = base.difficulty = float(config["spread"])


def set_difficulty(env: Any, config: TensorDictBase) -> None:
    env.set_difficulty(float(config["difficulty"]))


def ray_collector(
    sender: EnvStateSender,
    make_env: Any,
    *,
    kind: type = MultiSyncCollector,
    nodes: tuple[str, ...] = ("n0", "n1"),
    **kwargs: Any,
) -> Any:
    """A RayCollector of one ``kind`` per entry of ``nodes`` (pinned there), of 2 workers
    each (1 for a ``Collector``), every env built by ``make_env``."""
    return RayCollector(
        [sender.env_fn(make_env)] * len(nodes),
        None,
        collector_class=kind,
        num_workers_per_collector=1 if kind is Collector else 2,
        frames_per_batch=kwargs.pop("frames_per_batch", 20 * len(nodes)),
        total_frames=10**9,
        remote_configs=[{"num_cpus": 0.25, "memory": 150 * 2**20, "resources": {n: 0.01}} for n in nodes],
        **sender.ray_kwargs(start_method="fork"),
        **kwargs,
    )


def spread_sender() -> EnvStateSender:
    return EnvStateSender(config={"spread": 0.0}, apply=set_spread, apply_at="step")


def seen_by_vecnorm(batch: TensorDictBase, first: bool) -> dict[int, torch.Tensor]:
    """Per fleet env index, what its VecNormV2 saw in this batch: every step's observation,
    and in the first batch also the reset observation (the root of the first frame)."""
    out = {}
    for row in rows(batch):
        seen = [row["observation"][:1]] if first else []
        out[int(row["env_index"][0])] = torch.cat([*seen, row["next", "observation"]])
    return out


@pytest.mark.wide  # make wide (~5 s): its local twin runs in make test
@pytest.mark.timeout(300)
def test_sync_stats_over_two_nodes_equals_the_statistics_of_every_observation(cluster: Any) -> None:
    sender = spread_sender()
    collector = ray_collector(sender, partial(make_vecnorm_env, 0), sync=True)
    seen: list[torch.Tensor] = []
    try:
        sender.push_each({w: {"spread": float(w)} for w in range(WORKERS)}, wait="applied", timeout=60)
        batches = iter(collector)
        for sync in range(3):
            by_env = seen_by_vecnorm(next(batches), first=sync == 0)
            assert sorted(by_env) == list(range(WORKERS))
            # every worker its own distribution: feature 0 shows its spread, and its offset
            # moves the other features by 3 per worker
            assert [float(by_env[w][-1, 0]) for w in range(WORKERS)] == [0.0, 1.0, 2.0, 3.0]
            seen += by_env.values()
            sender.sync_stats("VecNormV2", timeout=60)
            x = torch.cat(seen).double()
            state = sender.gather(["stats.0"], timeout=60)["stats", "0", "observation"]
            assert state["count"].tolist() == [float(x.shape[0])] * WORKERS  # each observation once
            for worker in range(WORKERS):
                torch.testing.assert_close(state["mean"][worker].double(), x.mean(0), rtol=1e-5, atol=1e-5)
                var = (state["m2"][worker] / state["count"][worker]).double()
                torch.testing.assert_close(var, x.var(0, unbiased=False), rtol=1e-5, atol=1e-4)
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.wide  # make wide (~5 s): its local twin runs in make test
@pytest.mark.timeout(300)
def test_a_checkpoint_of_every_worker_resumes_into_a_new_ray_collector(cluster: Any) -> None:
    sender = spread_sender()
    collector = ray_collector(sender, partial(make_vecnorm_env, 0), sync=True)
    try:
        sender.push_each({w: {"spread": 0.5 * w} for w in range(WORKERS)}, wait="applied", timeout=60)
        next(iter(collector))
        state = sender.state_dict(gather=True)
    finally:
        collector.shutdown()
        sender.close()
    kept = state["worker_env_state"]["stats", "0", "observation"]
    assert kept["count"].shape == (WORKERS,) and bool((kept["count"] > 0).all())
    assert bool((kept["mean"][:, 1].diff() > 0.5).all())  # each row is its own worker's

    resumed = spread_sender()
    resumed.load_state_dict(state)  # before the RayCollector exists
    collector = ray_collector(resumed, partial(make_vecnorm_env, 0), sync=True)
    try:
        version = resumed.version
        resumed.wait(version, until="applied", timeout=60)  # the acks come through the relays
        assert resumed.versions() == [version] * WORKERS
        batch = next(iter(collector))
        stats = resumed.gather(["stats.0.observation"], timeout=60)["stats", "0", "observation"]
    finally:
        collector.shutdown()
        resumed.close()
    for row in rows(batch):
        worker = int(row["env_index"][0])
        # from its first step on, each worker runs its own checkpointed config ...
        assert row["next", "observation"][:, 0].tolist() == [0.5 * worker] * row.numel()
        assert set(row["next", "env_version"].tolist()) == {version}
        # ... on top of its own statistics: the checkpoint's, the reset after it caught up,
        # and its steps since
        assert int(stats["count"][worker]) == int(kept["count"][worker]) + 1 + row.numel()


def episodes(stream: TensorDictBase) -> list[TensorDictBase]:
    """A time-ordered stream of a CounterEnv cut into its episodes (the step count restarts)."""
    starts = [0, *(torch.nonzero(stream["observation"][1:, 2] == 0).flatten() + 1).tolist(), stream.numel()]
    return [stream[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True) if b > a]


def shown(streams: dict[int, list[TensorDictBase]], version: int) -> bool:
    """Whether every env's frames collected so far show ``version`` (the actors' collectors
    run batches ahead of the consumer: applied is not yet collected)."""
    return all(any(bool((r["next", "env_version"] == version).any()) for r in streams[e]) for e in range(WORKERS))


@pytest.mark.wide  # make wide (~4 s): make test keeps it over Ray in its model-based and matrix cells
@pytest.mark.timeout(300)
def test_reset_mode_over_ray_never_mixes_versions_in_an_episode(cluster: Any) -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply=set_difficulty, apply_at="reset")
    collector = ray_collector(sender, partial(make_counter_env, max_steps=5), kind=MultiAsyncCollector)
    difficulty = {0: 0.0}
    streams: dict[int, list[TensorDictBase]] = defaultdict(list)
    try:
        for i, batch in enumerate(collector):
            for row in rows(batch):
                streams[int(row["env_index"][0])].append(row)
            if i in (1, 3):
                version = sender.push(config={"difficulty": 0.25 * i}, timeout=60)  # received
                difficulty[version] = 0.25 * i
            if i >= 3 and shown(streams, version):
                break
            assert i < 80
    finally:
        collector.shutdown()
        sender.close()
    for parts in streams.values():
        for episode in episodes(torch.cat(parts)):
            tags = set(episode["next", "env_version"].tolist())
            assert len(tags) == 1, tags  # every step of an episode under one version ...
            (tag,) = tags
            assert set(episode["next", "observation"][:, 0].tolist()) == {difficulty[tag]}  # ... truthfully


@pytest.mark.wide  # make wide (~4 s): make test keeps it over Ray in its model-based and matrix cells
@pytest.mark.timeout(300)
def test_truncate_mode_over_ray_ends_the_running_episode_as_truncated(cluster: Any) -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply=set_difficulty, apply_at="truncate")
    collector = ray_collector(sender, make_counter_env, kind=MultiAsyncCollector)  # 1000-step episodes
    parts: dict[int, list[TensorDictBase]] = defaultdict(list)
    version = 0
    try:
        for i, batch in enumerate(collector):
            for row in rows(batch):
                parts[int(row["env_index"][0])].append(row)
            if i == 2:
                version = sender.push(config={"difficulty": 0.5}, timeout=60)
            if version and shown(parts, version):
                break
            assert i < 80
    finally:
        collector.shutdown()
        sender.close()
    truncated_in_flight = 0
    for pieces in parts.values():
        stream = torch.cat(pieces)
        nxt = stream["next", "env_version"]
        changes = (torch.nonzero(nxt[1:] != nxt[:-1]).flatten() + 1).tolist()
        assert len(changes) == 1
        (t,) = changes
        # the new version starts a fresh episode, and the old one ended as truncated unless
        # the push found the worker between two rollouts (applied while idle, no mark)
        assert stream["observation"][t, 2] == 0.0 and stream["next", "observation"][t, 0] == 0.5
        if bool(stream["next", "truncated"][t - 1]):
            assert not bool(stream["next", "terminated"][t - 1])
            truncated_in_flight += 1
        assert int(stream["next", "truncated"].sum()) <= 1  # envsync's truncation is the only one
    assert truncated_in_flight >= 1


def relays(collector: Any) -> list[Traffic]:
    """What each remote collector's relay fetched and decoded so far (collector order)."""
    return [t for _, t in ray.get([a.__ray_call__.remote(relay_traffic) for a in collector.remote_collectors])]


def per_node(nodes: list[int], before: list[Traffic], after: list[Traffic]) -> list[tuple[set[str], int, int]]:
    """Per node number, between two readings: the objects its relays fetched (ids), how many
    fetches that was, and the bytes they decoded in all."""
    out: list[tuple[set[str], int, int]] = [(set(), 0, 0) for _ in set(nodes)]
    for node, old, new in zip(nodes, before, after, strict=True):
        ids, fetches, nbytes = out[node]
        if new.objects > old.objects:
            ids.add(new.last)
        out[node] = (ids, fetches + new.objects - old.objects, nbytes + new.nbytes - old.nbytes)
    return out


@pytest.mark.timeout(300)
def test_each_node_gets_one_object_of_its_own_rows_per_push_decoded_once(cluster: Any) -> None:
    # three remote collectors, two of them on n0: those two map the same object of each push;
    # a row of the table is 128 KB, so the first push's share of n0 goes by the object store
    # (over INLINE bytes, for two relays), n1's (one relay) and the second push (a few
    # bytes) in the post itself
    table = torch.zeros(32 * 1024)
    assert table.nbytes > INLINE
    sender = EnvStateSender(config={"difficulty": 0.0, "table": table}, apply=set_difficulty, apply_at="step")
    collector = ray_collector(sender, make_counter_env, kind=Collector, nodes=("n0", "n0", "n1"))
    try:
        link = sender.port.links()[0]
        assert link.nodes == [0, 0, 1]
        per_env = TensorDict(difficulty=torch.arange(3.0), table=torch.rand(3, 32 * 1024), batch_size=[3])
        pushes = [({"config": per_env}, {0, 1, 2}), ({"config": {"difficulty": 5.0}, "envs": [2]}, {2})]
        for kwargs, targets in pushes:
            before, put_before = relays(collector), [(t.objects, t.nbytes) for t in link.traffic]
            version = sender.push(**kwargs, wait="applied", timeout=60)
            moved = per_node(link.nodes, before, relays(collector))
            put = [(t.objects - o, t.nbytes - b) for t, (o, b) in zip(link.traffic, put_before, strict=True)]
            assert [sender.versions()[e] for e in targets] == [version] * len(targets)
            for node, (ids, fetches, decoded) in enumerate(moved):
                envs = [e for e in targets if link.nodes[e] == node]  # one env per collector here
                # a node with rows in the push gets one object (the one put for it), and its
                # relays decode each byte of it once; a node without rows gets nothing
                assert put[node][0] == len(ids) == (1 if envs else 0)
                assert ids == ({link.traffic[node].last} if envs else set())
                # in the post when small or when one relay of the node has rows in it; else
                # one object in the store, which the node's relays map
                in_post = "envs" in kwargs or len(envs) == 1
                assert all(i.startswith("post-") == in_post for i in ids)
                assert fetches == len(envs) and decoded == put[node][1]
            if targets == {0, 1, 2}:  # each node only its own rows: n0 two, n1 one
                assert put[0][1] == 2 * put[1][1] > 0
        # a relay's actor dies: the share held for it and its node-mate is dropped once the
        # mate took it (Ray says it died, the mailbox forgets it), and the mate's later
        # shares travel in its posts
        kill_and_wait(collector.remote_collectors[1])
        with pytest.raises(AckTimeout) as info:
            sender.push(config=per_env, wait="applied", timeout=60)
        assert info.value.dead == [1]
        deadline = time.monotonic() + 10
        while ray.get(link.mailbox.held.remote(), timeout=30) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ray.get(link.mailbox.held.remote(), timeout=30) == 0
        version = sender.push(config=per_env.apply(lambda t: t + 1), wait=None)
        sender.wait(version, until="applied", envs=[0, 2], timeout=60)
        assert link.traffic[0].last.startswith("post-")
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("kind", "batched"),
    [
        pytest.param(MultiSyncCollector, "serial", id="sync-serial", marks=pytest.mark.wide),  # ~9 s: one in make test
        pytest.param(Collector, "parallel", id="single-parallel"),
    ],
)
def test_batched_envs_behind_a_ray_collector_take_a_row_per_env(cluster: Any, kind: type, batched: str) -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = ray_collector(sender, partial(make_batched_counters, batched, 2), kind=kind)
    try:
        per_node = 4 if kind is MultiSyncCollector else 2  # 2 workers (or 1) x 2 sub-envs
        n = sender.num_envs
        assert n == 2 * per_node
        assert [(m.collector, m.envs, m.first_env) for m in sender.fleet()] == [
            (m.index // (per_node // 2), 2, 2 * m.index) for m in sender.fleet()
        ]
        version = sender.push(config={"difficulty": torch.arange(n) / 10}, wait="applied", timeout=60)
        assert sender.env_versions() == [version] * n
        last = sender.push(config={"difficulty": 5.0}, envs=[n - 1], wait="applied", timeout=60)
        assert sender.env_versions() == [version] * (n - 1) + [last]
        seen: dict[int, set[float]] = defaultdict(set)
        for i, batch in enumerate(collector):
            for row in rows(batch):
                seen[int(row["env_index"][0])].update(round(v, 3) for v in row["next", "observation"][:, 0].tolist())
            if i >= 3 and len(seen) == n:
                break
        assert dict(seen) == {e: {round(e / 10, 3)} for e in range(n - 1)} | {n - 1: {5.0}}
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.wide  # make wide (~4 s): make test keeps it over Ray in its model-based and matrix cells
@pytest.mark.timeout(300)
def test_workers_pushes_and_reinit_over_ray(cluster: Any) -> None:
    """A push with ``workers=`` to the second node's workers only: they run the new config
    and, with ``reinit={"VecNormV2": reinit.reset()}``, start their statistics over; the
    first node's workers keep theirs and their config."""
    from envsync import reinit

    sender = EnvStateSender(
        config={"spread": 0.0}, apply=set_spread, apply_at="step", reinit={"VecNormV2": reinit.reset()}
    )
    collector = ray_collector(sender, partial(make_vecnorm_env, 0), sync=True)
    try:
        batches = iter(collector)
        for _ in range(2):
            next(batches)
        before = sender.gather(["stats.0"], timeout=60)["stats", "0", "observation", "count"].tolist()
        assert all(c > 1 for c in before)
        version = sender.push(config={"spread": 2.0}, workers=[2, 3], wait="applied", timeout=60)
        assert sender.versions() == [0, 0, version, version]
        after = sender.gather(["stats.0"], timeout=60)["stats", "0", "observation", "count"].tolist()
        assert after[:2] == before[:2]  # untouched (idle between batches)
        assert all(c <= 1 for c in after[2:])  # reset: at most the observation of the reset that follows
        shown = {int(r["env_index"][0]): float(r["next", "observation"][-1, 0]) for r in rows(next(batches))}
        assert shown == {0: 0.0, 1: 0.0, 2: 2.0, 3: 2.0}
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(300)
def test_sync_stats_of_batched_envs_over_ray(cluster: Any) -> None:
    """Two nodes, each a Collector of a SerialEnv(2) normalised at both levels: a sync of
    each level over Ray counts every observation once (each sub-env's VecNormV2: all 4
    sub-envs' observations; each batched env's: its row j over both nodes)."""
    from helpers import make_outer_normed

    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = ray_collector(sender, partial(make_outer_normed, "serial", 2), kind=Collector, sync=True)
    try:
        batches = iter(collector)
        seen: dict[int, list[torch.Tensor]] = defaultdict(list)
        for b in range(2):
            for row in rows(next(batches)):
                env = int(row["env_index"][0])
                if b == 0:
                    seen[env].append(row["observation"][:1])
                seen[env].append(row["next", "observation"])
        assert sorted(seen) == [0, 1, 2, 3]
        sender.sync_stats("VecNormV2", timeout=60)
        sender.sync_stats("batched.VecNormV2", timeout=60)
        state = sender.gather(["stats.0", "batched.stats.0"], timeout=60)
        total = sum(o.shape[0] for obs in seen.values() for o in obs)
        assert state["stats", "0", "observation", "count"].tolist() == [float(total)] * 4
        for j in range(2):
            column = sum(o.shape[0] for env in (j, 2 + j) for o in seen[env])
            assert state["batched", "stats", "0", "observation", "count"].tolist() == [float(column)] * 4
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.wide  # make wide (~5 s): its local twin runs in make test
@pytest.mark.timeout(300)
def test_the_ledger_credits_every_episode_over_ray_exactly(cluster: Any) -> None:
    """The curriculum's ledger on batches of a RayCollector (2 nodes x a MultiSyncCollector
    of 2 workers, batches of the two nodes in whatever order they come) with per-env pushes
    in reset mode: every episode is credited to exactly the config its observations show,
    none lost or counted twice, episodes spanning batches included."""
    from attribution import check_exact, collect

    from envsync.envs import make_drift_env

    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="reset")
    collector = ray_collector(sender, make_drift_env, frames_per_batch=60)
    try:
        assert sender.num_envs == WORKERS
        episodes, truth = collect(sender, collector, shown=1, batches=16, per_env=3)
    finally:
        collector.shutdown()
        sender.close()
    check_exact(episodes, truth, WORKERS)


@pytest.mark.wide  # make wide (~5 s): its local twin runs in make test
@pytest.mark.timeout(300)
def test_a_bandit_per_worker_over_ray_is_rewarded_by_the_episodes_that_ran_each_pull(cluster: Any) -> None:
    """A curriculum strategy over Ray (2 nodes x a MultiSyncCollector of 2 workers): each
    worker pulls its own arm, and each arm is rewarded exactly by the whole episodes that
    ran it, whichever node they ran on."""
    from attribution import check_bandit

    from envsync.curriculum import Bandit
    from envsync.envs import make_drift_env

    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    collector = ray_collector(sender, make_drift_env, frames_per_batch=80)
    arms = [{"difficulty": d} for d in (0.25, 0.75, 1.5)]
    bandit = Bandit(sender, arms, per="worker", reward_range=(0.0, 50.0))
    try:
        episodes = []
        for index, batch in enumerate(collector):
            episodes += bandit.observe(batch)
            if index + 1 == 30:
                break
        worker_of = {e: m.index for m in sender.fleet() for e in range(m.first_env, m.first_env + m.envs)}
    finally:
        collector.shutdown()
        sender.close()
    assert sorted(set(worker_of.values())) == [0, 1, 2, 3]
    check_bandit(bandit, arms, episodes, worker_of)
    assert {worker_of[e.env] for e in episodes if e.version > 0} == {0, 1, 2, 3}, "every worker pulled"


@pytest.mark.timeout(300)
def test_a_failure_while_answering_a_gather_over_ray_raises_from_gather_and_fails_no_version(cluster: Any) -> None:
    """The refusal travels in the relay's report: gather raises GatherError with the remote
    traceback, every env still runs the version it applied, and the next push goes on."""
    from helpers import arm_flaky_read, make_flaky_env

    from envsync import GatherError

    sender = EnvStateSender(config={"difficulty": 0.0, "fail_read": 0.0}, apply=arm_flaky_read, apply_at="step")
    collector = ray_collector(sender, make_flaky_env, sync=True)
    try:
        next(iter(collector))
        armed = sender.push(config={"difficulty": 1.0, "fail_read": 1.0}, wait="applied", timeout=60)
        with pytest.raises(GatherError) as caught:
            sender.gather(env_state=["level"], timeout=60)
        assert caught.value.worker in range(4)
        assert "transient failure reading the transform's state" in caught.value.remote_traceback
        assert sender.env_versions() == [armed] * 4
        after = sender.push(config={"difficulty": 2.0, "fail_read": 0.0}, wait="applied", timeout=60)
        assert after == armed + 1 and sender.env_versions() == [after] * 4
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(300)
def test_read_attributes_over_ray_reads_each_remote_envs_own_value(cluster: Any) -> None:
    """A request kind the Ray link never names (``Kind.ATTRIBUTES``) travels through it as
    ``gather``'s do: each env's worker, on either node, reads its own env."""
    import envsync

    sender = EnvStateSender(config={"difficulty": 0.0}, apply=envsync.apply.attributes(), apply_at="step")
    collector = ray_collector(sender, make_counter_env)
    try:
        next(iter(collector))
        values = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
        sender.push(config={"difficulty": values}, wait="applied", timeout=60)
        assert sender.read_attributes(["difficulty"], timeout=60)["difficulty"].tolist() == values.tolist()
        assert sender.read_attributes(["difficulty"], envs=[2], timeout=60)["difficulty"].tolist() == [3.0]
    finally:
        collector.shutdown()
        sender.close()
