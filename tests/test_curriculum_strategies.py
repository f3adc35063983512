"""Each strategy against its reference rule on scripted outcomes: given these episode
results, the lesson, the range, the priorities or the arm is exactly this."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.record.loggers.csv import CSVLogger

from envsync import EnvStateSender, ValidationError
from envsync.curriculum import ADR, PLR, Bandit, Curriculum, Episode, Lesson, Lessons, Strategy, plot


@pytest.fixture
def sender() -> Iterator[EnvStateSender]:
    sender = EnvStateSender(config={"difficulty": 0.0, "friction": 1.0}, apply="set_difficulty")
    yield sender
    sender.close()


def episode(ret: float, version: int, *, env: int = 0, whole: bool = True, **measures: float) -> Episode:
    return Episode(env, version, TensorDict(), ret, 10, dict(measures), whole)


# ---- Lessons (ML-Agents) ------------------------------------------------------------------


def three_lessons(sender: EnvStateSender, **criteria: object) -> Lessons:
    first = Lesson({"difficulty": 0.0}, name="easy", threshold=10.0, min_lesson_length=3, **criteria)  # type: ignore[arg-type]
    return Lessons(sender, [first, Lesson({"difficulty": 0.5}, threshold=10.0), Lesson({"difficulty": 1.0})])


def test_lessons_smooth_the_mean_as_ml_agents_does(sender: EnvStateSender) -> None:
    lessons = three_lessons(sender)
    v = lessons.since
    lessons.update([episode(12.0, v), episode(12.0, v)])
    assert lessons.lesson == 0 and lessons.smoothed == 0.0, "fewer than min_lesson_length episodes: no check"
    lessons.update([episode(12.0, v)])
    assert lessons.lesson == 0 and lessons.smoothed == pytest.approx(9.0), "0.25 * 0 + 0.75 * 12 = 9 <= 10"
    lessons.update([episode(12.0, v)])
    assert lessons.smoothed == pytest.approx(11.25), "0.25 * 9 + 0.75 * 12 = 11.25 > 10"
    assert lessons.lesson == 1 and list(lessons.buffer) == []
    assert sender.desired_config()["difficulty"].item() == 0.5
    assert [r["lesson"] for r in lessons.history() if "version" in r] == [0, 1]


def test_lessons_count_only_whole_episodes_of_the_current_lesson(sender: EnvStateSender) -> None:
    lessons = three_lessons(sender, signal_smoothing=False)
    v = lessons.since
    lessons.update([episode(99.0, v - 1), episode(99.0, v, whole=False), episode(11.0, v), episode(11.0, v)])
    assert list(lessons.buffer) == [11.0, 11.0] and lessons.lesson == 0
    lessons.update([episode(9.0, v)])
    assert lessons.lesson == 1, "mean 31 / 3 = 10.33 > 10 without smoothing"


def test_lessons_on_a_measure_or_on_progress(sender: EnvStateSender) -> None:
    named = Lessons(
        sender,
        [
            Lesson({"difficulty": 0.0}, measure="success", threshold=0.5, signal_smoothing=False),
            Lesson({"difficulty": 1.0}),
        ],
        measures={"success": ("next", "success")},
    )
    named.update([episode(0.0, named.since, success=1.0)])
    assert named.lesson == 1
    progress = Lessons(
        sender, [Lesson({"difficulty": 0.0}, measure="progress", threshold=0.5), Lesson({})], max_steps=100
    )
    progress.ledger.frames = 50
    progress.update([episode(0.0, progress.since)])
    assert progress.lesson == 0, "progress 0.5 is not > 0.5"
    progress.ledger.frames = 51
    progress.update([episode(0.0, progress.since)])
    assert progress.lesson == 1


def test_lessons_refuse_what_they_cannot_do(sender: EnvStateSender) -> None:
    with pytest.raises(ValidationError, match="at least one"):
        Lessons(sender, [])
    with pytest.raises(ValidationError, match="measure='nope'"):
        Lessons(sender, [Lesson({}, measure="nope"), Lesson({})])
    with pytest.raises(ValidationError, match="max_steps"):
        Lessons(sender, [Lesson({}, measure="progress"), Lesson({})])
    with pytest.raises(ValidationError, match="apply_at='truncate'"):
        Lessons(sender, [Lesson({}, require_reset=True), Lesson({})])
    truncating = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="truncate")
    Lessons(truncating, [Lesson({}, require_reset=True), Lesson({})])
    truncating.close()


def test_lessons_resume_their_progress(sender: EnvStateSender) -> None:
    lessons = three_lessons(sender)
    v = lessons.since
    lessons.update([episode(12.0, v)] * 3)
    lessons.update([episode(12.0, v)])
    lessons.update([episode(3.0, lessons.since)])
    state = lessons.state_dict()
    fresh_sender = EnvStateSender(config={"difficulty": 0.0, "friction": 1.0}, apply="set_difficulty")
    resumed = three_lessons(fresh_sender)
    resumed.load_state_dict(state)
    assert (resumed.lesson, list(resumed.buffer), resumed.smoothed) == (1, [3.0], lessons.smoothed)
    assert fresh_sender.desired_config()["difficulty"].item() == 0.5
    assert resumed.history() == lessons.history()
    fresh_sender.close()


# ---- ADR (DeXtreme) ------------------------------------------------------------------------


def adr(sender: EnvStateSender, **kwargs: object) -> ADR:
    settings: dict[str, object] = {
        "bounds": {"difficulty": (0.0, 5.0)},
        "delta": 0.25,
        "queue": 3,
        "thresholds": (30.0, 42.0),
    }
    return ADR(sender, {"difficulty": (1.0, 2.0)}, **{**settings, **kwargs})  # type: ignore[arg-type]


LOW, HIGH = ("difficulty", 0), ("difficulty", 1)


def test_adr_widens_and_shrinks_each_boundary_by_its_full_queue(sender: EnvStateSender) -> None:
    strategy = adr(sender)
    for value in (45.0, 45.0):
        strategy.credit(HIGH, value)
    assert strategy.range["difficulty"] == [1.0, 2.0], "a queue decides only when full"
    strategy.credit(HIGH, 45.0)
    assert strategy.range["difficulty"] == [1.0, 2.25] and not strategy.queues[HIGH]
    for value in (50.0, 50.0, 50.0):
        strategy.credit(LOW, value)
    assert strategy.range["difficulty"] == [0.75, 2.25]
    for value in (20.0, 20.0, 20.0):
        strategy.credit(HIGH, value)
    assert strategy.range["difficulty"] == [0.75, 2.0], "mean 20 < 30: the upper boundary comes back"
    for value in (20.0, 20.0, 20.0):
        strategy.credit(HIGH, value)
    assert strategy.range["difficulty"] == [0.75, 2.0], "never inside the initial range"
    assert list(strategy.queues[HIGH]) == [20.0] * 3, "a boundary that did not move keeps its queue"
    changes = [
        (r["boundary"], r["difficulty.low"], r["difficulty.high"]) for r in strategy.history() if "boundary" in r
    ]
    assert changes == [("difficulty.high", 1.0, 2.25), ("difficulty.low", 0.75, 2.25), ("difficulty.high", 0.75, 2.0)]


def test_adr_queues_slide_and_bounds_hold(sender: EnvStateSender) -> None:
    strategy = adr(sender, delta=2.0, delta_style="multiplicative")
    for value in (10.0, 10.0, 36.0):  # mean 18.7 < 30 at the initial high: cannot shrink, kept
        strategy.credit(HIGH, value)
    assert strategy.range["difficulty"] == [1.0, 2.0] and len(strategy.queues[HIGH]) == 3
    strategy.credit(HIGH, 90.0)  # [10, 36, 90]: mean 45.3 > 42
    assert strategy.range["difficulty"] == [1.0, 4.0]
    for value in (50.0, 50.0, 50.0):
        strategy.credit(HIGH, value)
    assert strategy.range["difficulty"] == [1.0, 5.0], "4 * 2 = 8, held at the bound 5"
    for value in (50.0, 50.0, 50.0):
        strategy.credit(LOW, value)
    assert strategy.range["difficulty"] == [0.5, 5.0], "1 / 2"


def test_adr_draws_boundary_envs_at_the_boundary(sender: EnvStateSender) -> None:
    multi = ADR(sender, {"difficulty": (1.0, 2.0), "friction": (0.5, 0.6)}, boundary_fraction=0.4, seed=3)
    draws = [multi.draw() for _ in range(4000)]
    boundary = [(row, b) for row, b in draws if b is not None]
    assert len(boundary) / len(draws) == pytest.approx(0.4, abs=0.03)
    assert {b for _, b in boundary} == {("difficulty", 0), ("difficulty", 1), ("friction", 0), ("friction", 1)}
    for row, (name, side) in boundary:
        assert row[name] == multi.range[name][side]
    for row, _ in draws:
        assert 1.0 <= row["difficulty"] <= 2.0 and 0.5 <= row["friction"] <= 0.6
    extended = adr(sender, extended_boundary_sample=True, boundary_fraction=1.0)
    assert {extended.draw()[0]["difficulty"] for _ in range(50)} == {0.75, 2.25}


def test_adr_draws_thousands_of_envs_as_columns_in_one_call(sender: EnvStateSender) -> None:
    multi = ADR(sender, {"difficulty": (1.0, 2.0), "friction": (0.5, 0.6)}, boundary_fraction=0.4, seed=5)
    columns, boundaries = multi.draws(65_536)
    assert {n: c.shape for n, c in columns.items()} == {"difficulty": (65_536,), "friction": (65_536,)}
    assert sum(b is not None for b in boundaries) / len(boundaries) == pytest.approx(0.4, abs=0.01)
    for (name, side), count in Counter(b for b in boundaries if b is not None).items():
        at = np.array([b == (name, side) for b in boundaries])
        assert count / len(boundaries) == pytest.approx(0.1, abs=0.01)
        assert (columns[name][at] == multi.range[name][side]).all(), "a boundary env sits at its boundary"
    for name, (low, high) in multi.range.items():
        assert ((columns[name] >= low) & (columns[name] <= high)).all()
    rollout = np.array([b is None for b in boundaries])
    assert len(np.unique(columns["difficulty"][rollout])) == rollout.sum(), "each rollout env draws its own"


def test_adr_discards_results_of_a_boundary_that_moved(sender: EnvStateSender) -> None:
    strategy = adr(sender, queue=1)
    strategy.assigned[0, 5] = (HIGH, 2.0)
    strategy.assigned[1, 5] = (HIGH, 2.0)
    strategy.update([episode(50.0, 5, env=0)])
    assert strategy.range["difficulty"] == [1.0, 2.25]
    strategy.update([episode(50.0, 5, env=1), episode(50.0, 6, env=0, whole=True)])
    assert strategy.range["difficulty"] == [1.0, 2.25], "env 1 ran the old boundary 2.0; (0, 6) was no boundary"


def test_columns_of_another_length_than_the_envs_are_refused_before_a_push(sender: EnvStateSender) -> None:
    class Still(Strategy):
        def update(self, episodes: list[Episode]) -> None:
            pass

    still = Still(sender)
    with pytest.raises(ValidationError, match="column 'difficulty' has 1 rows; one row per env needs 2"):
        still.assign_columns([0, 1], {"difficulty": [0.1]})
    with pytest.raises(ValidationError, match="column 'friction' has a single value"):
        still.assign_columns([0, 1], {"difficulty": [0.1, 0.2], "friction": 0.5})
    assert sender.version == 0, "nothing was pushed"


def test_adr_refuses_bad_settings(sender: EnvStateSender) -> None:
    for kwargs, match in [
        ({"delta_style": "exponential"}, "delta_style"),
        ({"delta": 0.5, "delta_style": "multiplicative"}, "> 1"),
        ({"boundary_fraction": 1.5}, "boundary_fraction"),
        ({"thresholds": (5.0, 1.0)}, "thresholds"),
        ({"objective": "success"}, "objective"),
    ]:
        with pytest.raises(ValidationError, match=match):
            adr(sender, **kwargs)
    with pytest.raises(ValidationError, match="low above high"):
        ADR(sender, {"difficulty": (2.0, 1.0)})


def test_adr_resumes_ranges_queues_and_draws(sender: EnvStateSender) -> None:
    strategy = adr(sender)
    for value in (45.0, 45.0, 45.0, 10.0):
        strategy.credit(HIGH, value)
    strategy.credit(LOW, 33.0)
    state = strategy.state_dict()
    resumed = adr(sender)
    resumed.load_state_dict(state)
    assert resumed.range == strategy.range and resumed.queues == strategy.queues
    assert [resumed.draw() for _ in range(5)] == [strategy.draw() for _ in range(5)]


# ---- PLR (Jiang et al. 2021) ---------------------------------------------------------------


def test_plr_replay_weights_are_rank_and_staleness_mixed(sender: EnvStateSender) -> None:
    plr = PLR(sender, [{"difficulty": d} for d in (0.0, 0.5, 1.0, 1.5)], temperature=0.5, staleness_coef=0.3)
    plr.scores[:] = torch.tensor([3.0, 1.0, 2.0, 9.0], dtype=torch.float64)
    plr.staleness[:] = torch.tensor([0.0, 2.0, 1.0, 7.0], dtype=torch.float64)
    plr.seen[:] = torch.tensor([True, True, True, False])
    ranks = [2, 4, 3]  # level 3 (score 9, unseen) holds rank 1 but gets no weight
    by_score = [1 / r**2 for r in ranks]
    by_score = [w / sum(by_score) for w in by_score]
    by_staleness = [0.0, 2 / 3, 1 / 3]
    expected = [0.7 * s + 0.3 * c for s, c in zip(by_score, by_staleness, strict=True)] + [0.0]
    assert plr.replay_weights().tolist() == pytest.approx(expected)


def test_plr_draws_new_levels_until_rho_then_replays_by_priority(sender: EnvStateSender) -> None:
    plr = PLR(sender, [{"difficulty": d} for d in (0.0, 0.5, 1.0)], staleness_coef=0.0, temperature=0.01, seed=1)
    first = [plr.sample() for _ in range(6)]
    assert plr.draws == {"replay": 0, "new": 6}, "nothing seen yet: only new levels"
    assert set(first) == {0, 1, 2}
    assert plr.staleness.tolist() == [float(5 - max(i for i, x in enumerate(first) if x == lv)) for lv in range(3)]
    for level, score in enumerate((1.0, 7.0, 3.0)):
        plr.update_score(level, score)
    assert [plr.sample() for _ in range(20)] == [1] * 20, "temperature 0.01: the top rank only"
    plr.alpha = 0.5
    plr.update_score(1, 1.0)
    assert plr.scores[1].item() == 4.0


@pytest.mark.parametrize("schedule", ["proportionate", "fixed"])
def test_plr_draws_a_batch_of_levels_as_its_draws_one_by_one_would(sender: EnvStateSender, schedule: str) -> None:
    levels = [{"difficulty": d / 10} for d in range(12)]
    one, many = (PLR(sender, levels, replay_schedule=schedule, rho=0.3, staleness_coef=0.4, seed=9) for _ in range(2))
    for plr in (one, many):
        for level, score in ((0, 3.0), (4, 1.0), (7, 5.0), (11, 2.0)):
            plr.update_score(level, score)
    assert many.samples(500) == [one.sample() for _ in range(500)]
    assert torch.equal(many.staleness, one.staleness) and many.draws == one.draws
    assert one.draws["replay"] and one.draws["new"]


def test_plr_fixed_schedule_and_rho(sender: EnvStateSender) -> None:
    plr = PLR(sender, [{"difficulty": d} for d in (0.0, 0.5, 1.0, 1.5)], replay_schedule="fixed", rho=0.5, nu=0.0)
    plr.update_score(0, 1.0)
    assert [plr.sample() for _ in range(10)] != [0] * 10, "a quarter seen < rho: new levels"
    plr.update_score(1, 2.0)
    assert {plr.sample() for _ in range(10)} <= {0, 1}, "half seen >= rho and nu=0: always replay"


def test_plr_scores_whole_episodes_of_its_levels(sender: EnvStateSender) -> None:
    plr = PLR(sender, [{"difficulty": d} for d in (0.0, 0.5)], score=lambda e: e.length * 2.0)
    plr.assigned[0, 3] = 1
    plr.update([episode(5.0, 3), episode(5.0, 3, whole=False), episode(5.0, 4)])
    assert plr.scores.tolist() == [0.0, 20.0] and plr.seen.tolist() == [False, True]
    state = plr.state_dict()
    resumed = PLR(sender, plr.levels)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.scores, plr.scores) and torch.equal(resumed.seen, plr.seen)
    assert [resumed.sample() for _ in range(5)] == [plr.sample() for _ in range(5)]
    with pytest.raises(ValidationError, match="replay_schedule"):
        PLR(sender, plr.levels, replay_schedule="greedy")


# ---- Bandit (UCB1, EXP3) -------------------------------------------------------------------


def test_ucb1_tries_each_arm_then_maximises_the_bound(sender: EnvStateSender) -> None:
    bandit = Bandit(sender, [{"difficulty": d} for d in (0.0, 0.5, 1.0)])
    assert [bandit.select() for _ in range(3)] == [0, 1, 2]
    for arm, reward in [(0, 0.2), (1, 0.9), (2, 0.5), (0, 0.4)]:
        bandit.reward(arm, reward)
    n = 4
    bounds = [0.3 + math.sqrt(2 * math.log(n) / 2), 0.9 + math.sqrt(2 * math.log(n)), 0.5 + math.sqrt(2 * math.log(n))]
    assert bandit.select() == max(range(3), key=bounds.__getitem__) == 1


def test_exp3_updates_weights_by_importance_weighted_rewards(sender: EnvStateSender) -> None:
    bandit = Bandit(sender, [{"difficulty": d} for d in (0.0, 1.0)], rule="exp3", gamma=0.2, seed=0)
    assert bandit.probabilities().tolist() == pytest.approx([0.5, 0.5])
    bandit.reward(1, 1.0, probability=0.5)
    w1 = math.exp(0.2 * (1.0 / 0.5) / 2)
    p1 = 0.8 * w1 / (1 + w1) + 0.1
    assert bandit.probabilities().tolist() == pytest.approx([1 - p1, p1])
    picks = [bandit.select() for _ in range(4000)]
    assert sum(picks) / len(picks) == pytest.approx(p1, abs=0.03)


@pytest.mark.parametrize("rule", ["ucb1", "exp3"])
def test_a_bandit_pulls_a_batch_of_arms_as_its_pulls_one_by_one_would(sender: EnvStateSender, rule: str) -> None:
    arms = [{"difficulty": d / 4} for d in range(5)]
    one, many = (Bandit(sender, arms, rule=rule, gamma=0.3, seed=4) for _ in range(2))
    for bandit in (one, many):
        for arm, value in ((0, 0.2), (2, 0.9), (2, 0.7)):
            bandit.reward(arm, value, 0.2 if rule == "exp3" else None)
    assert many.selects(300) == [one.select() for _ in range(300)]
    assert many._pending == one._pending and torch.equal(many.weights, one.weights)
    if rule == "ucb1":
        assert one.selects(1) == [2], "after the untried arms (1, 3, 4 first), the best bound"
    else:
        assert len(set(many.selects(300))) == 5, "EXP3 draws every arm"


def test_bandit_rewards_whole_episodes_scaled(sender: EnvStateSender) -> None:
    bandit = Bandit(sender, [{"difficulty": d} for d in (0.0, 1.0)], reward_range=(10.0, 30.0))
    bandit.pulls[0, 2] = (1, 0.5)
    bandit.update([episode(20.0, 2), episode(50.0, 2), episode(40.0, 2, whole=False), episode(0.0, 3)])
    assert bandit.counts.tolist() == [0, 2] and bandit.sums.tolist() == [0.0, 1.5]
    resumed = Bandit(sender, bandit.arms, reward_range=(10.0, 30.0))
    resumed.load_state_dict(bandit.state_dict())
    assert torch.equal(resumed.counts, bandit.counts) and torch.equal(resumed.sums, bandit.sums)
    with pytest.raises(ValidationError, match="rule"):
        Bandit(sender, bandit.arms, rule="thompson")


# ---- the interface -------------------------------------------------------------------------


def test_every_strategy_is_a_curriculum_and_plots(sender: EnvStateSender, tmp_path: object) -> None:
    strategies: list[Strategy] = [
        three_lessons(sender),
        adr(sender),
        PLR(sender, [{"difficulty": 0.0}]),
        Bandit(sender, [{"difficulty": 0.0}]),
    ]
    for strategy in strategies:
        assert isinstance(strategy, Curriculum)
        drawn = plot(strategy, f"{tmp_path}/{type(strategy).__name__}.png")
        assert drawn is (__import__("importlib").util.find_spec("matplotlib") is not None)


def test_a_torchrl_logger_gets_every_number_of_every_record(sender: EnvStateSender, tmp_path: Path) -> None:
    logger = CSVLogger("adr", log_dir=str(tmp_path))
    strategy = adr(sender, logger=logger)
    strategy.ledger.frames = 640
    for value in (45.0, 45.0, 45.0):
        strategy.credit(HIGH, value)
    written = {p.name: p.read_text() for p in tmp_path.rglob("*.csv")}
    high = next(text for name, text in written.items() if name.endswith("difficulty.high.csv"))
    assert high.split() == ["0,2.0", "640,2.25"], "the first record at frame 0, the move at frame 640"
