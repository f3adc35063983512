"""Assemble ``results/targets.md`` from the latest result of every benchmark in a folder.

Each row names the run it comes from (benchmark, commit, date, load), so no figure stands
without its run; ``run_all.py`` writes the same table for one run of everything.

    python benchmarks/targets.py [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench_common import RESULTS, fmt


def rows(folder: Path) -> list[dict[str, Any]]:
    """Every target of every ``<benchmark>.json`` in ``folder`` (quick runs left out)."""
    out = []
    for path in sorted(folder.glob("*.json")):
        document = json.loads(path.read_text())
        if not isinstance(document, dict) or "targets" not in document or document.get("quick"):
            continue
        if path.stem != document["benchmark"]:  # a run kept for comparison, not the latest
            continue
        facts = document.get("machine", {})
        for target in document["targets"]:
            out.append(
                target
                | {
                    "benchmark": document["benchmark"],
                    "commit": facts.get("commit", "(not recorded)"),
                    "date": facts.get("date", "(not recorded)"),
                    "load": facts.get("load_avg_1min", float("nan")),
                }
            )
    return out


def table(targets: list[dict[str, Any]]) -> str:
    keys = ("target", "measured", "goal", "met", "benchmark", "commit", "date", "load")
    head = "| target | measured | goal | met | benchmark | commit | date | load (1 min) |\n"
    head += "|---" * len(keys) + "|\n"
    return head + "".join("| " + " | ".join(fmt(t[k]) for k in keys) + " |\n" for t in targets)


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default: benchmarks/results)")
    args = parser.parse_args(argv)
    text = "## Targets (the latest run of each benchmark; each row names its run)\n\n" + table(rows(args.out))
    (args.out / "targets.md").write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
