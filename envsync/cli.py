"""The ``envsync`` command: ``envsync demo``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line and run the chosen command."""
    parser = argparse.ArgumentParser(prog="envsync", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="a curriculum on a running MultiAsyncCollector")
    demo.add_argument("--workers", type=int, default=4)
    demo.add_argument("--switches", type=int, default=8)
    demo.add_argument("--batches-per-switch", type=int, default=4)
    demo.add_argument("--frames-per-batch", type=int, default=200)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from envsync.demo import DemoArgs
        from envsync.demo import main as demo_main

        demo_main(DemoArgs(args.workers, args.switches, args.batches_per_switch, args.frames_per_batch))
