"""What a 10% curriculum costs on a simulator's step: mjlab's Cartpole of n worlds.

Needs the mjlab venv (``make .venv-mjlab/.installed``). Two ``Collector`` s of mjlab's
Cartpole (torchrl's ``MJLabEnv``, Warp's CPU device, ``--steps`` steps a batch) in this
process take turns, ``--rounds`` windows of ``--batches`` batches each (the order alternating):
after every batch, the one with envsync pushes a mass factor to a random 10% of its worlds
(``envs=`` their ids, ``wait="received"``, ``apply=envsync.apply.scales(...,
finish=recompute_constants())``, ``apply_at="step"``); the one without writes the same kind of
rows into its own model (``body_mass`` and ``body_inertia`` at the rows, per-world memory)
and calls ``sim.recompute_constants(set_const)``, as a user does it by hand. Prints each
window's frames/s ratio with / without, and their median. ``bench_worlds.py`` measures the
same curriculum on a cheap env whose step costs ~60 ns a frame; this one on a step of a
real simulator (~150 ms for 4,096 worlds on this CPU).

    .venv-mjlab/bin/python benchmarks/mjlab_curriculum_probe.py [--worlds 4096] [--steps 4] [--rounds 6]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
from bench_envs import make_mjlab_cartpole

import envsync
from envsync import EnvStateSender

FIELDS = ("body_mass", "body_inertia")


def main(argv: Sequence[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=4, help="steps a batch")
    parser.add_argument("--batches", type=int, default=4, help="batches a window")
    parser.add_argument("--rounds", type=int, default=6, help="windows of each collector")
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from mjlab.managers.event_manager import RecomputeLevel, requires_model_fields
    from torchrl.collectors import Collector

    n, k = args.worlds, max(1, round(args.worlds * args.fraction))
    apply = envsync.apply.scales(
        {"mass": ["sim.model.body_mass", "sim.model.body_inertia"]}, finish=envsync.apply.recompute_constants()
    )
    sender = EnvStateSender(config={"mass": 1.0}, apply=apply, apply_at="step")
    frames = args.steps * n
    with contextlib.redirect_stdout(io.StringIO()):  # mjlab prints its managers' tables at every build
        with_ = Collector(
            sender.env_fn(partial(make_mjlab_cartpole, n)),
            None,
            frames_per_batch=frames,
            total_frames=-1,
            weight_sync_schemes=sender.schemes(),
        )
        without = Collector(partial(make_mjlab_cartpole, n), None, frames_per_batch=frames, total_frames=-1)
    try:
        sim = without.env.sim
        derived = requires_model_fields(recompute=RecomputeLevel.set_const)(lambda: None).model_fields
        sim.expand_model_fields(tuple(f for f in (*FIELDS, *derived) if hasattr(sim.mj_model, f)))
        built = {f: getattr(sim.model, f)[...].clone() for f in FIELDS}
        generator = torch.Generator().manual_seed(args.seed)

        def pick() -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randperm(n, generator=generator)[:k].sort().values, 0.5 + torch.rand(k, generator=generator)

        def push() -> None:
            ids, rows = pick()
            sender.push(config={"mass": rows}, envs=ids, wait="received")

        def write() -> None:
            ids, rows = pick()
            sim.model.body_mass[ids] = built["body_mass"][ids] * rows[:, None]
            sim.model.body_inertia[ids] = built["body_inertia"][ids] * rows[:, None, None]
            sim.recompute_constants(RecomputeLevel.set_const)

        batches: dict[str, Iterator[Any]] = {"with": iter(with_), "without": iter(without)}
        bodies: dict[str, Callable[[], None]] = {"with": push, "without": write}
        for name in batches:  # warm: the first batch, the first write compile Warp's kernels
            next(batches[name])
            bodies[name]()
            next(batches[name])

        def window(name: str) -> float:
            start = time.perf_counter()
            for _ in range(args.batches):
                next(batches[name])
                bodies[name]()
            return args.batches * frames / (time.perf_counter() - start)

        ratios = []
        for round_ in range(args.rounds):
            order = ("with", "without") if round_ % 2 else ("without", "with")
            fps = {name: window(name) for name in order}
            ratios.append(fps["with"] / fps["without"])
            print(f"window {round_}: with {fps['with']:,.0f} frames/s, without {fps['without']:,.0f}: {ratios[-1]:.3f}")
        ratio = statistics.median(ratios)
        print(f"{n} worlds, {k} a push after every batch of {args.steps} steps: median ratio {ratio:.3f}")
        return ratio
    finally:
        with_.shutdown()
        without.shutdown()
        sender.close()


if __name__ == "__main__":
    main()
