"""docs/performance.md and benchmarks/results/targets.md are what the committed results give."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")  # bench_common, which both scripts import, plots

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))


def test_the_performance_page_is_generated_from_the_committed_results() -> None:
    import make_performance_page

    page = make_performance_page.PAGE
    assert page.read_text() == make_performance_page.render(), (
        "docs/performance.md is out of date: run python benchmarks/make_performance_page.py"
    )


def test_targets_md_has_one_row_per_figure_from_its_latest_run() -> None:
    import targets

    results = BENCHMARKS / "results"
    assert (results / "targets.md").read_text() == targets.render(results), (
        "benchmarks/results/targets.md is out of date: run python benchmarks/targets.py"
    )
    names = [row["target"] for row in targets.rows(results)]
    assert len(names) == len(set(names))


def test_a_later_run_of_a_figure_replaces_the_earlier_one_and_an_instruction_count_a_timed_one(
    tmp_path: Path,
) -> None:
    import json

    import targets

    def write(file: str, benchmark: str, date: str, commit: str, figures: dict[str, float]) -> None:
        document = {
            "benchmark": benchmark,
            "quick": False,
            "machine": {"commit": commit, "date": date, "load_avg_1min": 1.0},
            "targets": [{"target": t, "measured": m, "goal": "<= 1x", "met": True} for t, m in figures.items()],
        }
        (tmp_path / f"{file}.json").write_text(json.dumps(document))

    write("ray", "ray", "2026-12-01 19:00 UTC", "aaaaaaa", {"push / update": 2.01})
    write("ray_rerun", "ray", "2026-12-02 17:07 UTC", "bbbbbbb", {"push / update": 0.64})
    timed = {"hot path, cheap (~317 CPU µs/frame), single": 0.98}
    write("hot_path", "hot_path", "2026-12-01 10:00 UTC", "ccccccc", timed)
    counted = {"hot path, cheap env": 0.992}
    write("hot_path_instructions", "hot_path_instructions", "2026-12-01 09:00 UTC", "ddddddd", counted)
    rows = {row["target"]: row for row in targets.rows(tmp_path)}
    assert rows["push / update"]["measured"] == 0.64 and rows["push / update"]["commit"] == "bbbbbbb"
    assert set(rows) == {"push / update", "hot path, cheap env"}
