"""Reading state back from workers: gather, exact normaliser sync, checkpoints that resume."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys
import time
from functools import partial
from typing import Any

import pytest
import torch
from conftest import build
from env_state_checks import Seen, merged_stats
from helpers import OffsetNoiseEnv, make_counter_env, make_slow_vecnorm_env, make_vecnorm_env, rows, start_method
from torchrl.envs import VecNormV2

from envsync import AckTimeout, EnvStateSender, ValidationError
from envsync.integrations.torchrl.handlers import NormStatsHandler
from envsync.reinit import register

WORKERS = 3


def reference(observations: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """float64 mean, population variance and count of every observation, computed directly."""
    x = torch.cat([o.reshape(-1, 3) for o in observations]).double()
    return x.mean(0), x.var(0, unbiased=False), x.shape[0]


def seen_by_vecnorm(batch: torch.Tensor, first: bool) -> list[torch.Tensor]:
    """What each worker's VecNormV2 saw in this batch: every step's observation, and in the
    first batch also the reset observation (the root of the first frame)."""
    out = []
    for row in rows(batch):
        if first:
            out.append(row["observation"][:1])
        out.append(row["next", "observation"])
    return out


@pytest.mark.timeout(120)
def test_sync_stats_is_exact_over_rounds_and_counts_nothing_twice() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method("fork"):
        collector = build("sync", sender, [partial(make_vecnorm_env, i) for i in range(WORKERS)], frames_per_batch=30)
    observations: list[torch.Tensor] = []
    try:
        batches = iter(collector)
        for sync in range(5):
            for b in range(2):
                observations += seen_by_vecnorm(next(batches), first=sync == 0 and b == 0)
            sender.sync_stats("VecNormV2")
            mean, var, count = reference(observations)
            state = sender.gather(["stats.0"])["stats", "0", "observation"]
            for worker in range(WORKERS):
                assert state["count"][worker].item() == count  # every observation once, no more
                torch.testing.assert_close(state["mean"][worker], mean, rtol=1e-5, atol=1e-5)
                var_w = state["m2"][worker] / state["count"][worker]
                torch.testing.assert_close(var_w, var, rtol=1e-5, atol=1e-5)
    finally:
        collector.shutdown()
        sender.close()


def decayed_reference(
    previous: tuple[float, torch.Tensor, torch.Tensor], new: list[torch.Tensor], decay: float, whole: bool = True
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """The definition of a sync with forgetting, computed directly from raw observations:
    the last merge (as stored) aged by ``decay ** n`` plus every worker's ``n`` new observations,
    the k-th of them weighing ``decay ** (n - k)``; then, ``whole`` (VecNormV2), stored as a
    whole number of updates (weight capped at 1 / (1 - decay)); else (VecNorm) as it is.
    Returns (weight, mean, population variance)."""
    weight, mean, var = previous
    n = new[0].shape[0]
    ages = decay ** torch.arange(n - 1, -1, -1, dtype=torch.float64)
    weights = torch.cat([ages] * len(new))
    x = torch.cat(new).double()
    old = weight * decay**n
    total = old + weights.sum()
    merged_mean = (old * mean + (weights[:, None] * x).sum(0)) / total
    m2 = old * (var + (mean - merged_mean) ** 2) + (weights[:, None] * (x - merged_mean) ** 2).sum(0)
    if not whole:
        return float(total), merged_mean, m2 / total
    mass = (1 - decay) * total
    most = math.ceil(math.log(2.0**-53) / math.log(decay))
    updates = most if mass >= 1 else min(round(math.log1p(-mass) / math.log(decay)), most)
    stored = (1 - decay**updates) / (1 - decay)
    return stored, merged_mean, m2 / total


@pytest.mark.timeout(120)
def test_sync_stats_with_forgetting_follows_its_definition() -> None:
    decay = 0.98
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method("fork"):
        envs = [partial(make_vecnorm_env, i, decay) for i in range(WORKERS)]
        collector = build("sync", sender, envs, frames_per_batch=10 * WORKERS)
    reference = (0.0, torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64))
    try:
        batches = iter(collector)
        for sync in range(4):
            batch = next(batches)
            new = [o.reshape(-1, 3) for o in _per_worker(batch, first=sync == 0)]
            sender.sync_stats("VecNormV2")
            reference = decayed_reference(reference, new, decay)
            state = sender.gather(["stats.0"])["stats", "0", "observation"]
            for worker in range(WORKERS):
                torch.testing.assert_close(state["count"][worker].item(), reference[0], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(state["mean"][worker], reference[1], rtol=1e-4, atol=1e-4)
                var = state["m2"][worker] / state["count"][worker]
                torch.testing.assert_close(var, reference[2], rtol=1e-4, atol=1e-4)
    finally:
        collector.shutdown()
        sender.close()


FLOAT32_DECAY = {d: float(torch.tensor(d, dtype=torch.float32)) for d in (0.99999, 0.98)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("decay", [0.99999, 0.98])
def test_sync_stats_of_vecnorm_v1_with_forgetting_follows_its_definition(decay: float) -> None:
    # torchrl's PPO reference normaliser (0.99999); with 0.98 the merged weight passes the
    # count's limit 1 / (1 - decay) = 50 on its way to 3 workers x 50
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method("fork"):
        envs = [partial(make_vecnorm_env, i, decay, True) for i in range(WORKERS)]
        collector = build("sync", sender, envs, frames_per_batch=10 * WORKERS)
    applied = FLOAT32_DECAY[decay]  # VecNorm's float32 counts decay by float32(decay)
    reference = (0.0, torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64))
    try:
        batches = iter(collector)
        for sync in range(5):
            batch = next(batches)
            new = [o.reshape(-1, 3) for o in _per_worker(batch, first=sync == 0)]
            sender.sync_stats("VecNorm")
            reference = decayed_reference(reference, new, applied, whole=False)
            state = sender.gather(["stats.0"])["stats", "0", "observation"]
            for worker in range(WORKERS):
                torch.testing.assert_close(state["count"][worker].item(), reference[0], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(state["mean"][worker], reference[1], rtol=1e-4, atol=1e-4)
                var = state["m2"][worker] / state["count"][worker]
                torch.testing.assert_close(var, reference[2], rtol=1e-4, atol=1e-4)
    finally:
        collector.shutdown()
        sender.close()


def _per_worker(batch: torch.Tensor, first: bool) -> list[torch.Tensor]:
    """Each worker's observations in the order its normaliser saw them."""
    out = []
    for row in rows(batch):
        seen = [row["observation"][:1]] if first else []
        out.append(torch.cat([*seen, row["next", "observation"]]))
    return out


