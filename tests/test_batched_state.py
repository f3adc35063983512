"""Env state of batched envs, end to end with real collectors, workers and sub-processes:
``gather``, ``sync_stats`` and checkpoints reach every sub-env, the batched env's own
transforms (``batched.*``) are addressed once per worker, and a natively batched env takes
env state by rows and as a whole.

Sub-env ``e`` (its fleet index) is an OffsetNoiseEnv labelled ``e``: its observations have
mean ``3 e`` (dims 1 and 2) and are normalised by a VecNormV2 of its own; each
``SerialEnv``/``ParallelEnv`` carries a VecNormV2 of its own on top (the batched level).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import make_native_normed, make_outer_normed, rows, start_method
from tensordict import TensorDict
from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector

from envsync import EnvStateSender, ValidationError, reinit

pytestmark = pytest.mark.timeout(240)

N = 2  # sub-envs per worker

# name -> (collector class, workers, batched kind, apply mode)
SETUPS = {
    "single-serial-step": (Collector, 1, "serial", "step"),
    "single-parallel-truncate": (Collector, 1, "parallel", "truncate"),
    "async-serial-step": (MultiAsyncCollector, 2, "serial", "step"),
    "sync-parallel-reset": (MultiSyncCollector, 2, "parallel", "reset"),
}


def build(cls: Any, workers: int, kind: str, sender: EnvStateSender, frames: int) -> Any:
    factories = [sender.env_fn(functools.partial(make_outer_normed, kind, N, w * N)) for w in range(workers)]
    with start_method("fork"):
        return cls(
            factories[0] if cls is Collector else factories,
            None,
            frames_per_batch=frames,
            total_frames=-1,
            weight_sync_schemes=sender.schemes(),
        )


@pytest.fixture(scope="module", params=list(SETUPS))
def fleet(request: pytest.FixtureRequest) -> Iterator[tuple[str, EnvStateSender, Iterator[Any]]]:
    cls, workers, kind, mode = SETUPS[request.param]
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at=mode)
    collector = build(cls, workers, kind, sender, frames=20 * workers * N)
    it = iter(collector)
    next(it)
    yield request.param, sender, it
    collector.shutdown()
    sender.close()


def test_the_template_spells_both_levels(fleet: Any) -> None:
    _, sender, _ = fleet
    keys = sender.env_state_template().keys
    assert "transforms.0._extra_state.count.-|-.observation" in keys  # one sub-env's own
    assert "batched.transforms.0._extra_state.count.-|-.observation" in keys  # the batched env's
    assert "stats.0.observation.mean" in keys and "batched.stats.0.observation.mean" in keys


def test_gather_reads_every_sub_env_and_each_batched_env_once(fleet: Any) -> None:
    """One row per env: each sub-env's own statistics (mean 3 e for env e), and the
    batched env's own, the same in every row of a worker and different between workers."""
    setup, sender, _ = fleet
    workers = SETUPS[setup][1]
    state = sender.gather(["stats.0", "batched.stats.0"])
    assert state.batch_size == torch.Size([workers * N])
    own = state["stats", "0", "observation"]
    whole = state["batched", "stats", "0", "observation"]
    for env in range(workers * N):
        assert own["count"][env] > 10
        torch.testing.assert_close(
            own["mean"][env][1:], torch.full((2,), 3.0 * env, dtype=torch.float64), atol=2.0 + 2 * env, rtol=0
        )
        head = env - env % N
        torch.testing.assert_close(whole["mean"][env], whole["mean"][head])
        # the batched env's own normaliser has a row per sub-env: row j is sub-env head + j
        assert abs(float(whole["mean"][env][env % N][1]) - 3.0 * env) < 2.0 + 2 * env
    torch_keys = sender.gather(["batched.transforms.0._extra_state"])
    assert torch_keys["batched", "transforms.0._extra_state", "loc.-|-.observation"].shape == (workers * N, N, 3)
    sub = sender.gather(["stats.0"], envs=[1])
    assert sub.batch_size == torch.Size([1])


def test_a_push_of_the_batched_level_reaches_every_worker_and_only_that_level(fleet: Any) -> None:
    setup, sender, it = fleet
    workers = SETUPS[setup][1]
    key = "batched.transforms.0._extra_state.count.-|-.observation"
    with pytest.raises(ValidationError, match="target whole workers"):
        sender.push(env_state={key: torch.tensor(7)}, envs=[0])
    own_before = sender.gather(["transforms.0._extra_state.count.-|-.observation"])
    version = sender.push(env_state={key: torch.tensor(10**6)}, workers=[workers - 1], wait="received")
    sender.wait(version, until="received")
    count = sender.gather([key])["batched", "transforms.0._extra_state", "count.-|-.observation"]
    if SETUPS[setup][3] == "reset":  # the sub-envs never reset: the worker has not applied it
        assert count.lt(10**6).all()
    else:
        sender.wait(version, until="applied")
        count = sender.gather([key])["batched", "transforms.0._extra_state", "count.-|-.observation"]
        assert count[-N:].ge(10**6).all() and count[:-N].lt(10**6).all()
        next(it)
    own = sender.gather(["transforms.0._extra_state.count.-|-.observation"])
    assert (
        own["transforms.0._extra_state", "count.-|-.observation"]
        .ge(own_before["transforms.0._extra_state", "count.-|-.observation"])
        .all()
    )
    assert own["transforms.0._extra_state", "count.-|-.observation"].lt(10**6).all()


