"""The demo and the command line run end to end (tiny budget)."""

from __future__ import annotations

import pytest

from envsync.cli import main
from envsync.demo import DemoArgs, report, run


@pytest.mark.timeout(120)
def test_demo_switches_and_reports(capsys: pytest.CaptureFixture[str]) -> None:
    result = run(DemoArgs(workers=2, switches=2, batches_per_switch=2, frames_per_batch=50))
    assert len(result["latencies"]) == 2 and all(t > 0 for t in result["latencies"])
    assert set(result["frames"]) == {0, 1, 2} and sum(result["frames"].values()) == 6 * 50
    assert result["restart"] > max(result["latencies"])
    assert "push->applied" in report(result)


@pytest.mark.timeout(120)
def test_cli_runs_the_demo(capsys: pytest.CaptureFixture[str]) -> None:
    main(["demo", "--workers", "1", "--switches", "1", "--batches-per-switch", "1", "--frames-per-batch", "20"])
    assert "one shutdown + recreate" in capsys.readouterr().out
