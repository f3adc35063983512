"""The ``envsync`` command: ``envsync demo`` and ``envsync bench``."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def bench(quick: bool, out: str | None) -> None:
    """Run ``benchmarks/run_all.py`` of this checkout in a fresh interpreter.

    Raises:
        SystemExit: the benchmarks are not there (envsync was installed without its repository),
            or they failed (with their exit status).
    """
    script = BENCHMARKS / "run_all.py"
    if not script.is_file():
        raise SystemExit(
            f"envsync bench: {script} not found; the benchmarks ship with the repository, not the "
            "package: run it from a source checkout (pip install -e .)"
        )
    command = [sys.executable, str(script)] + (["--quick"] if quick else []) + (["--out", out] if out else [])
    status = subprocess.run(command, cwd=BENCHMARKS, check=False).returncode
    if status:
        raise SystemExit(status)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line and run the chosen command."""
    parser = argparse.ArgumentParser(prog="envsync", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="a curriculum on a running MultiAsyncCollector")
    demo.add_argument("--workers", type=int, default=4)
    demo.add_argument("--switches", type=int, default=8)
    demo.add_argument("--batches-per-switch", type=int, default=4)
    demo.add_argument("--frames-per-batch", type=int, default=200)
    demo.add_argument(
        "--start-method", choices=["spawn", "fork"], default="spawn", help="of the workers (torchrl's default: spawn)"
    )
    runner = commands.add_parser("bench", help="run the benchmarks of benchmarks/ (needs a source checkout)")
    runner.add_argument("--quick", action="store_true", help="a tiny budget (a smoke run)")
    runner.add_argument("--out", default=None, help="results folder (default: benchmarks/results[/quick])")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from envsync.demo import DemoArgs
        from envsync.demo import main as demo_main

        demo_main(
            DemoArgs(args.workers, args.switches, args.batches_per_switch, args.frames_per_batch, args.start_method)
        )
    elif args.command == "bench":
        bench(args.quick, args.out)
