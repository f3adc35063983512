"""The demo and the command line run end to end (tiny budget; fork workers: ``make demo``
runs the demo with torchrl's default, spawn, whose start-up is what this would time)."""

from __future__ import annotations

import pytest

from envsync.cli import main
from envsync.demo import DemoArgs, report, run


@pytest.mark.timeout(120)
def test_demo_switches_and_reports(capsys: pytest.CaptureFixture[str]) -> None:
    result = run(DemoArgs(workers=2, switches=2, batches_per_switch=2, frames_per_batch=50, start_method="fork"))
    assert len(result["latencies"]) == 2 and all(t > 0 for t in result["latencies"])
    assert set(result["frames"]) == {0, 1, 2} and sum(result["frames"].values()) == 6 * 50
    assert result["restart"] > max(result["latencies"])
    assert "push->applied" in report(result)


@pytest.mark.timeout(120)
def test_cli_runs_the_demo(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--workers", "1", "--switches", "1", "--batches-per-switch", "1", "--frames-per-batch", "20"]
    main(["demo", *args, "--start-method", "fork"])
    assert "one shutdown + recreate" in capsys.readouterr().out
