"""envsync.sender.checkpoint: what a sender's ``state_dict`` keeps and what a resumed sender gives
each worker, with real collectors: what one worker was pushed, a worker's own gathered
statistics, and a statistics merge, whether it was applied, pending or superseded when the
checkpoint was taken, and whether the checkpoint is loaded before or after the collector is
built (most of these were found by the model soak)."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from conftest import build
from env_state_checks import Seen, loc_key, merged_stats, merged_stats_of
from helpers import make_normed_counter_env, make_slow_vecnorm_env, start_method

from envsync import EnvStateSender


def checkpoint_with_own_entries() -> tuple[dict[str, Any], str]:
    """A MultiSyncCollector of 2 workers where only worker 1 was pushed its own ``loc``."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    with start_method("fork"):
        collector = build("sync", sender, [make_normed_counter_env] * 2, frames_per_batch=10)
    try:
        key = loc_key(sender)
        sender.push(env_state={key: torch.full((3,), 5.0)}, workers=[1], wait="applied")
        return sender.state_dict(), key
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("order", ["load-then-build", "build-then-load"])
def test_a_checkpoint_keeps_what_one_worker_was_pushed(order: str) -> None:
    state, key = checkpoint_with_own_entries()
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    if order == "load-then-build":
        sender.load_state_dict(state)
    with start_method("fork"):
        collector = build("sync", sender, [make_normed_counter_env] * 2, frames_per_batch=10)
    try:
        if order == "build-then-load":
            sender.wait(sender.load_state_dict(state), until="applied")
        locs = sender.gather([key]).get(tuple(key.split(".")))
        assert locs[0].tolist() == [0.0] * 3 and locs[1].tolist() == [5.0] * 3
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("synced", [False, True], ids=["fresh", "after-a-sync"])
def test_loading_gathered_state_into_an_attached_single_worker_keeps_its_statistics(synced: bool) -> None:
    """After a sync the checkpoint's default env state holds the merge, which the new worker
    loads first; its own row, loaded next, holds its statistics twice (under torchrl's keys and
    as ``stats.*``): they are its whole state, not a merge to add to what it saw (found by the
    model soak: the count doubled at every such resume)."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = build("single", sender, make_slow_vecnorm_env, frames_per_batch=20)
    try:
        batches = iter(collector)
        next(batches)
        if synced:
            sender.sync_stats("VecNormV2", timeout=20.0)
        next(batches)
        state = sender.state_dict(gather=True)
    finally:
        collector.shutdown()
        sender.close()
    saved = state["worker_env_state"]
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = build("single", sender, make_slow_vecnorm_env, frames_per_batch=20)  # built first
    try:
        sender.wait(sender.load_state_dict(state), until="applied")
        now = sender.gather(None)
        assert set(now.keys(True, True)) == set(saved.keys(True, True))
        for key in saved.keys(True, True):
            torch.testing.assert_close(now.get(key), saved.get(key))
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(180)
def test_workers_resumed_from_the_merge_are_counted_from_it() -> None:
    """A checkpoint taken while a merge was pending ("reset" mode: not applied yet): the
    resumed workers start from the merge, so the next sync counts only what they saw since
    (found by the model soak: it counted the merge's observations again)."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    makers = [partial(make_slow_vecnorm_env, i, horizon=7) for i in range(2)]
    with start_method("fork"):
        collector = build("sync", sender, makers, frames_per_batch=20)
    try:
        sender.sync_stats("VecNormV2", timeout=20.0)  # the reset observation of each worker
        state = sender.state_dict()
    finally:
        collector.shutdown()
        sender.close()
    merged_count, _ = merged_stats_of(state)
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    sender.load_state_dict(state)
    with start_method("fork"):
        collector = build("sync", sender, makers, frames_per_batch=20)
    try:
        seen = Seen()
        seen.add(next(iter(collector)))  # each resumed worker: its reset, then its steps
        sender.sync_stats("VecNormV2", timeout=20.0)
        count, _ = merged_stats(sender)
        assert count == merged_count + seen.count_mean()[0]
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["single", "sync"])
def test_a_checkpoint_loaded_into_running_reset_mode_workers_counts_from_what_each_holds(kind: str) -> None:
    """Build the collector, then load a checkpoint that holds a merge ("reset" mode: the
    workers apply it at their next reset): until then a worker's statistics count from its
    own start, not from the merge it has not applied (found by the model soak: the next sync
    raised "old (count 2.0) is not an earlier snapshot of new (count 1.0)")."""
    makers: Any = make_slow_vecnorm_env if kind == "single" else [partial(make_slow_vecnorm_env, i) for i in range(2)]
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    with start_method("fork"):
        collector = build(kind, sender, makers, frames_per_batch=20)
    try:
        sender.sync_stats("VecNormV2", timeout=20.0)
        sender.sync_stats("VecNormV2", timeout=20.0)
        state = sender.state_dict()
    finally:
        collector.shutdown()
        sender.close()
    merged_count, _ = merged_stats_of(state)
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    with start_method("fork"):
        collector = build(kind, sender, makers, frames_per_batch=20)  # built first
    try:
        sender.load_state_dict(state)  # pending until each worker's next reset
        sender.sync_stats("VecNormV2", timeout=20.0)
        count, _ = merged_stats(sender)
        workers = 1 if kind == "single" else 2
        assert count == merged_count + workers  # each worker's own reset observation, once
        seen = Seen()
        batches = iter(collector)
        for _ in range(3):
            seen.add(next(batches))
        sender.sync_stats("VecNormV2", timeout=20.0)
        later, _ = merged_stats(sender)
        assert count <= later <= count + seen.count_mean()[0]
    finally:
        collector.shutdown()
        sender.close()


