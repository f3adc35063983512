"""Both processes of the curriculum resume test: each strategy runs on its own sender and
``Collector`` over a natively batched env; the first process checkpoints the sender and the
strategy mid-run, the second (``python curriculum_resume_check.py PATH``) resumes them and
prints, as JSON, each strategy's state right after the resume and whether it went on."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch
from helpers import make_native_counters
from torchrl.collectors import Collector

from envsync import EnvStateSender
from envsync.curriculum import ADR, PLR, Bandit, Lesson, Lessons, Strategy

NAMES = ("lessons", "adr", "plr", "bandit")


def make_strategy(name: str, sender: EnvStateSender) -> Strategy:
    """The strategy ``name``; the returns of the native env are its episode lengths 7, 9, 11."""
    if name == "lessons":
        return Lessons(sender, [Lesson({"difficulty": float(d)}, threshold=5.0, min_lesson_length=4) for d in range(6)])
    if name == "adr":
        return ADR(
            sender, {"difficulty": (1.0, 1.5)}, bounds={"difficulty": (0.0, 9.0)}, queue=2, thresholds=(0.0, 6.0)
        )
    if name == "plr":
        return PLR(sender, [{"difficulty": float(d)} for d in range(5)], seed=1)
    return Bandit(sender, [{"difficulty": float(d)} for d in range(3)], reward_range=(0.0, 12.0))


def build(name: str, state: dict[str, Any] | None = None) -> tuple[EnvStateSender, Collector, Strategy]:
    """Sender -> (load its checkpoint) -> collector -> strategy -> (load its checkpoint)."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    if state is not None:
        sender.load_state_dict(state["sender"])
    collector = Collector(
        sender.env_fn(lambda: make_native_counters(3, horizon=7)),
        None,
        frames_per_batch=30,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
    )
    strategy = make_strategy(name, sender)
    if state is not None:
        strategy.load_state_dict(state["strategy"])
    return sender, collector, strategy


def progress(strategy: Strategy) -> dict[str, Any]:
    """What must survive a resume: the lesson and its buffer, the ranges and queues, the
    level buffer, the arms' statistics, and the history."""
    state = strategy.state_dict()
    keep = {"lessons": ("lesson", "buffer", "smoothed"), "adr": ("range", "queues", "results")}
    tensors = {"plr": ("scores", "staleness", "seen"), "bandit": ("counts", "sums")}
    name = type(strategy).__name__.lower()
    out = {k: state[k] for k in keep.get(name, ())}
    out.update({k: state[k].tolist() for k in tensors.get(name, ())})
    return {**out, "frames": state["frames"], "records": len(state["history"])}


def run(strategy: Strategy, collector: Collector, batches: int) -> None:
    for index, batch in enumerate(collector):
        strategy.observe(batch)
        if index + 1 == batches:
            return


def each(name: str, state: dict[str, Any], work: Callable[[Strategy, Collector], None]) -> dict[str, Any]:
    sender, collector, strategy = build(name, state)
    try:
        resumed = progress(strategy)
        work(strategy, collector)
        return {"resumed": resumed, "after": progress(strategy), "config": sender.desired_config(env=0).to_dict()}
    finally:
        collector.shutdown()
        sender.close()


def main(path: str) -> None:
    states = torch.load(path, weights_only=False)
    out = {name: each(name, states[name], lambda s, c: run(s, c, 12)) for name in NAMES}
    print(json.dumps(out, default=float))


if __name__ == "__main__":
    main(sys.argv[1])
