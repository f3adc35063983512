"""A gravity curriculum on Pendulum-v1, two ways: set the attribute, or rebuild the env.

``EnvStateSender.from_env`` reads the template from the env (``g`` as gymnasium builds it:
10.0, a float64), so version 0 is the env as built. Then, every ``every`` batches of a
``MultiSyncCollector``, the curriculum lowers ``g`` one step, once with
``envsync.apply.attributes()`` (sets ``unwrapped.g``: no private reach-in) and once with
``envsync.apply.rebuild()`` (``GymEnv.rebuild_with_kwargs(g=...)``: a new, seeded gymnasium
env; what constructor-only parameters need). A push that would change the env's specs would
be refused in the main process; this one does not.

The data is checked against the physics, not the labels: a pendulum step is

    thdot' = thdot + (3 g / (2 l) sin(th) + 3 u / (m l^2)) dt      (l = m = 1, dt = 0.05)

unless ``thdot'`` is clipped to ``max_speed`` (``u`` is clipped to ``max_torque``), so a
least-squares fit over the unclipped steps of each version's frames measures ``g``; it must
be the value that version pushed. The script prints pushed vs measured ``g`` per version and
the push -> applied time of each way, and writes them to JSON and a plot.

Needs: envsync alone. The plot needs matplotlib (`pip install "envsync[bench]"`); without it
the run goes on and says so instead of drawing.

    python examples/gravity_curriculum.py            # 2 workers, 6 steps of the curriculum
    python examples/gravity_curriculum.py --smoke    # a few seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from tensordict import TensorDictBase
from torchrl.collectors import MultiSyncCollector
from torchrl.envs import GymEnv

import envsync
from envsync import EnvStateSender

DEFAULT_OUT = Path(__file__).resolve().parent / "out"
DT, MAX_TORQUE, MAX_SPEED = 0.05, 2.0, 8.0
MIN_FRAMES_TO_FIT = 8
RTOL = 1e-4
APPLIES = {"attributes": envsync.apply.attributes, "rebuild": envsync.apply.rebuild}


@dataclass
class Args:
    """Arguments of the example."""

    workers: int = 2
    stages: int = 6
    every: int = 3
    g_step: float = 1.5
    frames_per_batch: int = 200
    episode_steps: int = 50
    applies: str = "attributes,rebuild"
    out: Path = DEFAULT_OUT

    @classmethod
    def smoke(cls) -> Args:
        """A tiny budget for CI."""
        return cls(stages=2, every=2, frames_per_batch=96, episode_steps=16)


def make_pendulum(episode_steps: int = 50) -> GymEnv:
    """The worker env: plain ``Pendulum-v1``, shorter episodes so resets (and switches) come often."""
    return GymEnv("Pendulum-v1", max_episode_steps=episode_steps)


def measure_g(frames: TensorDictBase) -> float | None:
    """The gravity the steps in ``frames`` ran under; ``None`` with too few unclipped steps."""
    thdot, next_thdot = frames["observation"][:, 2].double(), frames["next", "observation"][:, 2].double()
    free = next_thdot.abs() < MAX_SPEED - 1e-3
    if int(free.sum()) < MIN_FRAMES_TO_FIT:
        return None
    sin_th = frames["observation"][:, 1].double()[free]
    torque = frames["action"][:, 0].double().clamp(-MAX_TORQUE, MAX_TORQUE)[free]
    rhs = (next_thdot[free] - thdot[free]) / DT - 3 * torque
    return float(2 * (sin_th * rhs).sum() / (3 * (sin_th * sin_th).sum()))


def run(args: Args, apply_name: str) -> dict[str, Any]:
    """One curriculum with one way of applying it; every version's frames checked."""
    factory = partial(make_pendulum, args.episode_steps)
    # "truncate": a push from this loop (the workers are idle in it) applies at once and the
    # worker's env starts a fresh episode, so wait="applied" returns and the next batch runs the new g
    sender = EnvStateSender.from_env(factory, config=["g"], apply=APPLIES[apply_name](), apply_at="truncate")
    pushed = {0: float(sender.desired_config()["g"])}
    measured: dict[int, list[float]] = {}
    failures: list[str] = []
    applied_ms: list[float] = []
    collector = MultiSyncCollector(
        [sender.env_fn(factory)] * args.workers,
        None,
        frames_per_batch=args.frames_per_batch,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
    )
    try:
        for i, batch in enumerate(collector):
            frames = batch.reshape(-1)
            tags = frames["next", "env_version"]
            for version in tags.unique().tolist():
                g = measure_g(frames[tags == version])
                if g is None:
                    continue
                measured.setdefault(version, []).append(g)
                if abs(g - pushed[version]) > RTOL * pushed[version]:
                    failures.append(
                        f"{apply_name}, batch {i}: version {version} measured g={g:.5f}, pushed {pushed[version]}"
                    )
            if i + 1 == args.every * (args.stages + 1):
                break
            if (i + 1) % args.every == 0:
                g = pushed[0] - args.g_step * len(pushed)
                start = time.perf_counter()
                version = sender.push(config={"g": g}, wait="applied")
                applied_ms.append((time.perf_counter() - start) * 1e3)
                pushed[version] = g
    finally:
        collector.shutdown()
        sender.close()
    unseen = sorted(set(pushed) - set(measured))
    if unseen:
        failures.append(f"{apply_name}: no batch showed versions {unseen}")
    return {"pushed": pushed, "measured": measured, "push_applied_ms": applied_ms, "failures": failures}


def report(results: dict[str, dict[str, Any]]) -> str:
    lines = ["apply       version  pushed g  measured g (first batch)  batches", "-" * 64]
    for name, result in results.items():
        for version, g in result["pushed"].items():
            seen = result["measured"].get(version, [])
            shown = f"{seen[0]:10.5f}" if seen else "       n/a"
            lines.append(f"{name:<10}  {version:>7}  {g:8.3f}  {shown:>24}  {len(seen):>7}")
        times = sorted(result["push_applied_ms"])
        if times:
            lines.append(f"{name:<10}  push -> applied by all workers: median {times[len(times) // 2]:.1f} ms")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        print(f'no plot ({path.name}): matplotlib is missing; pip install "envsync[bench]"')
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (name, result), marker in zip(results.items(), "ox", strict=False):
        ax.plot(list(result["pushed"]), list(result["pushed"].values()), color="grey", linewidth=0.8)
        for version, seen in result["measured"].items():
            ax.scatter([version] * len(seen), seen, marker=marker, label=name if version == 0 else None)
    ax.set(xlabel="env_version", ylabel="g", title="pushed g (line) and g measured from the dynamics")
    ax.legend()
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
    """Run the curriculum each way; exit non-zero if the dynamics contradict a pushed g."""
    args = parse_args(argv)
    results = {name: run(args, name) for name in args.applies.split(",")}
    print(report(results))
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, args.out / "gravity_curriculum.png")
    (args.out / "gravity_curriculum.json").write_text(json.dumps(results, indent=2))
    failures = [f for result in results.values() for f in result["failures"]]
    print(f"\nplot and JSON in {args.out}")
    if failures:
        sys.exit("FAILED:\n" + "\n".join(failures))
    print("every version's frames showed the gravity it pushed")


if __name__ == "__main__":  # torchrl starts workers with spawn: guard the entry point
    main()