@pytest.mark.timeout(120)
def test_gather_while_iterating_drops_no_batch_and_answers_within_a_batch() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method("fork"):
        collector = build("async", sender, [partial(make_vecnorm_env, i) for i in range(2)], frames_per_batch=50)
    last: dict[int, int] = {}
    try:
        started = time.monotonic()
        batch_times = []
        for i, batch in enumerate(collector):
            batch_times.append(time.monotonic() - started)
            started = time.monotonic()
            for row in rows(batch):
                counts = row["count"].reshape(-1)
                worker = int(row["env_index"][0])
                if worker in last:  # the root of a batch's first frame is the last frame's next
                    assert int(counts[0]) == last[worker], "a batch was dropped or duplicated"
                assert bool((counts.diff() == 1).all())
                last[worker] = int(row["next", "count"].reshape(-1)[-1])
            if i in (3, 6):
                start = time.monotonic()
                state = sender.gather(["stats.0.observation.count", "transforms.0"])
                took = time.monotonic() - start
                assert state.batch_size == torch.Size([2])
                assert (state["stats", "0", "observation", "count"] > 0).all()
                assert took < 2 * max(batch_times) + 0.5, (took, batch_times)
            if i >= 9:
                break
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(180)
def test_a_checkpoint_resumes_in_a_new_process(tmp_path: pathlib.Path) -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method("fork"):
        collector = build("sync", sender, [partial(make_vecnorm_env, i) for i in range(2)], frames_per_batch=20)
    try:
        batches = iter(collector)
        next(batches)
        sender.push_each({0: {"difficulty": 0.25}, 1: {"difficulty": 0.75}}, wait="applied")
        next(batches)
        sender.sync_stats("VecNormV2")
        next(batches)  # the workers see more after the sync: their own state differs again
        state = sender.state_dict(gather=True)
        expected = state["worker_env_state"]["stats", "0", "observation"]
    finally:
        collector.shutdown()
        sender.close()
    path = tmp_path / "checkpoint.pt"
    torch.save(state, path)
    tests = pathlib.Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": f"{tests}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, str(tests / "resume_check.py"), str(path)]
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = json.loads(out.stdout.strip().splitlines()[-1])
    assert resumed["difficulty"] == [0.25, 0.75]  # each worker's first frame, its own config
    # each worker's statistics are the checkpoint's, plus what it saw since: the reset after it
    # caught up, and its 2 steps of the first batch (4 frames over 2 workers)
    assert [c - 3 for c in resumed["count"]] == expected["count"].tolist()


