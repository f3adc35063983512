"""Each benchmark runs end to end with its ``--quick`` budget and writes its results.

Smoke runs only: nothing here asserts a speed.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

DOCUMENT_KEYS = {"benchmark", "quick", "args", "machine", "rows", "summary", "targets", "notes"}
ROW_KEYS = {
    "bench_curriculum": {"envs", "system", "variant", "episodes", "credited_exact_pct", "frames_right_pct"},
    "bench_switch_latency": {
        "workers",
        "envsync_idle_us",
        "envsync_iter_us",
        "map_fn_idle_us",
        "gym_call_us",
        "restart_fork_ms",
        "restart_spawn_ms",
        "map_fn_iter_dropped",
        "spawn_over_idle",
    },
    "bench_payload": {"size", "workers", "envsync_ms", "config_ms", "map_fn_ms", "policy_ms", "memcpy_ms"},
    "bench_memory": {"workers", "small_traced_bytes_per_push", "big_peak_payloads", "big_held_payloads"},
    "bench_ledger": {"envs", "what", "cpu_us_per_batch", "live_cpu_us_per_batch"},
    "bench_curriculum_instructions": {"envs", "frames", "pushes", "episodes", "loop_share", "timed_pushes"},
    "bench_push_instructions": {"workers", "pushes", "envsync_us_per_push", "gym_us_per_call", "counted"},
    "bench_hot_path": {"env", "collector", "fps_without", "fps_with", "overhead_pct", "overhead_cpu_pct"},
    "bench_throughput_switch": {"mark", "fps_before", "fps_after", "after_over_before"},
    "bench_sync_stats": {"size", "workers", "sync_ms", "floor_ms", "sync_over_floor"},
    "bench_batched": {"what"},
    "bench_worlds": {"n", "measure", "envsync", "baseline", "unit", "ratio", "per_world", "exact", "status"},
    "bench_rebuild": {"apply", "workers", "apply_us", "push_us", "push_applied_ms"},
    "bench_wait": {"worlds", "wait_wall_s", "wait_cpu_s", "cpu_share", "sleep_cpu_s"},
    "bench_ray": {"method", "median_ms", "over_env_state_push", "over_policy_update"},
    "bench_workload": {
        "workers",
        "restart_ms",
        "push_received_us",
        "push_applied_us",
        "restart_over_received",
        "restart_over_applied",
        "fps_before",
        "fps_after",
        "after_over_before",
        "all_applied",
    },
}
# Syllabus (syllabus-rl) is a peer under comparison, not part of what these smoke runs check
EXTRA_ARGS = {"bench_curriculum": ["--systems", "envsync"]}
WIDE = {"bench_push_instructions", "bench_switch_latency", "bench_curriculum_instructions", "bench_worlds"}
"""The slowest smoke runs (several seconds each): make wide runs them, make test the others."""
QUICK_RUNS = [
    pytest.param(m, marks=[pytest.mark.timeout(80), *([pytest.mark.wide] if m in WIDE else [])])
    for m in sorted(ROW_KEYS)
    if m != "bench_ray"
]


def check_quick_run(module: str, out: Path, *extra: str) -> None:
    bench = importlib.import_module(module)
    returned = bench.main(["--quick", "--out", str(out), *EXTRA_ARGS.get(module, []), *extra])
    document = json.loads((out / f"{bench.NAME}.json").read_text())
    assert document == json.loads(json.dumps(returned))
    assert set(document) >= DOCUMENT_KEYS and document["quick"] is True
    assert document["benchmark"] == bench.NAME and document["machine"]["cpus"] >= 1
    assert document["rows"] and all(ROW_KEYS[module] <= set(row) for row in document["rows"])
    assert all({"target", "measured", "goal", "met"} <= set(t) for t in document["targets"])
    assert (out / f"{bench.NAME}.md").read_text().startswith(f"### {bench.NAME}")
    assert all((out / plot).is_file() for plot in document["summary"]["plots"])


@pytest.mark.parametrize("module", QUICK_RUNS)
def test_benchmark_quick_run_writes_its_results(module: str, tmp_path: Path) -> None:
    check_quick_run(module, tmp_path)


@pytest.mark.wide
@pytest.mark.timeout(180)
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the ray extra is not installed")
def test_the_ray_benchmark_quick_run_writes_its_results(cluster_address: str, tmp_path: Path) -> None:
    # on the test run's two-node cluster (its nodes carry the resources n0 and n1 bench_ray pins to)
    check_quick_run("bench_ray", tmp_path, "--address", cluster_address)


def test_cli_bench_says_where_the_benchmarks_should_be(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from envsync import cli

    monkeypatch.setattr(cli, "BENCHMARKS", tmp_path / "nowhere")
    with pytest.raises(SystemExit, match="run_all.py not found"):
        cli.main(["bench", "--quick"])


def test_targets_names_the_run_of_every_figure_and_leaves_quick_runs_out(tmp_path: Path) -> None:
    import targets

    def document(name: str, quick: bool, commit: str) -> dict[str, object]:
        target = {"target": f"{name} ratio", "measured": 0.5, "goal": "<= 1x", "met": True}
        machine = {"commit": commit, "date": "2026-12-01 12:00 UTC", "load_avg_1min": 1.5}
        return {"benchmark": name, "quick": quick, "machine": machine, "targets": [target]}

    (tmp_path / "payload.json").write_text(json.dumps(document("payload", False, "abc1234")))
    (tmp_path / "memory.json").write_text(json.dumps(document("memory", True, "def5678")))
    text = targets.main(["--out", str(tmp_path)])
    assert "| payload ratio | 0.5 | <= 1x | yes | payload | abc1234 | 2026-12-01 12:00 UTC |" in text
    assert "memory" not in text  # a quick run is a smoke run, not a figure
    assert (tmp_path / "targets.md").read_text() == text


@pytest.mark.timeout(120)
def test_the_push_stages_probe_times_every_stage_it_names() -> None:
    # it wraps envsync's own functions by name: a stage renamed away would time nothing
    import push_stages_probe

    out = push_stages_probe.main(["--worlds", "64", "--rows", "8", "--pushes", "20"])
    stages = [label.strip() for _, _, label in push_stages_probe.STAGES]
    assert all(out[stage] > 0 for stage in stages), out
    assert out["publish"] >= out["the link's table"] + out["the config history"]
    assert out["the loop's turn, in this thread"] >= out["the group's apply"] >= out["the receiver's"]
    assert out["mean"] >= out["prepare"] + out["publish"] + out["the wait"]
    assert "timed" not in push_stages_probe.updates.Updates.push.__code__.co_name  # put back
