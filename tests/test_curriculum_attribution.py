"""Attribution exactness end to end: with real collectors and many per-env pushes in reset
mode, every episode the ledger reports ran under exactly the config it is credited with (the
env's observation shows it), and no episode is lost or counted twice, including episodes that
span batches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from attribution import check_exact, collect
from helpers import make_native_counters, start_method
from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector
from torchrl.envs import ParallelEnv

from envsync import EnvStateSender
from envsync.envs import make_drift_env


def drift_pair() -> ParallelEnv:
    return ParallelEnv(2, make_drift_env, mp_start_method="fork")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", [MultiAsyncCollector, MultiSyncCollector])
def test_two_workers_of_a_parallel_env_of_two(kind: Callable[..., Any]) -> None:
    with start_method("fork"):
        sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="reset")
        collector = kind(
            [sender.env_fn(drift_pair)] * 2,
            None,
            frames_per_batch=40,
            total_frames=-1,
            weight_sync_schemes=sender.schemes(),
        )
        try:
            assert sender.num_envs == 4
            episodes, truth = collect(sender, collector, shown=1, batches=60, per_env=6)
        finally:
            collector.shutdown()
            sender.close()
    check_exact(episodes, truth, 4)


@pytest.mark.timeout(120)
def test_a_collector_over_a_natively_batched_env() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="reset")
    collector = Collector(
        sender.env_fn(lambda: make_native_counters(3, horizon=7)),
        None,
        frames_per_batch=24,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
    )
    try:
        episodes, truth = collect(sender, collector, shown=0, batches=40, per_env=8)
    finally:
        collector.shutdown()
        sender.close()
    check_exact(episodes, truth, 3)
    assert {e.length for e in episodes} == {7, 9, 11}
