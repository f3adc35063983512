"""A natively batched env (``batch_size=[n]``, one env object holding n worlds): "applied"
means the simulator holds the rows (``../shared/API.md``).

The env's apply is a built-in one (``envsync.apply.attributes()``), which writes every row a
safe point changes at once, at the safe point's end, then runs its ``finish``. A slow finish
that saves the env's array when it returns shows whether ``wait="applied"`` returned before
the write and its finish did.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import make_native_counters, start_method
from tensordict import TensorDict
from torchrl.collectors import Collector, MultiSyncCollector

import envsync
from envsync import EnvStateSender

N = 6
ROUNDS = 12


class SlowSave:
    """A ``finish=`` that takes a while, then saves the env's difficulty rows to ``path``
    (what the simulator holds once the write and its finish returned)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, env: Any) -> None:
        time.sleep(0.03)
        np.save(self.path, env.difficulty.numpy())


def build(kind: str, sender: EnvStateSender) -> Any:
    factory = sender.env_fn(functools.partial(make_native_counters, N))
    if kind == "collector":
        return Collector(factory, None, frames_per_batch=4 * N, total_frames=-1, weight_sync_schemes=sender.schemes())
    with start_method("fork"):
        return MultiSyncCollector(
            [factory], None, frames_per_batch=4 * N, total_frames=-1, weight_sync_schemes=sender.schemes()
        )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["collector", "multisync"])
def test_applied_returns_once_the_write_and_its_finish_returned_for_every_row(kind: str, tmp_path: Path) -> None:
    saved = tmp_path / "difficulty.npy"
    apply = envsync.apply.attributes(finish=SlowSave(saved))
    sender = EnvStateSender(config={"difficulty": 0.0}, apply=apply, apply_at="step")
    collector = build(kind, sender)
    try:
        next(iter(collector))  # then idle: the worker loop applies
        for round_ in range(ROUNDS):
            rows = torch.arange(N, dtype=torch.float32) + 10.0 * (round_ + 1)
            sender.push(config=TensorDict(difficulty=rows, batch_size=[N]), wait="applied")
            held = np.load(saved)  # what the finish saw when it returned
            assert held.tolist() == pytest.approx(rows.tolist()), round_
            if kind == "collector":  # the env is in this process: read the simulator itself
                assert collector.env.difficulty.tolist() == pytest.approx(rows.tolist()), round_
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(120)
def test_a_write_the_user_makes_after_applied_is_never_overwritten() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply=envsync.apply.attributes(), apply_at="step")
    collector = build("collector", sender)
    try:
        next(iter(collector))
        for round_ in range(ROUNDS):
            rows = torch.full((N,), float(round_ + 1))
            sender.push(config=TensorDict(difficulty=rows, batch_size=[N]), wait="applied")
            collector.env.difficulty[:] = -1.0  # the user's own write, after the wait
            time.sleep(0.05)
            assert collector.env.difficulty.tolist() == [-1.0] * N, round_
    finally:
        collector.shutdown()
        sender.close()
