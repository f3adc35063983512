"""An env outside any collector (an evaluation env driven by ``env.rollout``) in the fleet."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from conftest import build
from helpers import (
    check_truthful,
    make_batched_counters,
    make_counter_env,
    make_ppo_env,
    make_vecnorm_env,
    rows,
    set_gravity,
    start_method,
)

from envsync import EnvStateSender, ValidationError, reinit
from envsync.envs import make_drift_env

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

TAGS = ("env_version", ("next", "env_version"), "env_index", ("next", "env_index"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("apply_at", ["reset", "step"])
def test_an_evaluation_env_joins_after_the_collectors_and_follows_pushes(apply_at: str) -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at=apply_at)
    with start_method("fork"):
        collector = build("sync", sender, [partial(make_counter_env, i) for i in range(2)], frames_per_batch=20)
    test_env = make_counter_env(label=9)
    try:
        next(iter(collector))
        assert sender.attach_env(test_env) == 2  # after the collector's two envs
        assert [m.first_env for m in sender.fleet()] == [0, 1, 2]
        first = test_env.rollout(4)
        assert all(first[key].tolist() == [0] * 4 for key in TAGS[:2])
        version = sender.push(config={"difficulty": 0.5}, wait="applied" if apply_at == "step" else "received")
        second = test_env.rollout(6)  # "reset": at this rollout's reset; "step": applied while idle
        for rollout in (first, second):
            check_truthful(rollout, {0: 0.0, version: 0.5}, index=0)
            for key in TAGS[2:]:
                assert rollout[key].tolist() == [2] * rollout.shape[0]
        assert second["env_version"].tolist() == [version] * 6
        assert sender.versions()[2] == version
        assert sender.state_dict()["config"]["difficulty"].shape == (2,)  # no checkpoint row for it
    finally:
        collector.shutdown()
        sender.close()
    assert "env_version" not in test_env.rollout(2).keys()  # a closed sender let it go


@pytest.mark.timeout(120)
def test_an_evaluation_env_receives_merged_statistics_and_is_not_counted() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method("fork"):
        collector = build("sync", sender, [partial(make_vecnorm_env, i) for i in range(3)], frames_per_batch=30)
    test_env = make_vecnorm_env(label=7)  # observations around 21: counted, they would show
    observations: list[torch.Tensor] = []
    try:
        batches = iter(collector)
        index = sender.attach_env(test_env)
        for sync in range(2):
            batch = next(batches)
            for row in rows(batch):
                observations += [row["observation"][:1]] if sync == 0 else []
                observations.append(row["next", "observation"])
            test_env.rollout(50)  # its own observations, before and after a merge
            sender.sync_stats("VecNormV2")
            state = sender.gather(["stats.0"])["stats", "0", "observation"]
            seen = torch.cat(observations).double()
            for env in range(4):  # the collectors' three envs and the evaluation env
                assert state["count"][env].item() == seen.shape[0]
                torch.testing.assert_close(state["mean"][env], seen.mean(0), rtol=1e-5, atol=1e-5)
            assert index == 3
        # it normalises by the merge (updated by the reset's observation first, as VecNormV2
        # does): its own observations, around 21, come out far above 0 (feature 0 is constant)
        rollout = test_env.rollout(1)
        x = rollout["observation"][0, 1:].double()
        count, mean, m2 = state["count"][0], state["mean"][0, 1:], state["m2"][0, 1:]
        updated = mean + (x - mean) / (count + 1)
        scale = ((m2 + (x - mean) * (x - updated)) / (count + 1)).sqrt()
        expected = (x - updated) / scale
        torch.testing.assert_close(rollout["observation_norm"][0, 1:].double(), expected, rtol=1e-3, atol=1e-3)
        assert bool((expected > 2).all())
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(60)
def test_an_evaluation_env_recomputes_its_statistics_after_a_push() -> None:
    sender = EnvStateSender(
        config={"g": 10.0}, apply=set_gravity, apply_at="step", reinit={"VecNorm": reinit.recompute(num_iter=64)}
    )
    sender.env_fn(make_ppo_env)  # the collectors' envs (none is built here)
    test_env = make_ppo_env()
    try:
        assert sender.attach_env(test_env) == 0
        version = sender.push(config={"g": 20.0}, wait="applied")  # applied at once: no rollout runs
        assert test_env.base_env._env.unwrapped.g == 20.0
        moments = sender.gather(["stats.0"])["stats", "0", "observation"]
        decay = float(torch.tensor(0.99999, dtype=torch.float32))
        # fresh statistics: the replayed reset and 64 steps, then the fresh episode's reset
        assert moments["count"].item() == pytest.approx((1 - decay**66) / (1 - decay), rel=1e-5)
        rollout = test_env.rollout(10)
        assert rollout["next", "env_version"].tolist() == [version] * 10
    finally:
        sender.close()


@pytest.mark.timeout(60)
def test_detach_and_close_take_it_out_and_indices_do_not_shift() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    sender.env_fn(make_drift_env)
    first, second = make_drift_env(), make_drift_env()
    try:
        assert (sender.attach_env(first), sender.attach_env(second)) == (0, 1)
        sender.detach_env(first)
        assert "env_version" not in first.rollout(2).keys()
        assert sender.num_envs == 1 and sender.push(config={"difficulty": 0.5}) == 1
        assert sender.attach_env(first) == 2  # a new index; the others keep theirs
        second.close()
        sender.push(config={"difficulty": 0.25})
        assert [m.first_env for m in sender.fleet()] == [2]
        with pytest.raises(ValidationError, match="was not attached to this sender"):
            sender.detach_env(second)
    finally:
        sender.close()


def test_bad_attachments_are_refused_in_the_main_process() -> None:
    with EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty") as sender:
        with pytest.raises(ValidationError, match="knows their env from sender.env_fn"):
            sender.attach_env(make_drift_env())
        sender.env_fn(make_vecnorm_env)
        with pytest.raises(ValidationError, match="lacks the env-state entries"):
            sender.attach_env(make_counter_env())
        with pytest.raises(ValidationError, match="takes an unbatched env"):
            sender.attach_env(make_batched_counters("serial", 2))
        with pytest.raises(ValidationError, match="takes a torchrl EnvBase"):
            sender.attach_env(make_drift_env)  # type: ignore[arg-type]
        env = make_vecnorm_env()
        sender.attach_env(env)
        with pytest.raises(ValidationError, match="in a fleet already"):
            sender.attach_env(env)
        with pytest.raises(ValidationError, match="load the checkpoint before attach_env"):
            sender.load_state_dict(sender.state_dict())
        with pytest.raises(ValidationError, match="no collector is attached"):
            sender.sync_stats("VecNormV2")


@pytest.mark.timeout(60)
def test_waiting_for_applied_on_an_idle_env_in_reset_mode_names_the_trap() -> None:
    """An env outside any collector between rollouts applies a ``"reset"`` version only at its
    next reset: waiting for "applied" times out, and the timeout says why."""
    from envsync import AckTimeout, EnvSyncError

    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="reset")
    sender.env_fn(make_counter_env)
    test_env = make_counter_env()
    try:
        sender.attach_env(test_env)
        with pytest.raises(AckTimeout) as raised:
            sender.push(config={"difficulty": 1.0}, wait="applied", timeout=0.5)
        assert isinstance(raised.value, EnvSyncError)
        assert "apply_at='reset'" in str(raised.value) and "next reset" in str(raised.value)
        rollout = test_env.rollout(3)  # its reset applies it
        assert rollout["next", "observation"][:, 0].tolist() == [1.0] * 3
        sender.wait(raised.value.version, until="applied", timeout=5)
    finally:
        sender.close()
    step = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    step.env_fn(make_counter_env)
    try:
        step.attach_env(make_counter_env())
        step.push(config={"difficulty": 1.0}, wait="applied", timeout=5)  # applies at once: no trap
    finally:
        step.close()