def _gathered_count(sender: EnvStateSender) -> float:
    return float(sender.gather(["stats.0.observation.count"]).flatten_keys(".")["stats.0.observation.count"][0])


@pytest.mark.timeout(180)
def test_a_merge_supersedes_a_workers_older_own_statistics_in_the_checkpoint() -> None:
    """A worker resumed from its own gathered statistics, then merged by a sync: the next
    checkpoint's row for it keeps no stale copy of them under torchrl's keys, so a resume
    from that checkpoint holds the merge (found by the model soak: the stale row overwrote
    the merge, and the next sync found its baseline ahead of the env)."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = build("single", sender, make_slow_vecnorm_env, frames_per_batch=20)
    try:
        next(iter(collector))
        state = sender.state_dict(gather=True)
    finally:
        collector.shutdown()
        sender.close()
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    sender.load_state_dict(state)
    collector = build("single", sender, make_slow_vecnorm_env, frames_per_batch=20)
    try:
        next(iter(collector))
        sender.sync_stats("VecNormV2", timeout=20.0)
        merged, _ = merged_stats(sender)
        again = sender.state_dict()
    finally:
        collector.shutdown()
        sender.close()
    stale = [k for row in again.get("env_state_rows", []) for k in row if "_extra_state" in k]
    assert stale == []
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = build("single", sender, make_slow_vecnorm_env, frames_per_batch=20)  # built first
    try:
        sender.wait(sender.load_state_dict(again), until="applied")
        assert _gathered_count(sender) >= merged
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(180)
def test_a_checkpoint_of_a_row_not_applied_yet_gives_the_baseline_of_that_row() -> None:
    """Reset mode: a checkpoint taken while a worker's own row (loaded into its running
    collector) still waits for the worker's reset. The checkpoint gives the worker that row,
    so its baseline must be the row's, not what the worker held before it (found by the
    model soak: the next sync after resuming counted the row's observations again)."""
    makers = partial(make_slow_vecnorm_env, horizon=7)
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    collector = build("single", sender, makers, frames_per_batch=20)
    try:
        batches = iter(collector)
        next(batches)
        sender.sync_stats("VecNormV2", timeout=20.0)
        next(batches)
        first = sender.state_dict(gather=True)
    finally:
        collector.shutdown()
        sender.close()
    own_count = float(first["worker_env_state"].flatten_keys(".")["stats.0.observation.count"][0])
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    collector = build("single", sender, makers, frames_per_batch=20)
    try:
        sender.load_state_dict(first)  # the row waits for the worker's next reset
        second = sender.state_dict()
    finally:
        collector.shutdown()
        sender.close()
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    sender.load_state_dict(second)
    collector = build("single", sender, makers, frames_per_batch=20)
    try:
        seen = Seen()
        seen.add(next(iter(collector)))
        sender.sync_stats("VecNormV2", timeout=20.0)
        count, _ = merged_stats(sender)
        # the row's observations once, then at most what the resumed worker saw (+ its reset)
        assert own_count <= count <= own_count + seen.count_mean()[0] + 1
    finally:
        collector.shutdown()
        sender.close()
