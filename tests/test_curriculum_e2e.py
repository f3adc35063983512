"""Each strategy end to end: real collectors, ``strategy.observe(batch)`` in the loop, pushes
decided by the rule, and every decision credited only with episodes that really ran it."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
from attribution import check_bandit
from helpers import start_method
from torchrl.collectors import Collector, MultiAsyncCollector
from torchrl.envs import ParallelEnv

from envsync import EnvStateSender
from envsync.curriculum import ADR, PLR, Bandit, Episode, Lesson, Lessons, Strategy
from envsync.envs import make_drift_env


def drift_pair() -> ParallelEnv:
    return ParallelEnv(2, make_drift_env, mp_start_method="fork")


@pytest.fixture
def single() -> Iterator[tuple[EnvStateSender, Collector]]:
    """A ``Collector`` over a ``ParallelEnv`` of two DriftEnvs (fork), reset mode."""
    with start_method("fork"):
        sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
        collector = Collector(
            sender.env_fn(drift_pair), None, frames_per_batch=40, total_frames=-1, weight_sync_schemes=sender.schemes()
        )
        yield sender, collector
        collector.shutdown()
        sender.close()


def run(strategy: Strategy, collector: Any, batches: int) -> tuple[list[Episode], float]:
    """Drive the loop; return the episodes and the longest ``observe`` call (seconds)."""
    episodes: list[Episode] = []
    longest = 0.0
    for index, batch in enumerate(collector):
        start = time.perf_counter()
        episodes += strategy.observe(batch)
        longest = max(longest, time.perf_counter() - start)
        if index + 1 == batches:
            break
    return episodes, longest


@pytest.mark.timeout(120)
def test_lessons_move_through_every_lesson(single: tuple[EnvStateSender, Collector]) -> None:
    sender, collector = single
    stages = (0.2, 0.4, 0.6)
    lessons = Lessons(sender, [Lesson({"difficulty": d}, threshold=-1.0, min_lesson_length=3) for d in stages])
    episodes, longest = run(lessons, collector, 40)
    starts = [r for r in lessons.history() if "version" in r]
    assert [r["lesson"] for r in starts] == [0, 1, 2]
    for record, difficulty in zip(starts, stages, strict=True):
        ran = [e for e in episodes if e.whole and e.version == record["version"]]
        assert ran and all(e.config["difficulty"].item() == pytest.approx(difficulty) for e in ran)
    assert longest < 2.0


@pytest.mark.timeout(120)
def test_adr_decides_each_env_at_its_reset(single: tuple[EnvStateSender, Collector]) -> None:
    sender, collector = single
    adr = ADR(
        sender,
        {"difficulty": (0.2, 0.4)},
        bounds={"difficulty": (0.0, 1.0)},
        delta=0.1,
        queue=2,
        thresholds=(-2.0, -1.0),
        boundary_fraction=0.8,
    )
    episodes, _ = run(adr, collector, 80)
    assert adr.range["difficulty"][0] == pytest.approx(0.0) and adr.range["difficulty"][1] == pytest.approx(1.0)
    moves = [r["boundary"] for r in adr.history() if "boundary" in r]
    assert moves.count("difficulty.low") == 2 and moves.count("difficulty.high") == 6, "every return > -1: widen"
    decided = [e for e in episodes if e.version > 0]
    assert len({e.version for e in decided}) >= 6
    per_env = defaultdict(set)
    for e in decided:
        per_env[e.env].add(e.version)
        assert 0.0 <= e.config["difficulty"].item() <= 1.0
    assert all(len(v) >= 3 for v in per_env.values()), "each env drew again after its episodes"


@pytest.mark.timeout(120)
def test_plr_scores_each_level_from_its_last_episode(single: tuple[EnvStateSender, Collector]) -> None:
    sender, collector = single
    levels = [{"difficulty": d} for d in (0.3, 0.9, 1.5, 2.1)]
    plr = PLR(sender, levels, seed=2)
    episodes, _ = run(plr, collector, 60)
    assert bool(plr.seen.all()) and plr.draws["replay"] > 0
    for level, config in enumerate(levels):
        ran = [
            e
            for e in episodes
            if e.whole and e.version > 0 and e.config["difficulty"].item() == pytest.approx(config["difficulty"])
        ]
        assert plr.scores[level].item() == pytest.approx(-ran[-1].episode_return)


@pytest.mark.timeout(180)
def test_bandit_per_worker_over_async_workers_of_parallel_envs() -> None:
    with start_method("fork"):
        sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
        collector = MultiAsyncCollector(
            [sender.env_fn(drift_pair)] * 2,
            None,
            frames_per_batch=40,
            total_frames=-1,
            weight_sync_schemes=sender.schemes(),
        )
        arms = [{"difficulty": d} for d in (0.25, 0.75, 1.5)]
        bandit = Bandit(sender, arms, per="worker", reward_range=(0.0, 50.0))
        try:
            episodes, longest = run(bandit, collector, 50)
            worker_of = {e: m.index for m in sender.fleet() for e in range(m.first_env, m.first_env + m.envs)}
        finally:
            collector.shutdown()
            sender.close()
    check_bandit(bandit, arms, episodes, worker_of)
    assert longest < 2.0


def worlds_collector(n: int) -> tuple[EnvStateSender, Collector]:
    """A sender and one ``Collector`` of ``n`` natively batched worlds (3-step episodes, 8
    steps a batch, ``apply_at="step"``)."""
    from functools import partial

    from helpers import NativeCounterEnv

    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = Collector(
        sender.env_fn(partial(NativeCounterEnv, n, horizon=3)),
        None,
        frames_per_batch=8 * n,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
    )
    return sender, collector


@pytest.mark.timeout(120)
def test_a_strategy_over_thousands_of_worlds_decides_exactly_the_due_ones_from_columns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ADR over one collector of 4,096 natively batched worlds, step mode: after each batch,
    exactly the worlds that never had a decision, or ended a whole episode under their latest
    one, get a new decision (the rule written out here with dicts, read against the sender's
    config history), and no batch lists the fleet's envs one by one (``due()`` walked every
    env in Python and ``num_envs`` made a list of every env index: ~12 ms a batch at 65,536
    worlds, 0.3 ms now)."""
    from envsync.sender.fleet import Fleet

    n = 4096
    sender, collector = worlds_collector(n)
    adr = ADR(sender, ranges={"difficulty": (0.0, 0.1)}, delta=0.05, queue=4, thresholds=(-1e9, 1e9), seed=0)
    listed: list[int] = []
    indices = Fleet.indices

    def counted(self: Fleet) -> list[int]:
        listed.append(1)
        return indices(self)

    monkeypatch.setattr(Fleet, "indices", counted)
    decided: dict[int, int] = {}  # the rule's own state, kept by hand
    whole: dict[int, int] = {}
    try:
        batches = iter(collector)
        for _ in range(4):
            batch = next(batches)
            for episode in adr.observe(batch):
                if episode.whole:
                    whole[episode.env] = max(whole.get(episode.env, -1), episode.version)
            due = {e for e in range(n) if e not in decided or whole.get(e, -1) >= decided[e]}
            latest = {e: sender.config_history.versions(e)[-1] for e in range(n)}
            got = {e for e in range(n) if latest[e] != decided.get(e, 0)}
            assert got == due, (len(got), len(due), sorted(got ^ due)[:5])
            assert len(due) > 0 and (len(due) == n or len(due) < n // 2)  # the first batch decides all
            decided.update({e: latest[e] for e in due})
            assert adr.due() == []  # every due world was given its decision
        assert listed == []
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(120)
def test_the_docs_strategy_of_columns_gives_every_due_world_its_row_in_one_push() -> None:
    """The ``Jitter`` strategy of docs/curriculum.md ("Your own strategy"), run as written
    over one collector of 1,024 natively batched worlds: every due world gets its own row in
    one push a batch, and each world holds the row of its latest decision."""
    import re
    from pathlib import Path

    import numpy as np
    import torch

    docs = Path(__file__).resolve().parents[1] / "docs" / "curriculum.md"
    pattern = r"```python\n(import numpy as np\nfrom envsync import curriculum\n\nclass Jitter.*?)```"
    block = re.search(pattern, docs.read_text(), re.S)
    assert block is not None, "the Jitter example is in docs/curriculum.md"
    namespace: dict[str, Any] = {}
    exec(compile(block.group(1), str(docs), "exec"), namespace)
    n = 1024
    sender, collector = worlds_collector(n)
    jitter = namespace["Jitter"](sender, seed=1)
    pushes: list[int] = []
    push = sender.push

    def counted(*args: Any, **kwargs: Any) -> int:
        pushes.append(len(kwargs["envs"]))
        return push(*args, **kwargs)

    sender.push = counted  # type: ignore[method-assign]
    try:
        batches = iter(collector)
        episodes = 0
        for _ in range(4):
            episodes += len(jitter.observe(next(batches)))
        assert pushes[0] == n and len(pushes) == 4 and all(0 < p <= n for p in pushes), pushes
        assert episodes > n
        held = sender.read_attributes(["difficulty"])["difficulty"].flatten()
        latest = [sender.config_history.versions(e)[-1] for e in range(n)]
        desired = torch.stack([sender.config_at(e, v)["difficulty"] for e, v in enumerate(latest)])
        assert torch.equal(held.float(), desired.float()), "each world holds the row of its latest decision"
        assert len(np.unique(desired.numpy())) > n // 2, "rows of their own"
        assert all(0.0 <= r["centre"] <= 2.0 for r in jitter.history())
    finally:
        collector.shutdown()
        sender.close()
