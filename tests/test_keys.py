"""Env-state keys are torchrl's own: exactly the keys of ``env.state_dict()`` of the env the
user's factory builds (a lone transform's ``loc``, a ``Compose``'s ``transforms.<i>.loc``, a
``VecNormV2``'s ``initialized`` and ``_extra_state`` entries), in push, gather,
``env_state_template=``, checkpoints and error messages. A user who takes ``env.state_dict()``,
edits it and pushes it succeeds."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from conftest import build
from helpers import OffsetNoiseEnv, make_noisy_env, make_normed_counter_env, make_parallel_normed, start_method
from torchrl.collectors import Collector

from envsync import EnvStateSender, ValidationError, reinit

V2_KEYS = ["_extra_state.count.-|-.observation", "_extra_state.loc.-|-.observation", "_extra_state.var.-|-.observation"]
NORM_KEYS = ["loc", "scale", "standard_normal"]
COUNT = ("_extra_state", "count.-|-.observation")
LOC = ("_extra_state", "loc.-|-.observation")


def lone_vecnorm_env(label: int = 0) -> Any:
    """OffsetNoiseEnv with a lone VecNormV2 (no Compose) that keeps the raw observation."""
    from torchrl.envs import TransformedEnv, VecNormV2

    norm = VecNormV2(in_keys=["observation"], out_keys=["observation_norm"], decay=1.0)
    return TransformedEnv(OffsetNoiseEnv(label), norm)


def names_of(state: Any, prefix: str = "") -> list[str]:
    """The leaves of a (nested) state_dict, dot-joined."""
    out = []
    for key, value in state.items():
        out += names_of(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
    return sorted(out)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (make_normed_counter_env, NORM_KEYS),
        (partial(make_noisy_env, "observation_norm"), [f"transforms.0.{k}" for k in NORM_KEYS]),
        (lone_vecnorm_env, [*V2_KEYS, "initialized"]),
        (partial(make_noisy_env, "vecnorm_v2"), [f"transforms.0.{k}" for k in [*V2_KEYS, "initialized"]]),
    ],
)
def test_the_keys_are_those_of_the_envs_own_state_dict(make: Any, expected: list[str]) -> None:
    with EnvStateSender(config={}) as sender:
        sender.env_fn(make)
        assert names_of(make().state_dict()) == expected
        keys = sender.env_state_template().keys
        assert [k for k in keys if not k.startswith("stats.")] == expected  # the rest: the derived moments


def test_a_state_dict_validates_as_it_is_and_comes_back_shaped_like_it() -> None:
    env = lone_vecnorm_env()
    own = env.state_dict()
    with EnvStateSender(config={}) as sender:
        sender.env_fn(lone_vecnorm_env)
        template = sender.env_state_template()
        out = template.validate(own)
        assert sorted(out.keys()) == ["_extra_state", "initialized"]
        assert sorted(out["_extra_state"].keys()) == sorted(own["_extra_state"])
        for form in ({COUNT: torch.tensor(3)}, {"_extra_state.count.-|-.observation": torch.tensor(3)}):
            assert template.validate(form)[COUNT].item() == 3
        env.load_state_dict(out.to_dict())  # torchrl takes back what envsync returns
    with EnvStateSender(config={}) as sender:
        sender.env_fn(make_normed_counter_env)
        with pytest.raises(
            ValidationError, match=r"'transforms.0.loc' is not in the env's state_dict; known: \['loc', 'scale'"
        ):
            sender.push(env_state={"transforms.0.loc": torch.zeros(3)})


@pytest.fixture(scope="module")
def lone_norm_sync() -> Any:
    """A MultiSyncCollector (fork) of 2 workers, each a CounterEnv under a lone ObservationNorm."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method("fork"):
        collector = build("sync", sender, [partial(make_normed_counter_env, label=i) for i in range(2)])
    yield sender, collector, iter(collector)
    collector.shutdown()
    sender.close()


@pytest.mark.timeout(120)
def test_an_edited_state_dict_pushes_and_gathers_by_torchrls_keys(lone_norm_sync: Any) -> None:
    sender, _, batches = lone_norm_sync
    next(batches)
    state = make_normed_counter_env().state_dict()
    state["loc"] = torch.tensor([0.0, 1.0, 0.0])
    state["scale"] = torch.tensor([1.0, 1.0, 2.0])
    version = sender.push(env_state=state, wait="applied")
    batch = next(batches)
    assert batch["next", "env_version"].eq(version).all()
    for worker in range(2):
        rows = batch["next"][batch["env_index"] == worker]
        observation = rows["observation"]
        assert observation[:, 1].eq(worker - 1.0).all()  # (label - loc) / scale
        assert observation[:, 2].diff().eq(0.5).all()  # a step counted by 1, scaled by 1/2
    gathered = sender.gather(["loc", "scale"])
    assert sorted(gathered.keys()) == ["loc", "scale"]
    assert gathered["loc"].tolist() == [[0.0, 1.0, 0.0]] * 2
    assert sorted(sender.gather().keys()) == ["loc", "scale", "standard_normal"]


@pytest.mark.timeout(120)
def test_a_checkpoint_holds_torchrls_keys(lone_norm_sync: Any) -> None:
    sender, _, batches = lone_norm_sync
    sender.push(env_state={"loc": torch.tensor([0.5, 0.0, 0.0])}, wait="applied")
    next(batches)
    state = sender.state_dict(gather=True)
    assert "loc" in state["env_state"]
    assert sorted(state["worker_env_state"].keys()) == ["loc", "scale", "standard_normal"]
    assert state["worker_env_state"]["loc"][:, 0].tolist() == [0.5, 0.5]


