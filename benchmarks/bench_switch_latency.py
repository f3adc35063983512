"""How long does a config switch take, and how does it grow with the number of workers?

envsync: ``push(config=..., wait="applied")`` with ``apply_at="step"`` until every worker has
applied it, on an idle ``MultiAsyncCollector`` (built, not iterated) and on one being
iterated (pushed from the loop body). Against, in the same run and on the same env:

- a restart: ``shutdown()`` + recreate + first batch of the same collector, spawn and fork;
- torchrl's pipe call ``collector.map_fn(<path to set_difficulty>)`` on the idle collector;
  on a collector being iterated it is probed in a subprocess with a hard timeout
  (``mapfn_probe.py``): it throws away batches and blocks the iterator;
- gymnasium's ``AsyncVectorEnv.call("set_difficulty", x)`` with as many workers.

    python benchmarks/bench_switch_latency.py [--quick] [--workers 1 2 4 8]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import gymnasium as gym
from bench_common import RESULTS, Report, median, parse_args, save_plot, start_method, target, timed
from tqdm import tqdm

from envsync import EnvStateSender
from envsync.envs import DriftEnv, make_drift_env

NAME = "switch_latency"
MAP_FN_PATH = "env._env.unwrapped.set_difficulty"  # the method envsync's apply="set_difficulty" finds
PROBE = Path(__file__).resolve().with_name("mapfn_probe.py")


@dataclass
class Args:
    workers: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    pushes: int = 200  # idle pushes, map_fn and gymnasium calls per worker count (interleaved)
    iter_pushes: int = 20  # pushes while iterating
    restarts: int = 3  # restarts per start method
    frames_per_batch: int = 200
    start_method: str = "spawn"  # of the collector that takes the pushes
    probe_workers: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # worker counts to probe map_fn on
    probe_window: float = 3.0  # seconds the map_fn probe waits for batches after its call
    quick: bool = False
    out: Path = RESULTS


def quick(args: Args) -> Args:
    small = replace(args, workers=[1], pushes=5, iter_pushes=3, restarts=1, start_method="fork")
    return replace(small, probe_workers=[2], probe_window=1.0)


def _build(sender: EnvStateSender, workers: int, args: Args) -> Any:
    from torchrl.collectors import MultiAsyncCollector

    return MultiAsyncCollector(
        [sender.env_fn(make_drift_env)] * workers,
        None,
        frames_per_batch=args.frames_per_batch,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
    )


def _idle(collector: Any, sender: EnvStateSender, vec: Any, workers: int, args: Args, bar: tqdm) -> dict[str, list]:
    """envsync, map_fn and gymnasium, interleaved so that they share the machine's noise."""
    out: dict[str, list[float]] = {"envsync": [], "map_fn": [], "gym": []}
    for i in range(args.pushes + 1):
        value = 0.1 * (i % 10)
        kwargs = [{"difficulty": value}] * workers
        times = {
            "envsync": timed(lambda v=value: sender.push(config={"difficulty": v}, wait="applied")),
            "map_fn": timed(lambda k=kwargs: collector.map_fn(MAP_FN_PATH, [()] * workers, k)),
            "gym": timed(lambda v=value: vec.call("set_difficulty", v)),
        }
        if i:  # the first round warms caches and threads up
            for key, seconds in times.items():
                out[key].append(seconds)
        bar.update()
    return out


def _iterating(collector: Any, sender: EnvStateSender, args: Args, bar: tqdm) -> list[float]:
    """Pushes from the body of the loop that iterates the collector, every other batch."""
    latencies: list[float] = []
    for i, _batch in enumerate(collector):
        if i % 2 == 1:
            value = 0.1 * (len(latencies) % 10)
            latencies.append(timed(lambda v=value: sender.push(config={"difficulty": v}, wait="applied")))
            bar.update()
            if len(latencies) == args.iter_pushes:
                break
    return latencies


def _probe_map_fn(workers: int, args: Args) -> dict[str, Any]:
    """Run ``mapfn_probe.py`` in its own process group; kill the group if it overruns."""
    command = [sys.executable, str(PROBE), "--workers", str(workers), "--window", str(args.probe_window)]
    command += ["--frames-per-batch", str(args.frames_per_batch)]
    proc = subprocess.Popen(
        command, cwd=PROBE.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=60 + args.probe_window)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"error": "probe timed out (killed)"}
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {"error": f"probe exited {proc.returncode}: {stderr.strip()[-300:]}"}
    return json.loads(lines[-1][len("RESULT ") :])


