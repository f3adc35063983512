"""Write ``docs/performance.md`` from the results in ``benchmarks/results/``.

The page is generated: edit this script (or rerun a benchmark), never the page. It holds
the headline figures, every target with the run that measured it (as ``targets.md``), and
one section per run: the question, the command that reproduces it, the commit, date and
load the JSON recorded, and the run's own tables (its ``<name>.md``). Earlier runs stay under
``benchmarks/results/`` (``history/HISTORY.md`` and the sub-folders).

    python benchmarks/make_performance_page.py [--check]

``--check`` writes nothing and fails when the committed page differs from what the results
give (``tests/test_performance_page.py`` does the same).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import targets
from bench_common import RESULTS, fmt

PAGE = Path(__file__).resolve().parents[1] / "docs" / "performance.md"

SECTIONS: dict[str, tuple[str, str]] = {
    # benchmark -> (heading, the question it answers)
    "workload": (
        "Switch vs restart, 1 to 20 workers",
        "A spawn `MultiAsyncCollector` of DriftEnv workers, being iterated: how long a push takes to be "
        "received and applied by every worker, against shutting the collector down, building it again "
        "and getting its first batch; and frames/s just before and after a push.",
    ),
    "switch_latency": (
        "Switch latency against map_fn and gymnasium",
        "A small config push to idle workers and to a `MultiAsyncCollector` being iterated, against "
        "torchrl's `map_fn`, gymnasium's `AsyncVectorEnv.call` and a restart (fork and spawn).",
    ),
    "hot_path_instructions": (
        "Hot path, in instructions",
        "What envsync costs a collector when nothing is pending, counted in instructions per frame "
        "(callgrind, every process), on the cheapest env: repeatable within ~0.1%.",
    ),
    "hot_path": (
        "Hot path, timed",
        "Frames per CPU second with envsync attached and nothing pending, against the same collector "
        "without it, on a ~300 µs/step env and on the cheap one.",
    ),
    "throughput_switch": (
        "Throughput around a switch",
        "Frames/s in the batches before and after a push, with control marks (no push) for the noise.",
    ),
    "payload": (
        "Payload: env state and config tensors",
        "Pushing 1 KB, 1 MB and 32 MB of transform state or config to 1, 2, 4 idle workers, against "
        "`map_fn` carrying the tensor, torchrl's `update_policy_weights_()` of the same bytes and the "
        "memcpy floor.",
    ),
    "memory": ("Memory", "What a push leaves in the main process, and the peak of a 32 MB push."),
    "sync_stats": (
        "Merging normaliser statistics",
        "One `sync_stats` round (gather, exact merge, push) against the memcpy floor.",
    ),
    "batched": (
        "Batched environments",
        "An idle push to `Collector(ParallelEnv(4))` against torchrl's own attribute dispatch, and the "
        "hot path of `SerialEnv`/`ParallelEnv` collectors.",
    ),
    "worlds": (
        "Worlds by the thousand",
        "A `Collector` of one torchrl env of n worlds (`batch_size=[n]`, `set_difficulty(difficulty, env_ids)` one "
        "indexed write) from 1,024 to 65,536 worlds: attach time, frames/s with envsync attached and nothing "
        "pending, a push of one row per world to applied against the env's own indexed write, a curriculum pushing "
        "to 10% of the worlds after every batch, `read_attributes` of every world against a direct read, and the "
        "memory envsync adds per world; with mjlab's Cartpole (a mass factor per world) where mjlab is installed.",
    ),
    "rebuild": ("Rebuild against attribute set", "`envsync.apply.rebuild()` against `envsync.apply.attributes()`."),
    "wait": (
        "A wait the worlds answer late",
        "The waiting process's CPU while a push's wait for 'applied' blocks on thousands of worlds that apply it only "
        "at their next reset (an idle collector: the wait ends at its timeout): the wait reads each link's counters as "
        "columns and asks liveness once per worker process, against the same window slept.",
    ),
    "curriculum": (
        "Curricula against Syllabus",
        "A domain-randomisation curriculum over 1, 4, 8 envs: envsync against Syllabus 0.7 "
        "(`GymnasiumSyncWrapper` over gymnasium's `AsyncVectorEnv`): throughput, episodes started on a "
        "stale task after a decision, and episodes and frames credited to the task they ran.",
    ),
    "curriculum_instructions": (
        "A curriculum's cost, in instructions",
        "The curriculum set-up of the section above in instructions per frame: without envsync, "
        "attached with nothing pushed, and observing and pushing every batch.",
    ),
    "push_instructions": (
        "The small push, in instructions",
        "The main process's instructions per small push to 4 and 16 idle workers, against gymnasium's "
        "`call` (a diagnostic of where the time goes).",
    ),
    "ray": (
        "Ray, 2 nodes x 2 workers",
        "Over a local two-node Ray cluster: a config push, a 1 MB env-state push and a 1 MB push of "
        "per-env rows, against `RayCollector.update_policy_weights_()` of ~1 MB and a restart.",
    ),
}


def command(path: Path, document: dict[str, Any]) -> str:
    """The command line that reproduces the run (every argument it recorded)."""
    parts = [f"python benchmarks/bench_{document['benchmark']}.py"]
    for name, value in document.get("args", {}).items():
        flag = "--" + name.replace("_", "-")
        if name in ("quick", "out") or value is None or value is False or value == "":
            continue
        if value is True:
            parts.append(flag)
        elif isinstance(value, list):
            parts.append(flag + " " + " ".join(str(v) for v in value))
        else:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


def run_facts(document: dict[str, Any]) -> str:
    facts = document.get("machine", {})
    commit = facts.get("commit")
    source = facts.get("envsync_source_sha1", "?")
    code = f"commit `{commit}`" if commit else f"commit not recorded (envsync source `{source}`)"
    when = facts.get("date", "date not recorded")
    load = fmt(facts.get("load_avg_1min", float("nan")))
    versions = ", ".join(f"{k} {facts[k]}" for k in ("python", "torch", "torchrl", "gymnasium") if k in facts)
    return f"{code}; {when}; load {load} (1 min) on {facts.get('cpus', '?')} cores; {versions}."


def tables(path: Path) -> str:
    """The run's own tables and notes (its ``.md``), without its heading and targets."""
    md = path.with_suffix(".md")
    if not md.exists():
        return ""
    blocks = md.read_text().strip().split("\n\n")[1:]
    kept: list[str] = []
    skip = False
    for block in blocks:
        if block.strip() == "Targets:":
            skip = True
            continue
        if not skip:
            kept.append(block)
        skip = False
    return "\n\n".join(kept)