@pytest.mark.timeout(120)
def test_vecnorm_v2_workers_take_one_extra_state_entry_and_sync_through_the_derived_view() -> None:
    """In forked workers, one ``_extra_state`` entry loads alone into each VecNormV2's live
    statistics (they count on from it); ``sync_stats`` merges through the ``stats.*`` view,
    and the merge shows in the workers' own ``_extra_state``."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method("fork"):
        collector = build("sync", sender, [partial(lone_vecnorm_env, i) for i in range(2)], frames_per_batch=20)
    try:
        batches = iter(collector)
        next(batches)
        sender.push(env_state={"_extra_state": {"count.-|-.observation": torch.tensor(500)}}, wait="applied")
        assert sender.gather(["_extra_state"])[COUNT].tolist() == [500, 500]
        next(batches)
        assert sender.gather([COUNT])[COUNT].tolist() == [510, 510]  # 10 steps each since
        sender.sync_stats("VecNormV2")
        assert sender.gather([COUNT])[COUNT].tolist() == [1020, 1020]  # every observation counted once
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(120)
def test_vecnorm_v2_extra_state_pushes_in_place_gathers_and_resumes() -> None:
    """A lone VecNormV2 on a single Collector: its ``_extra_state`` entries are pushed whole
    (an edited ``state_dict()``) and one at a time, land in the transform's live statistics
    (which keep counting from there), are gathered and checkpointed by torchrl's keys, and a
    sender declared with ``env_state_template=env.state_dict()`` resumes from them."""

    def new_sender() -> EnvStateSender:
        return EnvStateSender(
            config={"difficulty": 0.0},
            apply="set_difficulty",
            apply_at="step",
            env_state_template=lone_vecnorm_env().state_dict(),
        )

    sender = new_sender()
    collector = build("single", sender, lone_vecnorm_env, frames_per_batch=10)
    try:
        batches = iter(collector)
        next(batches)
        assert sorted(sender.gather(["_extra_state"]).keys()) == ["_extra_state"]
        state = lone_vecnorm_env().state_dict()
        state["_extra_state"]["count.-|-.observation"] = torch.tensor(1000)
        state["_extra_state"]["loc.-|-.observation"] = torch.full((3,), 5.0)
        state["_extra_state"]["var.-|-.observation"] = torch.full((3,), 26.0)  # E[x^2]: variance 1
        sender.push(env_state=state, wait="applied")
        assert sender.gather([COUNT])[COUNT].tolist() == [1000]
        batch = next(batches)
        assert batch["next", "observation_norm"][..., 1:].mean() < -3  # (N(0, 1) - 5) / 1
        assert sender.gather(["_extra_state.count"])[COUNT].tolist() == [1010]  # still the live statistics
        sender.push(env_state={COUNT: torch.tensor(7)}, wait="applied")  # one nested entry, in place
        gathered = sender.gather(["_extra_state"])
        assert gathered[COUNT].tolist() == [7] and gathered[LOC].mean() > 4
        checkpoint = sender.state_dict(gather=True)
        assert checkpoint["worker_env_state"][COUNT].tolist() == [7]
        assert sorted(checkpoint["env_state"]) == [*V2_KEYS, "initialized"]  # dot-joined, as pushed
    finally:
        collector.shutdown()
        sender.close()
    sender = new_sender()
    sender.load_state_dict(checkpoint)  # the resume order: load, then build the collector
    collector = build("single", sender, lone_vecnorm_env, frames_per_batch=10)
    try:
        assert sender.gather([COUNT])[COUNT].item() in (7, 8)  # the checkpoint's (and the first reset)
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(60)
def test_a_compose_takes_its_own_edited_state_dict() -> None:
    make = partial(make_noisy_env, "observation_norm")
    with EnvStateSender(config={}, apply_at="step") as sender:
        collector = build("single", sender, make, frames_per_batch=4)
        try:
            batches = iter(collector)
            next(batches)
            state = make().state_dict()
            state["transforms.0.scale"] = torch.full((3,), 2.0**-10)
            version = sender.push(env_state=state, wait="applied")
            assert sender.versions() == [version]
            assert sender.gather(["transforms.0.scale"])["transforms.0.scale"].tolist() == [[2.0**-10] * 3]
            batch = next(batches)
            assert batch["next", "observation"].abs().mean() > 100  # N(0, 1) / 2**-10
        finally:
            collector.shutdown()


@pytest.mark.timeout(60)
def test_a_parallel_envs_sub_envs_take_their_own_keys() -> None:
    with EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step") as sender:
        with start_method("fork"):
            collector = Collector(
                sender.env_fn(make_parallel_normed),
                None,
                frames_per_batch=8,
                total_frames=-1,
                weight_sync_schemes=sender.schemes(),
            )
        try:
            batches = iter(collector)
            next(batches)
            assert sender.env_state_template().keys == ["loc", "scale", "standard_normal"]
            sender.push(env_state={"loc": torch.tensor([0.0, 3.0, 0.0])}, envs=[1], wait="applied")
            batch = next(batches)
            assert batch["next", "observation"][:, :, 1].tolist() == [[0.0] * 4, [-2.0] * 4]  # label - loc
        finally:
            collector.shutdown()


def test_statistics_computed_in_main_carry_torchrls_keys() -> None:
    with EnvStateSender(
        config={"difficulty": 0.0},
        apply="set_difficulty",
        reinit={"ObservationNorm": reinit.recompute(num_iter=4, where="main")},
    ) as sender:
        sender.env_fn(make_normed_counter_env)
        sender.push(config={"difficulty": 2.0})
        assert sorted(sender.state_dict()["env_state"]) == ["loc", "scale", "standard_normal"]
