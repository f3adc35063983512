"""What does a rebuild cost against an attribute set?

Pendulum-v1's gravity ``g`` changed two ways: ``envsync.apply.attributes()`` (sets
``unwrapped.g``) and ``envsync.apply.rebuild()`` (``GymEnv.rebuild_with_kwargs(g=...)``: a new
gymnasium env, seeded, plus the main-process check that the spaces stay the same). Measured:

* one apply, in this process, on a built ``GymEnv`` (the bound applier a worker runs);
* ``push(wait=None)`` in the main process (validation, the rebuild's spec check, the write);
* push -> applied by every worker of an idle ``MultiSyncCollector`` (``apply_at="truncate"``:
  applied at once, then the worker's env is reset through its collector).

A third row measures an attribute *path* into a simulator: HalfCheetah-v5's
``model.body_mass`` (MuJoCo, an (8,) float64 array written in place): one apply in process,
and a ``push_each`` of its own mass array to each of ``path_workers`` workers (push ->
applied by all). It needs the ``mujoco`` extra; without MuJoCo the row is left out.

    python benchmarks/bench_rebuild.py [--quick]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from bench_common import RESULTS, Report, median, parse_args, save_plot, start_method, timed
from torchrl.envs import GymEnv
from tqdm import tqdm

import envsync
from envsync import EnvStateSender

NAME = "rebuild"
APPLIES: dict[str, Callable[[], Any]] = {"attributes": envsync.apply.attributes, "rebuild": envsync.apply.rebuild}


@dataclass
class Args:
    workers: int = 2
    path_workers: int = 4
    repeats: int = 30
    start_method: str = "fork"
    quick: bool = False
    out: Path = RESULTS


def quick(args: Args) -> Args:
    return replace(args, repeats=3)


def make_pendulum() -> GymEnv:
    return GymEnv("Pendulum-v1")


def _apply_seconds(apply: Any, repeats: int) -> list[float]:
    env = make_pendulum()
    bound = apply.bind(env)
    bound({"g": np.array(10.0)})  # the first call resolves (and warms up) what it sets
    seconds = [timed(lambda i=i: bound({"g": np.array(5.0 + i % 7)})) for i in range(repeats)]
    env.close()
    return seconds


def _timed_pushes(
    sender: EnvStateSender,
    make_env: Callable[[], Any],
    workers: int,
    args: Args,
    bar: tqdm,
    payload: Callable[[int], Any],
    send: Callable[[Any], int],
) -> tuple[list[float], list[float]]:
    """Seconds to push (``send(payload(i))``, not waited for) and to every worker applying it,
    ``args.repeats`` rounds after one warm-up round, to a MultiSyncCollector of ``workers``
    workers of ``make_env`` (the payload built before the clock starts)."""
    from torchrl.collectors import MultiSyncCollector

    collector = None
    sent, applied = [], []
    try:
        with start_method(args.start_method):
            collector = MultiSyncCollector(
                [sender.env_fn(make_env)] * workers,
                None,
                frames_per_batch=32 * workers,
                total_frames=-1,
                weight_sync_schemes=sender.schemes(),
            )
        batches = iter(collector)
        next(batches)
        for i in range(args.repeats + 1):
            value = payload(i)
            start = time.perf_counter()
            version = send(value)
            pushed = time.perf_counter()
            sender.wait(version, until="applied", timeout=30.0)
            if i:  # the first round warms caches and threads up
                sent.append(pushed - start)
                applied.append(time.perf_counter() - start)
            bar.update()
    finally:
        if collector is not None:
            collector.shutdown()
        sender.close()
    return sent, applied


def _push_seconds(apply: Any, args: Args, bar: tqdm) -> tuple[list[float], list[float]]:
    sender = EnvStateSender.from_env(make_pendulum, config=["g"], apply=apply, apply_at="truncate")
    return _timed_pushes(
        sender,
        make_pendulum,
        args.workers,
        args,
        bar,
        lambda i: {"g": 5.0 + i % 7},
        lambda config: sender.push(config=config, wait=None),
    )


PATH = "model.body_mass"


def make_cheetah() -> GymEnv:
    return GymEnv("HalfCheetah-v5")


def _path_apply_seconds(repeats: int) -> list[float]:
    env = make_cheetah()
    bound = envsync.apply.attributes().bind(env)
    masses = envsync.apply.attributes().read(env, [PATH])[PATH].copy()
    bound({PATH: masses})  # the first call resolves and checks the path
    seconds = [timed(lambda i=i: bound({PATH: masses * (1.0 + 0.1 * (i % 5))})) for i in range(repeats)]
    env.close()
    return seconds


def _path_push_seconds(args: Args, bar: tqdm) -> tuple[list[float], list[float]]:
    sender = EnvStateSender.from_env(make_cheetah, config=[PATH], apply=envsync.apply.attributes(), apply_at="truncate")
    built = sender.desired_config()["model", "body_mass"].clone()
    workers = args.path_workers

    def rows(i: int) -> dict[int, Any]:
        return {w: {"model": {"body_mass": built * (1.0 + 0.1 * ((i + w) % 5))}} for w in range(workers)}

    return _timed_pushes(
        sender, make_cheetah, workers, args, bar, rows, lambda configs: sender.push_each(configs, wait=None)
    )


def _row(apply: str, workers: int, apply_s: list[float], sent: list[float], applied: list[float]) -> dict[str, Any]:
    return {
        "apply": apply,
        "workers": workers,
        "apply_us": median(apply_s) * 1e6,
        "push_us": median(sent) * 1e6,
        "push_applied_ms": median(applied) * 1e3,
        "raw_s": {"apply": apply_s, "push": sent, "push_applied": applied},
    }


def _measure_path(args: Args, bar: tqdm) -> dict[str, Any]:
    apply_s = _path_apply_seconds(args.repeats)
    sent, applied = _path_push_seconds(args, bar)
    return _row(f"attributes() path {PATH} (HalfCheetah, push_each)", args.path_workers, apply_s, sent, applied)


def _has_mujoco() -> bool:
    import importlib.util

    return importlib.util.find_spec("mujoco") is not None


def _measure(name: str, args: Args, bar: tqdm) -> dict[str, Any]:
    apply_s = _apply_seconds(APPLIES[name](), args.repeats)
    sent, applied = _push_seconds(APPLIES[name](), args, bar)
    return _row(name, args.workers, apply_s, sent, applied)


COLUMNS = [
    ("apply", "apply="),
    ("apply_us", "one apply in process (µs)"),
    ("push_us", "push(wait=None) in main (µs)"),
    ("workers", "workers"),
    ("push_applied_ms", "push -> applied by all, idle, + reset (ms)"),
]


def _plot(rows: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.5))
    for axis, (key, title) in zip(axes, COLUMNS[1:3] + COLUMNS[4:], strict=True):
        labels = [r["apply"].split(" ")[0] + (" path" if " path " in r["apply"] else "") for r in rows]
        axis.bar(labels, [r[key] for r in rows], color=["tab:blue", "tab:orange", "tab:green"][: len(rows)])
        axis.set(title=title, yscale="log")
    return save_plot(fig, out, NAME)


def run(args: Args) -> dict[str, Any]:
    path = _has_mujoco()
    with tqdm(total=(len(APPLIES) + path) * (args.repeats + 1), desc=NAME, unit="push") as bar:
        rows = [_measure(name, args, bar) for name in APPLIES]
        if path:
            rows.append(_measure_path(args, bar))
    by = {r["apply"]: r for r in rows}
    summary = {
        "plots": [_plot(rows, args.out).name],
        "rebuild_over_attributes": {
            key: by["rebuild"][key] / by["attributes"][key] for key in ("apply_us", "push_us", "push_applied_ms")
        },
    }
    report = Report(
        name=NAME,
        args=args,
        rows=rows,
        tables=[("Median cost of changing Pendulum-v1's g (and HalfCheetah-v5's body masses, by path)", COLUMNS)],
        summary=summary,
        targets=[],
        notes=[
            "rebuild: gym.make of a new env + torchrl's spec remake + reset(seed=...); its push also makes "
            "the env twice in main (before/after spaces) to refuse a spec change before sending",
            f"collector: MultiSyncCollector ({args.start_method}), idle, apply_at='truncate'",
            f"path row: {PATH} written in place (an (8,) float64 array); push_each gives each of "
            f"{args.path_workers} workers its own masses in one version",
        ],
    )
    return report.write(args.out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return run(parse_args(argv, Args, __doc__, quick))


if __name__ == "__main__":
    main()