def _measure(workers: int, args: Args, bar: tqdm) -> dict[str, Any]:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    vec = collector = None
    restarts: dict[str, list[float]] = {"fork": [], "spawn": []}
    try:
        vec = gym.vector.AsyncVectorEnv([DriftEnv] * workers, context="fork")
        vec.reset(seed=0)
        with start_method(args.start_method):
            collector = _build(sender, workers, args)
        idle = _idle(collector, sender, vec, workers, args, bar)
        iterating = _iterating(collector, sender, args, bar)
        for method in ("fork", "spawn"):
            for _ in range(args.restarts):
                start = time.perf_counter()
                collector.shutdown()
                collector = None
                with start_method(method):
                    collector = _build(sender, workers, args)
                next(iter(collector))
                restarts[method].append(time.perf_counter() - start)
                bar.update()
    finally:
        if collector is not None:
            collector.shutdown()
        if vec is not None:
            vec.close()
        sender.close()
    probe = _probe_map_fn(workers, args) if workers in args.probe_workers else {"error": "not probed"}
    bar.update()
    return _row(workers, idle, iterating, restarts, probe)


def _row(workers: int, idle: dict, iterating: list[float], restarts: dict, probe: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {
        "workers": workers,
        "envsync_idle_us": median(idle["envsync"]) * 1e6,
        "envsync_iter_us": median(iterating) * 1e6,
        "map_fn_idle_us": median(idle["map_fn"]) * 1e6,
        "gym_call_us": median(idle["gym"]) * 1e6,
        "restart_fork_ms": median(restarts["fork"]) * 1e3,
        "restart_spawn_ms": median(restarts["spawn"]) * 1e3,
        "map_fn_iter_ms": (probe.get("map_fn_s") or float("nan")) * 1e3,
        "map_fn_iter_dropped": probe.get("dropped_batches"),
        "map_fn_iter_batches_after": probe.get("batches_after"),
        "map_fn_iter_stalled": probe.get("stalled_workers"),
        "map_fn_iter_blocked": probe.get("iterator_blocked"),
        "map_fn_iter_error": probe.get("error"),
        "raw_s": {"idle": idle, "iterating": iterating, "restarts": restarts},
    }
    envsync = row["envsync_idle_us"]
    row["idle_over_gym"] = envsync / row["gym_call_us"]
    row["idle_over_map_fn"] = envsync / row["map_fn_idle_us"]
    row["spawn_over_idle"] = row["restart_spawn_ms"] * 1e3 / envsync
    row["spawn_over_iter"] = row["restart_spawn_ms"] * 1e3 / row["envsync_iter_us"]
    row["fork_over_idle"] = row["restart_fork_ms"] * 1e3 / envsync
    row["fork_over_iter"] = row["restart_fork_ms"] * 1e3 / row["envsync_iter_us"]
    return row


LATENCY_COLUMNS = [
    ("workers", "workers"),
    ("envsync_idle_us", "envsync idle (µs)"),
    ("envsync_iter_us", "envsync iterating (µs)"),
    ("map_fn_idle_us", "map_fn idle (µs)"),
    ("gym_call_us", "gym AsyncVectorEnv.call (µs)"),
    ("restart_fork_ms", "restart fork (ms)"),
    ("restart_spawn_ms", "restart spawn (ms)"),
]
RATIO_COLUMNS = [
    ("workers", "workers"),
    ("idle_over_gym", "envsync idle / gym call"),
    ("idle_over_map_fn", "envsync idle / map_fn idle"),
    ("spawn_over_idle", "spawn restart / envsync idle"),
    ("spawn_over_iter", "spawn restart / envsync iterating"),
    ("fork_over_idle", "fork restart / envsync idle"),
    ("fork_over_iter", "fork restart / envsync iterating"),
]
PROBE_COLUMNS = [
    ("workers", "workers"),
    ("map_fn_iter_ms", "map_fn call returns after (ms)"),
    ("map_fn_iter_dropped", "batches thrown away"),
    ("map_fn_iter_stalled", "stalled workers"),
    ("map_fn_iter_batches_after", "batches in the probe window after it"),
    ("map_fn_iter_blocked", "iterator blocked"),
    ("map_fn_iter_error", "probe error"),
]


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 21's: a small push to 4 and to 16 idle workers at most gymnasium's call (each
    worker count of the run that has a row; the largest when neither), and a restart at
    least 1000x a push at every worker count."""
    asked = [r for r in rows if r["workers"] in (4, 16)] or rows[-1:]
    worst = min(min(r["spawn_over_idle"], r["spawn_over_iter"]) for r in rows)
    return [
        *(
            target(
                f"small-config push to {r['workers']} idle workers / gymnasium AsyncVectorEnv.call",
                r["idle_over_gym"],
                1.0,
                higher_is_better=False,
            )
            for r in asked
        ),
        target(
            "spawn restart / envsync push (worst of idle and iterating, every worker count)",
            worst,
            1000,
            higher_is_better=True,
        ),
    ]


def _plot(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    workers = [r["workers"] for r in rows]
    series = [
        ("envsync_idle_us", 1.0, "envsync push, idle"),
        ("envsync_iter_us", 1.0, "envsync push, iterating"),
        ("map_fn_idle_us", 1.0, "torchrl map_fn, idle"),
        ("gym_call_us", 1.0, "gymnasium AsyncVectorEnv.call"),
        ("restart_fork_ms", 1e3, "restart (fork)"),
        ("restart_spawn_ms", 1e3, "restart (spawn)"),
    ]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for key, scale, label in series:
        ax.plot(workers, [r[key] * scale for r in rows], marker="o", label=label)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="workers",
        ylabel="median latency (µs, log)",
        title="Switching the env config of running workers",
    )
    ax.set_xticks(workers, [str(w) for w in workers])
    ax.minorticks_off()
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    paths = [save_plot(fig, out, NAME)]
    fig, (idle_ax, iter_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (
        ("envsync_idle_us", "envsync"),
        ("map_fn_idle_us", "torchrl map_fn"),
        ("gym_call_us", "gymnasium call"),
    ):
        idle_ax.plot(workers, [r[key] for r in rows], marker="o", label=label)
    iter_ax.plot(workers, [r["envsync_iter_us"] / 1e3 for r in rows], marker="o", color="C1", label="envsync")
    idle_ax.set(title="idle collector", ylabel="median push -> all applied (µs)")
    iter_ax.set(title="collector being iterated (apply_at='step')", ylabel="median push -> all applied (ms)")
    for ax in (idle_ax, iter_ax):
        ax.set(xlabel="workers", ylim=(0, None))
        ax.set_xticks(workers, [str(w) for w in workers])
        ax.legend(fontsize=8)
    fig.suptitle("Latency as workers grow (2 cores: beyond 2 workers they share the CPUs)")
    paths.append(save_plot(fig, out, f"{NAME}_scaling"))
    return paths


def run(args: Args) -> dict[str, Any]:
    per_workers = args.pushes + 1 + args.iter_pushes + 2 * args.restarts + 1
    rows = []
    with tqdm(total=per_workers * len(args.workers), desc=NAME, unit="step") as bar:
        for workers in args.workers:
            bar.set_postfix(workers=workers)
            rows.append(_measure(workers, args, bar))
    report = Report(
        name=NAME,
        args=args,
        rows=rows,
        tables=[
            ("Median latency", LATENCY_COLUMNS),
            ("Ratios (same run)", RATIO_COLUMNS),
            ("torchrl map_fn on a MultiAsyncCollector being iterated (subprocess probe)", PROBE_COLUMNS),
        ],
        summary={"plots": [p.name for p in _plot(rows, args.out)]},
        targets=_targets(rows),
        notes=[
            f"env: envsync DriftEnv through GymEnv; apply_at='step'; frames_per_batch={args.frames_per_batch}; "
            f"the pushed collector is built with {args.start_method}",
            "restart = shutdown() + build the same collector + first batch; envsync stays attached",
            f"map_fn path: {MAP_FN_PATH} (the method envsync's apply='set_difficulty' calls)",
            "probe: map_fn called from the loop body of an iterated MultiAsyncCollector (fork), batches "
            f"watched for {args.probe_window} s after it returns",
        ],
    )
    return report.write(args.out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return run(parse_args(argv, Args, __doc__, quick))


if __name__ == "__main__":
    main()
