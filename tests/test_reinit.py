"""envsync.reinit: policies for stateful transforms, with real collectors and workers."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from conftest import build
from helpers import make_noisy_env, make_normed_counter_env, make_ppo_env, rows, set_gravity, start_method
from torchrl.envs import StepCounter, TransformedEnv, VecNormV2
from torchrl.envs.transforms import Transform

from envsync import EnvStateSender, ValidationError, reinit
from envsync.envs import make_drift_env
from envsync.integrations.torchrl.chain import chain_of, runner

WORKERS = 2


def sender_for(policy: reinit.Policy | None, selector: object = "ObservationNorm") -> EnvStateSender:
    rules = {} if policy is None else {selector: policy}
    return EnvStateSender(config={"scale": 1.0}, apply="set_scale", apply_at="step", reinit=rules)  # type: ignore[dict-item]


def noisy(norm: str) -> list[partial[object]]:
    return [partial(make_noisy_env, norm, label=i) for i in range(WORKERS)]


def normalised_stats(batch: torch.Tensor) -> tuple[float, float]:
    obs = batch["next", "observation"].reshape(-1, 3)
    return obs.mean().item(), obs.std().item()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["recompute", "keep"])
def test_observation_norm_recompute_restores_standard_scale(policy: str) -> None:
    sender = sender_for(reinit.recompute(num_iter=400) if policy == "recompute" else None)
    with start_method("fork"):
        collector = build("sync", sender, noisy("observation_norm"), frames_per_batch=400)
    try:
        batches = iter(collector)
        assert abs(normalised_stats(next(batches))[1] - 1.0) < 0.2
        version = sender.push(config={"scale": 10.0}, wait="applied")
        batch = next(batches)
        assert bool((batch["next", "env_version"] == version).all())
        mean, std = normalised_stats(batch)
        if policy == "recompute":
            assert abs(mean) < 0.3 and abs(std - 1.0) < 0.3
            # the statistics rollout did not leak: a fresh episode starts the batch
            for row in rows(batch):
                assert row["count"][0].item() == 0 and row["env_version"][0] == version
                assert bool((row["next", "count"].squeeze(-1).diff() == 1).all())
        else:
            assert std > 5.0
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(120)
def test_recompute_in_main_gives_every_worker_identical_statistics() -> None:
    sender = sender_for(reinit.recompute(num_iter=200, where="main"))
    with start_method("fork"):
        collector = build("sync", sender, noisy("observation_norm"), frames_per_batch=200)
    try:
        batches = iter(collector)
        next(batches)
        sender.push(config={"scale": 10.0}, wait="applied")
        probe = sender.port.probe.env  # type: ignore[union-attr]
        main_loc, main_scale = probe.transform[0].loc, probe.transform[0].scale
        assert main_scale.min() > 5.0
        for loc in collector.get_distant_attr("env.transform.transforms.0.loc"):
            assert torch.equal(loc, main_loc)
        for scale in collector.get_distant_attr("env.transform.transforms.0.scale"):
            assert torch.equal(scale, main_scale)
        mean, std = normalised_stats(next(batches))
        assert abs(mean) < 0.3 and abs(std - 1.0) < 0.3
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("norm", ["vecnorm", "vecnorm_v2"])
@pytest.mark.parametrize("policy", ["reset", "keep"])
def test_vecnorm_reset_gives_fresh_statistics(norm: str, policy: str) -> None:
    selector = "VecNormV2" if norm == "vecnorm_v2" else "VecNorm"
    sender = sender_for(reinit.reset() if policy == "reset" else reinit.keep(), selector=selector)
    with start_method("fork"):
        collector = build("sync", sender, noisy(norm), frames_per_batch=100)
    count_path = "env.transform.transforms.0._count" if norm == "vecnorm_v2" else "env.transform.transforms.0._td"
    try:
        batches = iter(collector)
        next(batches)
        before = [stats.clone() for stats in collector.get_distant_attr(count_path)]
        sender.push(config={"scale": 10.0}, wait="applied")
        after = collector.get_distant_attr(count_path)
        for stats_before, stats_after in zip(before, after, strict=True):
            counts_before = torch.cat([v.reshape(-1).float() for v in stats_before.values(True, True)])
            counts_after = torch.cat([v.reshape(-1).float() for v in stats_after.values(True, True)])
            assert counts_before.abs().sum() > 0
            if policy == "reset":
                assert counts_after.abs().sum() == 0
            else:
                assert torch.equal(counts_before, counts_after)
    finally:
        collector.shutdown()
        sender.close()


def fresh_weight(decay: float, updates: int) -> float:
    """The weight of ``updates`` updates from zero statistics, ``(1 - d**n) / (1 - d)``."""
    return (1 - decay**updates) / (1 - decay)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("norm", ["vecnorm", "vecnorm_v2"])
@pytest.mark.parametrize("policy", ["recompute", "keep"])
def test_vecnorm_recompute_gives_fresh_statistics_under_the_new_config(norm: str, policy: str) -> None:
    selector = "VecNormV2" if norm == "vecnorm_v2" else "VecNorm"
    sender = sender_for(reinit.recompute(num_iter=64) if policy == "recompute" else reinit.keep(), selector)
    with start_method("fork"):
        collector = build("sync", sender, noisy(norm), frames_per_batch=100)
    # VecNorm's float32 counts decay by float32(0.99); VecNormV2 counts whole updates
    decay = float(torch.tensor(0.99, dtype=torch.float32)) if norm == "vecnorm" else 0.99
    try:
        batches = iter(collector)
        next(batches)
        version = sender.push(config={"scale": 10.0}, wait="applied")
        moments = sender.gather(["stats.0"])["stats", "0", "observation"]
        var = moments["m2"] / moments["count"].reshape(-1, 1)
        if policy == "recompute":
            # the replayed rollout (its reset and 64 steps), then the fresh episode's reset
            for count in moments["count"].reshape(-1).tolist():
                assert count == pytest.approx(fresh_weight(decay, 66), rel=1e-5)
            assert bool((var > 50).all())  # only observations of scale 10 (variance 100)
            for row in rows(next(batches)):
                assert row["count"][0].item() == 0 and row["env_version"][0] == version
        else:
            assert bool((var < 10).all())  # mostly the scale-1 observations of the first batch
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(120)
def test_the_ppo_reference_normaliser_is_recomputed_after_each_push() -> None:
    sender = EnvStateSender(
        config={"g": 10.0}, apply=set_gravity, apply_at="step", reinit={"VecNorm": reinit.recompute(num_iter=64)}
    )
    torch.manual_seed(0)  # forked workers draw their random actions from this state
    with start_method("fork"):
        collector = build("sync", sender, make_ppo_env, frames_per_batch=2 * 50)
    collector.set_seed(0)  # and start their episodes from seeded states: the speeds below are reproducible
    decay = float(torch.tensor(0.99999, dtype=torch.float32))
    try:
        batches = iter(collector)
        next(batches)
        for g, high_speed in ((20.0, True), (1.0, False), (20.0, True)):
            version = sender.push(config={"g": g}, wait="applied")
            moments = sender.gather(["stats.0"])["stats", "0", "observation"]
            for count in moments["count"].reshape(-1).tolist():  # fresh: 64 steps and 2 resets
                assert count == pytest.approx(fresh_weight(decay, 66), rel=1e-5)
            speed_var = moments["m2"][:, 2] / moments["count"].reshape(-1)  # angular velocity
            assert bool((speed_var > 5).all()) if high_speed else bool((speed_var < 2).all())
            batch = next(batches)
            assert bool((batch["next", "env_version"] == version).all())
        sender.sync_stats("VecNorm")
        merged = sender.gather(["stats.0"])["stats", "0", "observation"]
        assert torch.equal(merged["count"][0], merged["count"][1])
        assert merged["count"][0].item() > fresh_weight(decay, 66) * 2  # both workers' observations
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(120)
def test_call_runs_once_per_applied_version_per_worker() -> None:
    sender = sender_for(reinit.call("reset_state"), selector=0)
    with start_method("fork"):
        collector = build("sync", sender, noisy("counter"))
    try:
        batches = iter(collector)
        next(batches)
        for scale in (2.0, 3.0, 4.0):
            sender.push(config={"scale": scale}, wait="applied")
            next(batches)
        sender.push(config={"scale": 5.0}, workers=[1], wait="applied")
        assert collector.get_distant_attr("env.transform.transforms.0.calls") == [3, 4]
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(120)
def test_recompute_while_iterating_keeps_trajectories_coherent() -> None:
    sender = sender_for(reinit.recompute(num_iter=100))
    with start_method("fork"):
        collector = build("async", sender, noisy("observation_norm"), frames_per_batch=100)
    try:
        for i, batch in enumerate(collector):
            if i in (2, 5):
                sender.push(config={"scale": 1.0 + i}, wait=None)
            for row in rows(batch):
                nxt = row["next", "env_version"]
                count = row["next", "count"].squeeze(-1)
                for t in range(1, len(nxt)):
                    if nxt[t] != nxt[t - 1]:
                        assert bool(row["next", "truncated"][t - 1]) and row["count"][t].item() == 0
                    elif not bool(row["next", "done"][t - 1]):
                        assert count[t] == count[t - 1] + 1
            if i > 7 and sender.versions() == [2, 2]:
                break
            assert i < 60
    finally:
        collector.shutdown()
        sender.close()


def test_bad_selectors_and_policies_are_named_in_the_main_process() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, reinit={"VecNorm": reinit.reset()})
    sender.env_fn(lambda: TransformedEnv(make_drift_env(), VecNormV2(in_keys=["observation"])))
    with pytest.raises(ValidationError, match=r"'VecNorm' matches no transform; the env has \['0: VecNormV2'\]"):
        sender.env_state_template()
    sender.close()
    sender = EnvStateSender(config={"difficulty": 0.0}, reinit={"StepCounter": reinit.recompute(8)})
    sender.env_fn(lambda: TransformedEnv(make_drift_env(), StepCounter()))
    with pytest.raises(ValidationError, match=r"StepCounter does not support recompute\(\); supported: \["):
        sender.env_state_template()
    sender.close()
    with pytest.raises(ValidationError, match="num_iter"):
        reinit.recompute(num_iter=0)
    with pytest.raises(ValidationError, match="policy from envsync.reinit"):
        EnvStateSender(config={}, reinit={"ObservationNorm": "recompute"})  # type: ignore[dict-item]


def test_register_teaches_a_new_transform() -> None:
    class Custom(Transform):
        def __init__(self) -> None:
            super().__init__()
            self.level = 5

    class Handler:
        def reset(self, transform: Custom) -> None:
            transform.level = 0

    env = TransformedEnv(make_drift_env(), Custom())
    spec = reinit.ReinitSpec.from_mapping({Custom: reinit.reset()})
    with pytest.raises(ValidationError, match="Custom does not support reset"):
        reinit.plan(chain_of(env), spec)
    reinit.register(Custom, Handler())
    steps = reinit.plan(chain_of(env), reinit.ReinitSpec.from_mapping({"Custom": reinit.reset()}))
    runner(steps)(env, 1)
    assert env.transform.level == 0


@pytest.mark.timeout(180)
def test_recompute_in_main_is_refused_for_a_built_env_and_never_touches_the_collectors_env() -> None:
    policy = {"ObservationNorm": reinit.recompute(num_iter=8, where="main")}
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step", reinit=policy)
    with pytest.raises(ValidationError, match="built TransformedEnv"):
        sender.env_fn(make_normed_counter_env())
    collector = build("single", sender, make_normed_counter_env, frames_per_batch=10)
    try:
        batches = iter(collector)
        before = next(batches)
        sender.push(config={"difficulty": 3.0}, wait="applied")  # statistics on the sender's own env
        after = next(batches)
        # the collector's env went on with its episode: no reset or rollout from the push
        assert after["observation"][0, 2] == before["next", "observation"][-1, 2]
    finally:
        collector.shutdown()
        sender.close()
