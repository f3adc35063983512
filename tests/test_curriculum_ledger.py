"""The ledger on scripted batches: episodes cut at done and at version changes, carried over
batch ends, batches of several workers interleaved, measures reduced, bad input refused."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from envsync import EnvStateSender, ValidationError
from envsync.curriculum import Episode, Ledger, Measure, Strategy


@pytest.fixture
def sender() -> Iterator[EnvStateSender]:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    for version in range(10):
        # as the sender records its pushes: env e ran difficulty e + version / 10 under version
        configs = {e: {("config", "difficulty"): np.float32(e + version / 10)} for e in range(4)}
        sender.config_history.record(version, configs)
    yield sender
    sender.close()


def frames(
    env: int | Sequence[int], versions: Sequence[int], rewards: Sequence[float], done: Sequence[int]
) -> TensorDict:
    """One env's frames (a row), or several envs' rows stacked: ``env`` a list, the others lists of rows."""
    n = len(versions)
    envs = torch.full((n,), env) if isinstance(env, int) else torch.tensor(env)
    return TensorDict(
        {
            ("next", "env_index"): envs,
            ("next", "env_version"): torch.tensor(versions),
            ("next", "done"): torch.tensor(done, dtype=torch.bool).unsqueeze(-1),
            ("next", "reward"): torch.tensor(rewards, dtype=torch.float32).unsqueeze(-1),
            ("next", "success"): torch.tensor(rewards, dtype=torch.float32).unsqueeze(-1) > 1,
        },
        batch_size=[n],
    )


def summary(episodes: list[Episode]) -> list[tuple[int, int, float, int, bool]]:
    return [(e.env, e.version, e.episode_return, e.length, e.whole) for e in episodes]


def test_episodes_end_at_done_and_carry_over_batches(sender: EnvStateSender) -> None:
    ledger = Ledger(sender)
    first = ledger.observe(frames(0, [1, 1, 1, 2, 2], [1, 1, 1, 2, 2], [0, 0, 1, 0, 0]))
    assert summary(first) == [(0, 1, 3.0, 3, True)]
    assert first[0].config["difficulty"].item() == pytest.approx(0.1)
    second = ledger.observe(frames(0, [2, 2, 2, 2], [2, 2, 2, 2], [0, 0, 0, 0]))
    assert second == [], "an episode still running is carried, not reported"
    third = ledger.observe(frames(0, [2, 3], [5, 7], [1, 1]))
    assert summary(third) == [(0, 2, 17.0, 7, True), (0, 3, 7.0, 1, True)]
    assert third[0].config["difficulty"].item() == pytest.approx(0.2)
    assert ledger.latest == {0: 3} and ledger.frames == 11


def test_batches_of_several_envs_and_workers_interleave_in_any_order(sender: EnvStateSender) -> None:
    ledger = Ledger(sender)
    worker_a = [frames([0, 0, 0], [1, 1, 1], [1, 1, 1], [0, 0, 0]), frames([1, 1, 1], [1, 1, 1], [1, 1, 1], [0, 1, 0])]
    rows = torch.stack(worker_a)  # a [2 envs, 3 steps] batch
    worker_b = frames([2, 2, 3, 3], [4, 4, 4, 4], [1, 2, 3, 4], [1, 0, 0, 1])
    got = ledger.observe(rows) + ledger.observe(worker_b)
    assert summary(got) == [(1, 1, 2.0, 2, True), (2, 4, 1.0, 1, True), (3, 4, 7.0, 2, True)]
    later_a = torch.stack([frames(0, [1, 2], [1, 1], [1, 0]), frames(1, [1, 1], [1, 1], [1, 0])])
    assert summary(ledger.observe(later_a)) == [(0, 1, 4.0, 4, True), (1, 1, 2.0, 2, True)]
    assert [e.config["difficulty"].item() for e in got] == pytest.approx([1.1, 2.4, 3.4])


def test_a_version_change_mid_episode_gives_pieces_each_with_its_config(sender: EnvStateSender) -> None:
    ledger = Ledger(sender)
    got = ledger.observe(frames(0, [1, 1, 2, 2, 2], [1, 1, 1, 1, 1], [0, 0, 0, 1, 0]))
    got += ledger.observe(frames(0, [3, 3], [4, 4], [0, 1]))
    assert summary(got) == [(0, 1, 2.0, 2, False), (0, 2, 2.0, 2, False), (0, 2, 1.0, 1, False), (0, 3, 8.0, 2, False)]
    assert got[-1].config["difficulty"].item() == pytest.approx(0.3)


def test_measures_reduce_over_the_whole_episode_across_batches(sender: EnvStateSender) -> None:
    measures = {
        "best": Measure(("next", "reward"), "max"),
        "worst": Measure(("next", "reward"), "min"),
        "mean": Measure(("next", "reward"), "mean"),
        "first": Measure(("next", "reward"), "first"),
        "success": ("next", "success"),
    }
    ledger = Ledger(sender, measures=measures)
    assert ledger.observe(frames(0, [1, 1], [3, 1], [0, 0])) == []
    (episode,) = ledger.observe(frames(0, [1, 1], [5, 0.5], [0, 1]))
    assert episode.measures == {"best": 5.0, "worst": 0.5, "mean": 9.5 / 4, "first": 3.0, "success": 0.0}


def test_measures_of_any_dtype_and_a_tensor_that_carries_a_grad(sender: EnvStateSender) -> None:
    """The ledger reads the batch's columns through numpy: a dtype numpy lacks (bfloat16), a
    tensor that requires grad and an integer column reduce as the float ones do."""
    batch = frames(0, [1, 1, 1], [1, 2, 4], [0, 0, 1])
    rewards = batch["next", "reward"]
    batch["next", "bf16"] = rewards.to(torch.bfloat16)
    batch["next", "ints"] = rewards.to(torch.int64)
    batch["next", "grad"] = rewards.clone().requires_grad_()
    measures = {"bf16": Measure(("next", "bf16"), "sum"), "ints": Measure(("next", "ints"), "max")}
    measures["grad"] = Measure(("next", "grad"), "mean")
    (episode,) = Ledger(sender, measures=measures).observe(batch)
    assert episode.measures == {"bf16": 7.0, "ints": 4.0, "grad": 7.0 / 3}
    assert all(type(v) is float for v in episode.measures.values())
    assert type(episode.env) is int and type(episode.length) is int


def test_bad_input_is_a_validation_error(sender: EnvStateSender) -> None:
    with pytest.raises(ValidationError, match="reduce"):
        Measure("x", "median")
    batch = frames(0, [1], [1], [1])
    with pytest.raises(ValidationError, match="no 'missing'"):
        Ledger(sender, measures={"m": "missing"}).observe(batch)
    del batch["next", "env_version"]
    with pytest.raises(ValidationError, match="sender.env_fn"):
        Ledger(sender).observe(batch)
    wide = frames(0, [1], [1], [1])
    wide["next", "two"] = torch.zeros(1, 2)
    with pytest.raises(ValidationError, match="2 numbers per frame"):
        Ledger(sender, measures={"m": ("next", "two")}).observe(wide)
    assert Ledger(sender).observe(frames(0, [], [], [])) == []


def test_the_ledger_is_vectorised_over_frames(sender: EnvStateSender) -> None:
    """A batch of 100k frames and a handful of episodes: no Python work per frame."""
    n = 100_000
    done = torch.zeros(n, dtype=torch.int64)
    done[torch.arange(9_999, n, 10_000)] = 1
    batch = frames(1, torch.full((n,), 5).tolist(), torch.ones(n).tolist(), done.tolist())
    episodes = Ledger(sender).observe(batch)
    assert [e.length for e in episodes] == [10_000] * 10 and all(e.episode_return == 10_000 for e in episodes)


def test_the_public_front_is_sorted_and_complete() -> None:
    from envsync import curriculum

    public = sorted(n for n in vars(curriculum) if not n.startswith("_") and n[0].isupper() or n == "plot")
    assert curriculum.__all__ == sorted(curriculum.__all__) == public


@pytest.mark.timeout(60)
def test_the_core_never_imports_the_curriculum_package() -> None:
    code = "import sys, envsync, envsync.integrations.torchrl; print(any('curriculum' in m for m in sys.modules))"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root, env=env)
    assert result.stdout.strip() == "False"


def test_an_episodes_config_is_made_when_read_and_stays_exact_after_the_history_forgot_it(
    sender: EnvStateSender, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ledger gives each episode where the config history holds its config and makes the
    ``TensorDict`` only when it is read, once (most strategies never read it: making one for
    each of 25,000 episodes a batch cost more than the batch); a record is never written
    again, so a config read after the history pruned its entry is still the one that ran."""
    from envsync.sender import history as module  # where an entry's config is made (Entry.config)

    made: list[int] = []
    nest = module.nest

    def counted(flat: dict[str, object], *, copy: bool = False) -> TensorDict:
        made.append(1)
        return nest(flat, copy=copy)  # type: ignore[arg-type]

    monkeypatch.setattr(module, "nest", counted)
    ledger = Ledger(sender)
    episodes = ledger.observe(frames([0, 1, 2, 3], [2, 2, 2, 2], [1, 1, 1, 1], [1, 1, 1, 1]))
    assert len(episodes) == 4 and made == []
    history = sender.config_history
    history.keep = 1
    for version in range(10, 80):  # every env moves on and applies it: version 2's entries go
        configs = {e: {("config", "difficulty"): np.float32(-version)} for e in range(4)}
        history.record(version, configs, applied=lambda envs, v=version: np.full(len(envs), v))
    with pytest.raises(ValidationError, match="pruned"):
        sender.config_at(0, 2)
    assert [e.config["difficulty"].item() for e in episodes] == pytest.approx([0.2, 1.2, 2.2, 3.2])
    assert [e.config["difficulty"].item() for e in episodes] == pytest.approx([0.2, 1.2, 2.2, 3.2])
    assert len(made) == 4  # once each


def test_observing_a_batch_holds_off_the_cyclic_collector_and_leaves_it_as_found(sender: EnvStateSender) -> None:
    seen: list[bool] = []

    class Watch(Strategy):
        def update(self, episodes: list[Episode]) -> None:
            seen.append(gc.isenabled())

    watch = Watch(sender)
    batch = frames(0, [1, 1, 1, 2], [1, 1, 1, 2], [0, 0, 1, 0])
    assert gc.isenabled()
    assert summary(watch.observe(batch)) == [(0, 1, 3.0, 3, True)]
    assert seen == [False] and gc.isenabled(), "off for the batch (the ledger and the rule), on after"
    gc.disable()
    try:
        watch.observe(frames(0, [2, 2], [1, 1], [1, 0]))
        assert seen == [False, False] and not gc.isenabled(), "turned off by the user: left off"
    finally:
        gc.enable()

    class Failing(Strategy):
        def update(self, episodes: list[Episode]) -> None:
            raise RuntimeError("a rule that fails")

    with pytest.raises(RuntimeError, match="a rule that fails"):
        Failing(sender).observe(frames(1, [1, 1], [1, 1], [1, 0]))
    assert gc.isenabled()