def test_a_checkpoint_gathers_both_levels(fleet: Any) -> None:
    setup, sender, _ = fleet
    state = sender.state_dict(gather=True)
    rows_ = state["worker_env_state"]
    assert rows_.batch_size == torch.Size([SETUPS[setup][1] * N])
    assert ("batched", "stats", "0", "observation", "count") in rows_.keys(True, True)
    assert ("stats", "0", "observation", "count") in rows_.keys(True, True)


# ---- sync_stats: both levels merged exactly, over several rounds -----------------------


def reference(observations: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.cat(observations).double()
    return x.mean(0), x.var(0, unbiased=False)


@pytest.mark.timeout(300)
def test_sync_stats_merges_each_level_exactly_across_workers() -> None:
    """3 workers, each a TransformedEnv(ParallelEnv(2 sub-envs), VecNormV2): after each round,
    every sub-env's own VecNormV2 holds the statistics of every raw observation of all 6
    sub-envs, and every batched env's VecNormV2 holds, for its row j, those of sub-env j of
    every worker (float64 reference; nothing counted twice)."""
    workers = 3
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = build(MultiSyncCollector, workers, "parallel", sender, frames=10 * workers * N)
    seen: dict[int, list[torch.Tensor]] = {e: [] for e in range(workers * N)}
    try:
        it = iter(collector)
        for round_ in range(3):
            for b in range(2):
                for row in rows(next(it)):
                    env = int(row["env_index"][0])
                    if round_ == 0 and b == 0:
                        seen[env].append(row["observation"][:1])  # the reset's observation
                    seen[env].append(row["next", "observation"])
            sender.sync_stats("VecNormV2")
            sender.sync_stats("batched.VecNormV2")
            state = sender.gather(["stats.0", "batched.stats.0"])
            everything = [o for env_obs in seen.values() for o in env_obs]
            mean, var = reference(everything)
            own = state["stats", "0", "observation"]
            for env in range(workers * N):
                assert own["count"][env].item() == sum(o.shape[0] for o in everything)
                torch.testing.assert_close(own["mean"][env], mean, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(own["m2"][env] / own["count"][env], var, rtol=1e-5, atol=1e-4)
            whole = state["batched", "stats", "0", "observation"]
            for j in range(N):
                column = [o for w in range(workers) for o in seen[w * N + j]]
                mean_j, var_j = reference(column)
                for env in range(workers * N):
                    # one update of the batched normaliser per batched step: as many as sub-env j's frames
                    assert whole["count"][env].item() == sum(o.shape[0] for o in column)
                    torch.testing.assert_close(whole["mean"][env][j], mean_j, rtol=1e-5, atol=1e-5)
                    var_env = whole["m2"][env][j] / whole["count"][env]
                    torch.testing.assert_close(var_env, var_j, rtol=1e-5, atol=1e-4)
    finally:
        collector.shutdown()
        sender.close()


# ---- checkpoints: resume in both orders ---------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize("order", ["load-then-build", "build-then-load"])
def test_a_checkpoint_resumes_every_sub_env_and_each_batched_env(order: str) -> None:
    """A checkpoint gathered from 2 workers of SerialEnv(2) resumes in a new sender: each
    sub-env starts from its own statistics, each batched env from its own."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = build(MultiSyncCollector, 2, "serial", sender, frames=10 * 2 * N)
    try:
        it = iter(collector)
        next(it)
        sender.sync_stats("batched.VecNormV2")
        next(it)
        checkpoint = sender.state_dict(gather=True)
    finally:
        collector.shutdown()
        sender.close()
    saved = checkpoint["worker_env_state"]
    resumed = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    if order == "load-then-build":
        resumed.load_state_dict(checkpoint)
    again = build(MultiSyncCollector, 2, "serial", resumed, frames=10 * 2 * N)
    try:
        if order == "build-then-load":
            version = resumed.load_state_dict(checkpoint)
            resumed.wait(version, until="applied")
        state = resumed.gather(["stats.0", "batched.stats.0"])
        # resumed before the workers start, each catches up and then starts a fresh episode:
        # its normalisers also see that reset's observation
        extra = 1 if order == "load-then-build" else 0
        for key in (("stats", "0", "observation"), ("batched", "stats", "0", "observation")):
            torch.testing.assert_close(state[key]["count"], saved[key]["count"] + extra)
            tolerance = 1e-5 if not extra else 1.0
            torch.testing.assert_close(state[key]["mean"], saved[key]["mean"], rtol=0, atol=tolerance)
        assert not state["batched", "stats", "0", "observation", "mean"][0].equal(
            state["batched", "stats", "0", "observation", "mean"][N]
        ), "each worker's batched env has its own statistics"
        assert "batched_stats" in checkpoint
        next(iter(again))
        resumed.sync_stats("batched.VecNormV2")  # the restored book counts nothing twice
    finally:
        again.shutdown()
        resumed.close()


# ---- reinit at the batched level; what is refused -----------------------------------------


@pytest.mark.timeout(120)
def test_reinit_resets_the_batched_env_own_normaliser_once_the_worker_applied() -> None:
    sender = EnvStateSender(
        config={"difficulty": 0.0},
        apply="set_difficulty",
        apply_at="step",
        reinit={"batched.VecNormV2": reinit.reset()},
    )
    collector = build(Collector, 1, "parallel", sender, frames=20)
    try:
        it = iter(collector)
        next(it)
        key = "batched.stats.0"
        before = sender.gather([key, "stats.0"])
        version = sender.push(config={"difficulty": 1.0}, wait="applied")
        batch = next(it)
        assert batch["next", "env_version"].eq(version).all()
        after = sender.gather([key, "stats.0"])
        assert (
            after["batched", "stats", "0", "observation", "count"][0]
            < before["batched", "stats", "0", "observation", "count"][0]
        )
        assert after["stats", "0", "observation", "count"].gt(before["stats", "0", "observation", "count"]).all()
    finally:
        collector.shutdown()
        sender.close()


def test_what_cannot_work_is_refused_at_attach_with_the_reason() -> None:
    moving = EnvStateSender(
        config={"difficulty": 0.0}, apply="set_difficulty", reinit={"batched.VecNormV2": reinit.recompute(8)}
    )
    with pytest.raises(ValidationError, match="step every sub-env at once"):
        moving.env_fn(functools.partial(make_outer_normed, "serial", N))()
    moving.close()
    from helpers import make_vecnorm_env

    plain = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", reinit={"batched.0": reinit.keep()})
    plain.env_fn(make_vecnorm_env)
    with pytest.raises(ValidationError, match="not batched"):
        plain.env_state_template()
    plain.close()
    rows_only = EnvStateSender(
        config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step", reinit={"ObservationNorm": reinit.reset()}
    )
    with pytest.raises(ValidationError, match="share its transforms"):
        rows_only.env_fn(make_native_normed(N))
    rows_only.close()


# ---- a natively batched env takes env state: its rows, and the whole env's -----------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2], ids=["collector", "sync-fork"])
def test_a_native_env_takes_rows_of_its_state_and_the_whole_of_it(workers: int) -> None:
    """Row ``e`` of a natively batched env takes its own row of the env's ObservationNorm; the
    env's transform as a whole takes ``batched.*`` (in a Collector, and in each worker)."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    if workers:
        factories = [sender.env_fn(functools.partial(make_native_normed, N, w * N)) for w in range(workers)]
        with start_method("fork"):
            collector: Any = MultiSyncCollector(
                factories,
                None,
                frames_per_batch=10 * N * workers,
                total_frames=-1,
                weight_sync_schemes=sender.schemes(),
            )
    else:
        collector = Collector(
            sender.env_fn(make_native_normed(N)),
            None,
            frames_per_batch=10 * N,
            total_frames=-1,
            weight_sync_schemes=sender.schemes(),
        )
    try:
        it = iter(collector)
        next(it)
        assert sorted(sender.env_state_template().keys) == [
            "batched.loc",
            "batched.scale",
            "batched.standard_normal",
            "loc",
            "scale",
        ]
        envs = sender.num_envs
        sender.push(env_state={"loc": torch.tensor([0.0, 5.0, 0.0])}, envs=[1], wait="applied")
        for row in rows(next(it)):
            env = int(row["env_index"][0])
            shifted = row["next", "observation"] - row["next", "observation_norm"]
            assert shifted.eq(torch.tensor([0.0, 5.0 if env == 1 else 0.0, 0.0])).all(), env
        state = sender.gather(["loc", "batched.loc"])
        assert state["loc"][1].tolist() == [0.0, 5.0, 0.0] and state["loc"][0].eq(0).all()
        for env in range(envs):  # the whole env's state: its worker's, in every row
            assert state["batched", "loc"][env].equal(state["batched", "loc"][env - env % N])
            assert state["batched", "loc"][env][env % N].equal(state["loc"][env])
        whole = TensorDict({"batched": {"scale": torch.full((N, 3), 2.0)}})
        sender.push(env_state=whole, workers=[0], wait="applied")
        for row in rows(next(it)):
            env = int(row["env_index"][0])
            normed = (row["next", "observation"] - state["loc"][env]) / (2.0 if env < N else 1.0)
            torch.testing.assert_close(row["next", "observation_norm"], normed)
    finally:
        collector.shutdown()
        sender.close()