def ordered_runs(folder: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Each benchmark's own run first, in the order of ``SECTIONS``, then later partial runs."""
    order = {name: i for i, name in enumerate(SECTIONS)}
    found = targets.runs(folder)

    def key(run: tuple[Path, dict[str, Any]]) -> tuple[int, str, bool]:
        name = run[1]["benchmark"]
        return (order.get(name, len(order)), name, run[0].stem != name)

    return sorted(found, key=key)


def section(path: Path, document: dict[str, Any]) -> str:
    name = document["benchmark"]
    heading, question = SECTIONS.get(name, (name, ""))
    own = path.stem == name
    title = f"## {heading}" if own else f"### A later run, kept beside it (`{path.name}`)"
    lines = [title, ""]
    if own and question:
        lines += [question, ""]
    lines += [f"Reproduce: `{command(path, document)}`", "", f"Run: {run_facts(document)}", ""]
    body = tables(path)
    return "\n".join(lines) + (body + "\n" if body else "")


def headline(folder: Path) -> str:
    """The figures the README quotes, read from the runs."""

    def load(name: str) -> dict[str, Any] | None:
        path = folder / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    lines = ["| figure | measured | section |", "|---|---|---|"]
    workload = load("workload")
    if workload:
        for row in workload["rows"]:
            lines.append(
                f"| restart / push, {row['workers']} spawn worker{'s' if row['workers'] != 1 else ''}, "
                "`MultiAsyncCollector` being iterated | "
                f"{fmt(row['restart_over_received'])}x received, {fmt(row['restart_over_applied'])}x applied "
                f"({fmt(row['restart_ms'] / 1000)} s against {fmt(row['push_applied_us'] / 1000)} ms) | "
                "[switch vs restart](#switch-vs-restart-1-to-20-workers) |"
            )
    latency = load("switch_latency")
    if latency:
        for row in latency["rows"]:
            lines.append(
                f"| small push to {row['workers']} idle workers / gymnasium `AsyncVectorEnv.call` | "
                f"{fmt(row['envsync_idle_us'] / row['gym_call_us'])}x | "
                "[switch latency](#switch-latency-against-map_fn-and-gymnasium) |"
            )
    hot = load("hot_path_instructions")
    if hot:
        for row in hot["rows"]:
            lines.append(
                f"| hot path, nothing pending, cheap env, {row['collector']}: frames per instruction with / without | "
                f"{fmt(row['frames_per_instruction_ratio'])} | [hot path](#hot-path-in-instructions) |"
            )
    ray = load("ray")
    if ray:
        lines.append(
            "| Ray: 1 MB env-state push / `update_policy_weights_()` of the same bytes | "
            f"{fmt(ray['summary']['env_state_push_over_policy'])}x | [Ray](#ray-2-nodes-x-2-workers) |"
        )
    return "\n".join(lines) + "\n"


def render(folder: Path = RESULTS) -> str:
    parts = [
        "<!-- Generated by benchmarks/make_performance_page.py from benchmarks/results/*.json: "
        "edit the script or rerun a benchmark, not this page. -->",
        "# Performance",
        "",
        "The current figures, each from the latest full run of its benchmark in "
        "`benchmarks/results/`, with the command that reproduces it and the run it comes from. "
        "The machine has 2 CPU cores shared with other work, so absolute times move between runs; "
        "every script interleaves what it compares and reports medians, and each ratio below is "
        "measured within one run. Compare ratios, not times across runs. `make bench` runs every "
        "benchmark; `benchmarks/README.md` says what each one asks. Earlier runs and their analyses "
        "are kept in `benchmarks/results/history/HISTORY.md`.",
        "",
        "## Headline figures",
        "",
        headline(folder),
        "## Every target, from the latest run that measured it",
        "",
        targets.render(folder).split("\n", 2)[2],
    ]
    text = "\n".join(parts)
    for path, document in ordered_runs(folder):
        text += "\n" + section(path, document)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS, help="results folder (default: benchmarks/results)")
    parser.add_argument("--out", type=Path, default=PAGE, help="the page (default: docs/performance.md)")
    parser.add_argument("--check", action="store_true", help="fail when the page differs; write nothing")
    args = parser.parse_args(argv)
    text = render(args.results)
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"{args.out} is out of date: run python benchmarks/make_performance_page.py", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