def test_bad_gathers_and_syncs_are_refused() -> None:
    with EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty") as sender:
        sender.env_fn(make_counter_env)
        with pytest.raises(ValidationError, match="gather needs an attached collector"):
            sender.gather()
        with pytest.raises(ValidationError, match="no selected transform keeps statistics"):
            sender.sync_stats("ObservationNorm")
    register(AgelessNorm, AgelessHandler())
    with EnvStateSender(config={}) as sender:
        sender.env_fn(make_ageless_env)
        with pytest.raises(ValidationError, match="decay=0.99 but its handler tells neither its updates"):
            sender.sync_stats("AgelessNorm")
        with pytest.raises(ValidationError, match="'transforms.7' names no entry"):
            sender.gather(["transforms.7"])


class AgelessNorm(VecNormV2):
    """A forgetting normaliser whose handler exports its moments but not its updates."""


class AgelessHandler(NormStatsHandler):
    def export(self, transform: Any) -> dict[str, torch.Tensor]:
        return {k: v for k, v in super().export(transform).items() if not k.endswith(".updates")}


def make_ageless_env() -> Any:
    from torchrl.envs import Compose, TransformedEnv

    return TransformedEnv(OffsetNoiseEnv(0), Compose(AgelessNorm(in_keys=["observation"], decay=0.99)))


@pytest.mark.timeout(60)
def test_a_late_worker_starts_from_the_merged_statistics() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method("fork"):
        first = build("sync", sender, [partial(make_vecnorm_env, i) for i in range(2)], frames_per_batch=20)
    try:
        next(iter(first))
        sender.sync_stats("VecNormV2")
        merged = sender.gather(["stats.0.observation.count"])["stats", "0", "observation", "count"][0].item()
        late = build("single", sender, partial(make_vecnorm_env, 2), frames_per_batch=4)
        try:
            count = sender.gather(["stats.0.observation.count"], workers=[2])["stats", "0", "observation", "count"]
            assert count.item() >= merged  # started from the merge (plus its own reset)
        finally:
            late.shutdown()
    finally:
        first.shutdown()
        sender.close()


@pytest.mark.timeout(60)
def test_a_per_worker_checkpoint_needs_as_many_workers() -> None:
    source = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    state = source.state_dict()
    state["config"] = torch.stack([state["config"], state["config"]])  # two worker rows
    source.close()
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    sender.load_state_dict(state)
    try:
        message = "the checkpoint has 2 worker configs; the collector has 3 workers"
        with pytest.raises(ValidationError, match=message), start_method("fork"):
            build("sync", sender, [partial(make_counter_env, i) for i in range(3)])
    finally:
        sender.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_sync_stats_in_reset_mode_returns_and_counts_every_observation_once(kind: str) -> None:
    """Default apply_at="reset": a sync returns once every worker has the merge armed (it is
    applied at each env's next reset, on top of what the env saw since the gather); the merge
    counts every observation once, round after round."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    makers = [partial(make_slow_vecnorm_env, i, horizon=7) for i in range(2)]
    with start_method("fork"):
        collector = build(kind, sender, makers, frames_per_batch=20)
    seen = Seen()
    try:
        batches = iter(collector)
        for _ in range(4):
            for _ in range(2):
                seen.add(next(batches))
            if kind == "async":  # workers run on: count what they saw up to the gather below
                break
            sender.sync_stats("VecNormV2", timeout=20.0)
            count, mean = seen.count_mean()
            merged_count, merged_mean = merged_stats(sender)
            assert merged_count == count, "an observation counted twice, or lost"
            torch.testing.assert_close(merged_mean, mean, rtol=1e-5, atol=1e-5)
        if kind == "async":
            version = sender.sync_stats("VecNormV2", timeout=20.0)
            assert sender.version == version
            merged_count, _ = merged_stats(sender)
            assert merged_count >= seen.count_mean()[0]
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(180)
def test_a_sync_that_times_out_counts_nothing_twice_in_the_next() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0, "delay": 0.0}, apply="set_difficulty", apply_at="step")
    makers = [partial(make_slow_vecnorm_env, i) for i in range(2)]
    with start_method("fork"):
        collector = build("sync", sender, makers, frames_per_batch=20)
    seen = Seen()
    try:
        batches = iter(collector)
        seen.add(next(batches))
        sender.push(config={"delay": 1.5}, wait="applied", timeout=20.0)  # every apply now takes 1.5 s
        seen.add(next(batches))
        with pytest.raises(AckTimeout):
            sender.sync_stats("VecNormV2", timeout=0.5)
        sender.push(config={"delay": 0.0}, wait="applied", timeout=20.0)
        seen.add(next(batches))
        sender.sync_stats("VecNormV2", timeout=20.0)
        count, mean = seen.count_mean()
        merged_count, merged_mean = merged_stats(sender)
        assert merged_count == count, "the timed-out sync's observations were counted again"
        torch.testing.assert_close(merged_mean, mean, rtol=1e-5, atol=1e-5)
    finally:
        collector.shutdown()
        sender.close()
