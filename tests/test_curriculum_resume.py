"""Resume: each strategy and its sender, checkpointed mid-run, resumed in a new process,
continue from the same state (lesson and buffer, ranges and queues, level buffer, arms)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from curriculum_resume_check import NAMES, build, progress, run

TESTS = Path(__file__).resolve().parent


@pytest.mark.timeout(180)
def test_every_strategy_resumes_in_a_new_process(tmp_path: Path) -> None:
    states, saved = {}, {}
    for name in NAMES:
        sender, collector, strategy = build(name)
        try:
            run(strategy, collector, 10)
            states[name] = {"sender": sender.state_dict(), "strategy": strategy.state_dict()}
            saved[name] = json.loads(json.dumps(progress(strategy), default=float))
        finally:
            collector.shutdown()
            sender.close()
    path = tmp_path / "checkpoint.pt"
    torch.save(states, path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    command = [sys.executable, str(TESTS / "curriculum_resume_check.py"), str(path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=150, env=env, cwd=TESTS.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for name in NAMES:
        assert out[name]["resumed"] == saved[name], f"{name} resumed from another state"
        assert out[name]["after"]["frames"] > saved[name]["frames"], f"{name} went on counting frames"
    assert saved["lessons"]["lesson"] >= 1, "the checkpoint was taken mid-curriculum"
    assert out["lessons"]["after"]["lesson"] > saved["lessons"]["lesson"], "the lessons went on from there"
    assert out["lessons"]["config"]["difficulty"] >= saved["lessons"]["lesson"]
    assert saved["adr"]["range"] != {"difficulty": [1.0, 1.5]}, "the ranges had moved"
    (low, high), (then_low, then_high) = out["adr"]["after"]["range"]["difficulty"], saved["adr"]["range"]["difficulty"]
    assert low <= then_low and high >= then_high and (low, high) != (then_low, then_high), "widened from there"
    assert sum(out["bandit"]["after"]["counts"]) > sum(saved["bandit"]["counts"]) > 0
    assert all(out["plr"]["after"]["seen"]) and any(saved["plr"]["seen"])
