"""Attribution exactness, checked the slow, obvious way: episodes cut from the frames one
frame at a time, against the ledger's records (shared by the local and the Ray tests)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from tensordict import TensorDict, TensorDictBase

from envsync import EnvStateSender
from envsync.curriculum import Bandit, Episode, Ledger

MANY_VERSIONS = 8
"""How many versions the checked episodes must have run under, at least."""


@dataclass
class Truth:
    """Episodes cut from the frames themselves, per env, one frame at a time (the slow,
    obvious way): the difficulties each episode's observations show, its return and length,
    and the batches its frames came from."""

    shown: int
    running: dict[int, dict[str, Any]] = field(default_factory=dict)
    finished: dict[int, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))

    def add(self, index: int, batch: TensorDictBase) -> None:
        flat = batch.reshape(-1)
        rows = zip(
            flat["next", "env_index"].tolist(),
            flat["observation"][:, self.shown].tolist(),
            flat["next", "observation"][:, self.shown].tolist(),
            flat["next", "reward"].reshape(-1).tolist(),
            flat["next", "done"].reshape(-1).tolist(),
            strict=True,
        )
        for env, before, after, reward, done in rows:
            episode = self.running.setdefault(env, {"shown": set(), "return": 0.0, "length": 0, "batches": set()})
            episode["shown"] |= {round(before, 5), round(after, 5)}
            episode["return"] += reward
            episode["length"] += 1
            episode["batches"].add(index)
            if done:
                self.finished[env].append(self.running.pop(env))


def push_rows(sender: EnvStateSender, generator: torch.Generator, round_: int) -> None:
    """Per-env configs: every env a row of its own, or (every third round) two envs only."""
    n = sender.num_envs
    assert n is not None
    envs = list(range(n)) if round_ % 3 else [round_ % n, (round_ + 1) % n]
    rows = torch.rand(len(envs), generator=generator) * 2.0
    sender.push(config=TensorDict(difficulty=rows, batch_size=[len(envs)]), envs=envs)


def collect(
    sender: EnvStateSender, collector: Any, *, shown: int, batches: int, per_env: int
) -> tuple[list[Episode], Truth]:
    ledger, truth = Ledger(sender), Truth(shown)
    generator = torch.Generator().manual_seed(0)
    episodes: list[Episode] = []
    for index, batch in enumerate(collector):
        push_rows(sender, generator, index)
        truth.add(index, batch)
        episodes += ledger.observe(batch)
        enough = all(len(truth.finished[e]) >= per_env for e in range(sender.num_envs or 0))
        # check_exact wants episodes under many versions: how many ran depends on timing
        if index + 1 >= batches and enough and len({e.version for e in episodes}) >= MANY_VERSIONS:
            break
        assert index < 20 * batches, "too few episodes ended"
    return episodes, truth


def check_exact(episodes: list[Episode], truth: Truth, num_envs: int) -> None:
    by_env: dict[int, list[Episode]] = defaultdict(list)
    for episode in episodes:
        by_env[episode.env].append(episode)
    assert sorted(by_env) == list(range(num_envs))
    spanning, versions = 0, set()
    for env in range(num_envs):
        reported, real = by_env[env], truth.finished[env]
        assert len(reported) == len(real), f"env {env}: {len(reported)} episodes reported, {len(real)} ran"
        for got, ran in zip(reported, real, strict=True):
            assert got.whole
            assert len(ran["shown"]) == 1, f"env {env}: an episode showed the configs {ran['shown']}"
            assert round(got.config["difficulty"].item(), 5) == ran["shown"].pop()
            assert (got.length, got.episode_return) == (ran["length"], pytest.approx(ran["return"]))
            spanning += len(ran["batches"]) > 1
            versions.add(got.version)
    assert spanning >= num_envs, "episodes spanning batches were seen"
    assert len(versions) >= MANY_VERSIONS, f"episodes ran under many versions, got {sorted(versions)}"


def check_bandit(
    bandit: Bandit, arms: list[dict[str, float]], episodes: list[Episode], worker_of: dict[int, int]
) -> None:
    """A per-worker bandit (``reward_range=(0, 50)``) was rewarded exactly by the whole
    episodes that ran each pull: each once, its return scaled, and a worker's envs all ran
    the arm it pulled (``worker_of``: env index -> fleet worker)."""
    pulled = [e for e in episodes if e.whole and e.version > 0]
    assert pulled, "no pull ran a whole episode"
    assert int(bandit.counts.sum()) == len(pulled), "every whole episode of a pull rewards its arm, once"
    configs = defaultdict(set)
    for e in pulled:
        configs[worker_of[e.env], e.version].add(round(e.config["difficulty"].item(), 4))
    assert all(len(c) == 1 for c in configs.values()), "a worker's envs run the same arm"
    for arm, config in enumerate(arms):
        mine = [
            min(e.episode_return / 50.0, 1.0) for e in pulled if e.config["difficulty"].item() == config["difficulty"]
        ]
        assert bandit.sums[arm].item() == pytest.approx(sum(mine))
