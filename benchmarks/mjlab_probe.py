"""What mjlab's Cartpole costs on Warp's CPU device, and whether one world's mass is its own.

Needs the mjlab venv (``make .venv-mjlab/.installed``). Prints, per number of worlds, the
build time, the mean ``env.step`` of mjlab and of torchrl's ``MJLabWrapper``; then the
per-world check: a field's storage before and after ``sim.expand_model_fields``, one
world's pole mass changed, and the worlds' states after the same actions from the same
start (only the changed world moves elsewhere). With ``--push``, what a push of one mass
factor per world costs against the number of worlds: the write of all rows as envsync does it
(one indexed write per field), the same rows written one by one, ``finish``
(``recompute_constants``), and ``sender.push(..., wait="applied")`` to every world of an idle
``Collector`` (``apply_at="step"``), beside the env's own step. docs/notes-mjlab.md has the
numbers.

    .venv-mjlab/bin/python benchmarks/mjlab_probe.py [--worlds 16 256 4096] [--steps 20] [--push]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch

POLE = 4  # body index of cartpole/pole_1 in Mjlab-Cartpole-Balance


def build(worlds: int) -> tuple[object, float]:
    import mjlab.tasks  # noqa: F401  (registers the tasks)
    from mjlab.envs import ManagerBasedRlEnv
    from mjlab.tasks.registry import load_env_cfg

    cfg = load_env_cfg("Mjlab-Cartpole-Balance")
    cfg.scene.num_envs = worlds
    start = time.perf_counter()
    env = ManagerBasedRlEnv(cfg, device="cpu")
    return env, time.perf_counter() - start


def step_times(worlds: int, steps: int) -> None:
    from torchrl.envs import MJLabWrapper

    base, built = build(worlds)
    env = MJLabWrapper(base)
    td = env.reset()
    action = torch.zeros(worlds, 1)
    for _ in range(3):
        base.step(action)
    start = time.perf_counter()
    for _ in range(steps):
        base.step(action)
    raw = (time.perf_counter() - start) / steps
    start = time.perf_counter()
    for _ in range(steps):
        td = env.rand_step(td)
    wrapped = (time.perf_counter() - start) / steps
    print(
        f"{worlds:>6} worlds  build {built:5.2f} s  mjlab step {raw * 1e3:7.1f} ms  "
        f"torchrl step {wrapped * 1e3:7.1f} ms  {worlds / wrapped:8.0f} frames/s",
        flush=True,
    )
    env.close()


def per_world(worlds: int = 4) -> None:
    from mjlab.managers.event_manager import RecomputeLevel, requires_model_fields

    env, _ = build(worlds)
    sim = env.sim  # type: ignore[attr-defined]
    field = sim.model.body_mass
    print("before expanding: shape", tuple(field.shape), "stride", field.stride(), "warp", field.wp_array.shape)
    derived = requires_model_fields(recompute=RecomputeLevel.set_const)(lambda: None).model_fields
    sim.expand_model_fields(("body_mass", "body_inertia", *derived))
    field = sim.model.body_mass  # the bridge's cache was cleared: a new array
    print("after expanding:  shape", tuple(field.shape), "stride", field.stride())
    field[1, POLE] = 1.0
    sim.recompute_constants(RecomputeLevel.set_const)
    print("subtree mass of the root per world", sim.model.body_subtreemass[:, 0].tolist())
    env.reset()  # type: ignore[attr-defined]
    data = sim.data
    data.qpos[:] = data.qpos[0:1].clone()
    data.qvel[:] = 0.0
    data.qpos[:, 1] = 0.3
    sim.forward()
    for _ in range(20):
        env.step(torch.full((worlds, 1), 0.5))  # type: ignore[attr-defined]
    print("qpos after 20 equal steps (world 1 is heavier):", [[round(x, 3) for x in q] for q in data.qpos.tolist()])


def make_env(worlds: int) -> object:
    from torchrl.envs import MJLabEnv

    return MJLabEnv("Mjlab-Cartpole-Balance", num_envs=worlds, device="cpu")


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def push_costs(worlds: int, repeats: int) -> None:
    from torchrl.collectors import Collector

    import envsync
    from envsync import EnvStateSender

    targets = {"mass": ["sim.model.body_mass", "sim.model.body_inertia"]}
    env = make_env(worlds)
    env.reset()
    rows = 0.5 + torch.rand(worlds)
    ids = torch.arange(worlds)
    write = envsync.apply.scales(targets).bind(env)
    batched = timed(lambda: write({"mass": rows}, env_ids=ids), repeats)
    one_by_one = timed(lambda: [write({"mass": rows[i : i + 1]}, env_ids=ids[i : i + 1]) for i in range(worlds)], 3)
    finish = envsync.apply.recompute_constants()
    inner = envsync.configure.wrapper_chain(env)[-1]
    finished = timed(lambda: finish(inner), repeats)
    td = env.reset()
    step = timed(lambda: env.rand_step(td), repeats)
    env.close()
    apply = envsync.apply.scales(targets, finish=envsync.apply.recompute_constants())
    sender = EnvStateSender(config={"mass": 1.0}, apply=apply, apply_at="step")
    collector = Collector(
        sender.env_fn(partial(make_env, worlds)),
        None,
        frames_per_batch=worlds,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
    )
    try:
        next(iter(collector))
        pushed = timed(lambda: sender.push(config={"mass": 0.5 + torch.rand(worlds)}, wait="applied"), repeats)
    finally:
        collector.shutdown()
        sender.close()
    print(
        f"{worlds:>6} worlds  write all rows {batched * 1e3:8.3f} ms  row by row {one_by_one * 1e3:9.1f} ms  "
        f"finish {finished * 1e3:7.2f} ms  push->applied {pushed * 1e3:8.1f} ms  env step {step * 1e3:7.1f} ms",
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[16, 256, 4096])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--push", action="store_true", help="the push-cost table instead")
    args = parser.parse_args(argv)
    import warp as wp

    wp.config.quiet = True
    if args.push:
        for worlds in args.worlds:
            push_costs(worlds, args.steps)
        return
    per_world()
    for worlds in args.worlds:
        step_times(worlds, args.steps)


if __name__ == "__main__":
    main()
