"""Assemble ``results/targets.md``: one row per figure, from the latest run that measured it.

A figure is one target of one benchmark (its ``target`` text). Every non-quick
``<name>.json`` at the top of the folder is a run; a figure measured by several runs (a
benchmark's own file and a later partial run kept beside it) takes its row from the run with
the latest date. Timed figures that a benchmark also counts in instructions (``SUPERSEDED``)
are left out where the instruction count exists: on a shared 2-core machine the timed
window moves by more than the 1% the target asks about. Each row names its run (benchmark,
commit, date, load), so no figure stands without its run; ``run_all.py`` writes the same
table for one run of everything.

    python benchmarks/targets.py [--out benchmarks/results]     # targets.md and targets.json
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench_common import RESULTS, fmt

SUPERSEDED: dict[tuple[str, str], tuple[str, str]] = {
    # (benchmark, pattern of the timed figure) -> (the benchmark that counts it in instructions, in words)
    ("curriculum", r"^curriculum, \d+ envs: frames(/s| per CPU s)"): (
        "curriculum_instructions",
        "frames/s and frames per CPU s with the curriculum / without",
    ),
    ("hot_path", r"^hot path, cheap "): ("hot_path_instructions", "the cheap env's frames per CPU s with / without"),
}


def runs(folder: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every full run in ``folder`` (its top level; quick runs and other JSON left out)."""
    out = []
    for path in sorted(folder.glob("*.json")):
        document = json.loads(path.read_text())
        if isinstance(document, dict) and "targets" in document and not document.get("quick"):
            out.append((path, document))
    return out


def _age(path: Path, document: dict[str, Any]) -> tuple[str, bool]:
    """Sort key: the run's date (undated runs first), then the benchmark's own file last."""
    return (document.get("machine", {}).get("date", ""), path.stem == document["benchmark"])


def superseded(benchmark: str, target: str, present: set[str]) -> str | None:
    """The benchmark whose instruction count replaces this timed figure, if its run is here."""
    for (name, pattern), (successor, _) in SUPERSEDED.items():
        if name == benchmark and successor in present and re.match(pattern, target):
            return successor
    return None


def rows(folder: Path) -> list[dict[str, Any]]:
    """One row per figure, from the latest run that measured it, in benchmark order."""
    found = runs(folder)
    present = {document["benchmark"] for _, document in found}
    latest: dict[str, dict[str, Any]] = {}
    for path, document in sorted(found, key=lambda run: _age(*run)):
        facts = document.get("machine", {})
        for target in document["targets"]:
            if superseded(document["benchmark"], target["target"], present):
                continue
            latest[target["target"]] = target | {
                "benchmark": document["benchmark"],
                "file": path.name,
                "commit": facts.get("commit", "(not recorded)"),
                "date": facts.get("date", "(not recorded)"),
                "load": facts.get("load_avg_1min", float("nan")),
            }
    order = {name: i for i, name in enumerate(sorted(present))}
    return sorted(latest.values(), key=lambda row: order[row["benchmark"]])


def table(targets: list[dict[str, Any]]) -> str:
    keys = ("target", "measured", "goal", "met", "benchmark", "commit", "date", "load")
    head = "| target | measured | goal | met | benchmark | commit | date | load (1 min) |\n"
    head += "|---" * len(keys) + "|\n"
    return head + "".join("| " + " | ".join(fmt(t[k]) for k in keys) + " |\n" for t in targets)


def note(folder: Path) -> str:
    """The figures left out for an instruction count, said in words."""
    present = {document["benchmark"] for _, document in runs(folder)}
    lines = [
        f"- `{name}`: {words} (timed) left out; `{successor}` counts the same question in "
        "instructions, which the load of a shared machine does not move.\n"
        for (name, _), (successor, words) in SUPERSEDED.items()
        if name in present and successor in present
    ]
    return "".join(lines)


def render(folder: Path) -> str:
    """The text of ``targets.md`` for ``folder``."""
    text = "## Targets (one row per figure: the latest run that measured it)\n\n" + table(rows(folder))
    extra = note(folder)
    return text + ("\n" + extra if extra else "")


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default: benchmarks/results)")
    args = parser.parse_args(argv)
    text = render(args.out)
    (args.out / "targets.md").write_text(text)
    (args.out / "targets.json").write_text(json.dumps(rows(args.out), indent=2) + "\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
