"""Domain randomisation: every few batches, each worker gets new random pendulum physics.

Four workers collect gymnasium's ``Pendulum-v1`` through a ``MultiAsyncCollector``. Every
``every`` batches, one ``sender.push_each`` gives each worker its own random gravity ``g``,
mass ``m``, length ``l`` and speed limit ``max_speed`` (one new version for all of them);
each worker switches at its next episode reset (``apply_at="reset"``).

The data is then checked against the physics, not against labels: a pendulum step is

    thdot' = thdot + dt * (3 g / (2 l) * sin(th) + 3 / (m l^2) * u)     (unless clipped)

so a least-squares fit over the frames of one batch tagged with one version measures
``a = 3g/(2l)`` and ``b = 3/(ml^2)``. Those must match the parameters pushed to exactly one
worker under that version, every version group of a batch must match the same worker (a
batch comes from one worker), and no speed may exceed that worker's ``max_speed``. The
script plots pushed vs measured physics per version and writes the numbers to JSON.

Needs: envsync alone. The plot needs matplotlib (`pip install "envsync[bench]"`); without it
the run goes on and says so instead of drawing.

    python examples/domain_randomization.py            # 4 workers, 10 randomisations
    python examples/domain_randomization.py --smoke    # 2 workers, a few seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import random
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from tensordict import TensorDictBase
from torchrl.collectors import MultiAsyncCollector
from torchrl.envs import GymEnv

import envsync
from envsync import EnvStateSender

DEFAULT_OUT = Path(__file__).resolve().parent / "out"
TEMPLATE = {"g": 10.0, "m": 1.0, "l": 1.0, "max_speed": 8.0}
RANGES = {"g": (5.0, 15.0), "m": (0.5, 2.0), "l": (0.5, 1.5), "max_speed": (4.0, 8.0)}
DT = 0.05
MAX_TORQUE = 2.0
MIN_FRAMES_TO_FIT = 8
RTOL = 1e-3


@dataclass
class Args:
    """Arguments of the example."""

    workers: int = 4
    randomisations: int = 10
    every: int = 4
    frames_per_batch: int = 200
    episode_steps: int = 100
    seed: int = 0
    out: Path = DEFAULT_OUT

    @classmethod
    def smoke(cls) -> Args:
        """A tiny budget for CI."""
        return cls(workers=2, randomisations=3, every=2, frames_per_batch=100, episode_steps=50)


def make_pendulum(episode_steps: int = 100) -> GymEnv:
    """The worker env: plain ``Pendulum-v1``, shorter episodes so resets (and switches) come often."""
    return GymEnv("Pendulum-v1", max_episode_steps=episode_steps)


def sample_physics(rng: random.Random) -> dict[str, float]:
    return {name: round(rng.uniform(low, high), 3) for name, (low, high) in RANGES.items()}


def identifiable(physics: dict[str, float]) -> tuple[float, float]:
    """The two combinations a pendulum step reveals: ``3g/(2l)`` and ``3/(ml^2)``."""
    return 3 * physics["g"] / (2 * physics["l"]), 3 / (physics["m"] * physics["l"] ** 2)


def measure(frames: TensorDictBase) -> dict[str, float] | None:
    """Fit ``a = 3g/(2l)`` and ``b = 3/(ml^2)`` to unclipped steps; ``None`` if too few."""
    speed = frames["observation"][:, 2].double()
    next_speed = frames["next", "observation"][:, 2].double()
    fits = next_speed.abs() < RANGES["max_speed"][0] - 1e-3
    if int(fits.sum()) < MIN_FRAMES_TO_FIT:
        return None
    sin_th = frames["observation"][:, 1].double()[fits]
    torque = frames["action"][:, 0].double().clamp(-MAX_TORQUE, MAX_TORQUE)[fits]
    accel = (next_speed[fits] - speed[fits]) / DT
    solution = torch.linalg.lstsq(torch.stack([sin_th, torque], dim=1), accel.unsqueeze(1)).solution
    return {"a": float(solution[0]), "b": float(solution[1]), "top_speed": float(next_speed.abs().max())}


def match_worker(measured: dict[str, float], pushed: dict[int, dict[str, float]]) -> list[int]:
    """The workers whose pushed physics explain the measured dynamics."""
    found = []
    for worker, physics in pushed.items():
        a, b = identifiable(physics)
        if (
            abs(measured["a"] - a) <= RTOL * a
            and abs(measured["b"] - b) <= RTOL * b
            and measured["top_speed"] <= physics["max_speed"] + 1e-4
        ):
            found.append(worker)
    return found


class Check:
    """Collects what the data shows and what it contradicts."""

    def __init__(self, pushed: dict[int, dict[int, dict[str, float]]]) -> None:
        self.pushed = pushed
        self.measured: dict[int, dict[int, list[dict[str, float]]]] = defaultdict(lambda: defaultdict(list))
        self.frames: dict[int, int] = defaultdict(int)
        self.failures: list[str] = []
        self.unfitted = 0

    def batch(self, index: int, batch: TensorDictBase) -> None:
        tags = batch["next", "env_version"].reshape(-1)
        if not bool((batch["env_version"].reshape(-1) == tags).all()):
            self.failures.append(f"batch {index}: root and next tags differ inside an episode (reset mode)")
        owners = set()
        for version in tags.unique().tolist():
            frames = batch[tags == version]
            self.frames[version] += frames.numel()
            measured = measure(frames)
            if measured is None:
                self.unfitted += 1
                continue
            workers = match_worker(measured, self.pushed[version])
            if not workers:
                self.failures.append(f"batch {index}, version {version}: {measured} matches no worker's physics")
                continue
            if len(workers) == 1:
                owners.add(workers[0])
            self.measured[version][workers[0]].append(measured)
        if len(owners) > 1:
            self.failures.append(f"batch {index}: its versions match different workers {sorted(owners)}")


def collect(args: Args) -> Check:
    """Run the collector, randomise the physics, check every batch."""
    rng = random.Random(args.seed)
    # each name is an attribute of the unwrapped gymnasium pendulum: attributes() finds and sets it
    sender = EnvStateSender(config=TEMPLATE, apply=envsync.apply.attributes(), apply_at="reset")
    pushed: dict[int, dict[int, dict[str, float]]] = {0: dict.fromkeys(range(args.workers), TEMPLATE)}
    check = Check(pushed)
    total = args.every * (args.randomisations + 1)
    factory = sender.env_fn(partial(make_pendulum, args.episode_steps))
    collector = MultiAsyncCollector(
        [factory] * args.workers,
        None,
        frames_per_batch=args.frames_per_batch,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
    )
    try:
        for i, batch in enumerate(collector):
            check.batch(i, batch)
            if i + 1 == total:
                break
            if (i + 1) % args.every == 0:
                physics = {w: sample_physics(rng) for w in range(args.workers)}
                version = sender.push_each(physics)
                pushed[version] = physics
    finally:
        collector.shutdown()
        sender.close()
    return check


def report(check: Check) -> str:
    """One row per version and worker: pushed physics, what the dynamics show, batches checked."""
    lines = [
        "version  worker      g     m     l  max_speed | 3g/2l pushed  measured | 3/ml2 pushed  measured | batches",
        "-------  ------  -----  ----  ----  --------- | ------------  -------- | ------------  -------- | -------",
    ]
    for version in sorted(check.pushed):
        rows = check.pushed[version]
        if version == 0:
            rows = {0: TEMPLATE}  # the template: every worker runs it, the data cannot tell them apart
        for worker, physics in sorted(rows.items()):
            a, b = identifiable(physics)
            seen = check.measured.get(version, {}).get(worker, [])
            ma, mb = (f"{seen[0]['a']:8.3f}", f"{seen[0]['b']:8.3f}") if seen else ("     n/a", "     n/a")
            who = "all" if version == 0 else str(worker)
            lines.append(
                f"{version:>7}  {who:>6}  {physics['g']:5.2f}  {physics['m']:4.2f}  {physics['l']:4.2f}"
                f"  {physics['max_speed']:9.2f} | {a:12.3f}  {ma} | {b:12.3f}  {mb} | {len(seen):>7}"
            )
    return "\n".join(lines)


def plot(check: Check, path: Path) -> None:
    """Pushed (circles) vs measured (crosses) physics per version, one colour per worker."""
    if importlib.util.find_spec("matplotlib") is None:
        print(f'no plot ({path.name}): matplotlib is missing; pip install "envsync[bench]"')
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharex=True)
    colours = plt.get_cmap("tab10")
    for version in sorted(check.pushed):
        for worker, physics in check.pushed[version].items():
            pushed = (*identifiable(physics), physics["max_speed"])
            for axis, value in zip(axes, pushed, strict=True):
                axis.scatter(version, value, marker="o", facecolors="none", edgecolors=colours(worker), s=70)
            for seen in check.measured.get(version, {}).get(worker, []):
                for axis, key in zip(axes, ("a", "b", "top_speed"), strict=True):
                    axis.scatter(version, seen[key], marker="x", color=colours(worker), s=30)
    axes[0].set_title("3g/(2l): pushed (o), measured from the dynamics (x)")
    axes[1].set_title("3/(ml²): pushed (o), measured from the dynamics (x)")
    axes[2].set_title("max_speed pushed (o), top |thdot| in the data (x)")
    for axis in axes:
        axis.set_xlabel("env_version")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    workers = sorted({w for physics in check.pushed.values() for w in physics})
    handles = [plt.Line2D([], [], color=colours(w), marker="o", linestyle="", label=f"worker {w}") for w in workers]
    axes[2].legend(handles=handles, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny budget (CI)")
    for field in dataclasses.fields(Args):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=None)
    given = vars(parser.parse_args(argv))
    args = Args.smoke() if given.pop("smoke") else Args()
    return dataclasses.replace(args, **{k: v for k, v in given.items() if v is not None})


def main(argv: Sequence[str] | None = None) -> None:
    """Run the example; exit non-zero if the data contradicts the pushed physics."""
    args = parse_args(argv)
    check = collect(args)
    print(report(check))
    args.out.mkdir(parents=True, exist_ok=True)
    plot(check, args.out / "domain_randomization.png")
    verified = sorted(v for v in check.measured if v > 0)
    result = {
        "pushed": {v: {w: p for w, p in ws.items()} for v, ws in check.pushed.items()},
        "measured": {v: {w: seen for w, seen in ws.items()} for v, ws in check.measured.items()},
        "frames_per_version": dict(check.frames),
        "failures": check.failures,
    }
    (args.out / "domain_randomization.json").write_text(json.dumps(result, indent=2))
    print(f"\nversions seen in the data: {sorted(check.frames)}; verified from the dynamics: {verified}")
    print(f"groups too short to fit: {check.unfitted}; plot and JSON in {args.out}")
    if check.failures:
        sys.exit("FAILED:\n" + "\n".join(check.failures))
    if not verified:
        sys.exit("FAILED: no randomised version was verified in the data")


if __name__ == "__main__":
    main()
