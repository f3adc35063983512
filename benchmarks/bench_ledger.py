"""What a curriculum costs the collection loop, in CPU time per batch: ``Ledger.observe``
alone, and the whole ``Strategy.observe`` (ledger, decision rule, push) of the
domain-randomisation strategy of ``bench_curriculum.py``, of ``ADR`` and of ``Lessons``.

The loop-share figure of ``bench_curriculum.py`` is a few tenths of a percent of a window's
wall time, which moves by 15-25% on a shared machine; CPU time of the calling thread
(``time.thread_time()``) is steadier. Each strategy first runs live on a
``MultiSyncCollector`` of ``n`` workers (one ``StampedDriftEnv`` each, ``apply_at="reset"``,
as ``bench_curriculum.py`` builds it), and its batches are kept. They are then replayed, with
the collector idle, through a fresh strategy of the same seed on the same sender: its
versions shifted by the versions published since the live run began, the replay makes the
same decisions at the same batches and pushes the same number of versions (checked), so each
replayed pass costs what the live run cost, without the collection's noise around it. The
figures are medians over passes of the CPU microseconds per batch.

At thousands of worlds (``--worlds``), ADR, PLR and a UCB1 bandit run live on one
``Collector`` of a natively batched env of ``n`` worlds (``WorldsEnv``, 1,000-step episodes, ``apply_at="step"``): the
CPU time of ``observe`` per batch against the CPU time of the batch itself, the first
batches (every world's first decision) not counted.

    python benchmarks/bench_ledger.py [--quick] [--envs 1 4 8] [--worlds 4096 65536] [--profile]
"""

from __future__ import annotations

import cProfile
import gc
import pstats
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench_common import RESULTS, Report, median, parse_args, start_method
from bench_curriculum import MEASURES, DomainRandomization, with_measures
from bench_envs import make_stamped_env
from bench_tasks import DIFFICULTIES, HALVES
from tensordict import TensorDictBase

from envsync import EnvStateSender, curriculum

NAME = "ledger"
VERSION_KEYS = ("env_version", ("next", "env_version"))


@dataclass
class Args:
    envs: list[int] = field(default_factory=lambda: [1, 4, 8])
    worlds: list[int] = field(default_factory=lambda: [4096, 65536])  # ADR over one env of n worlds
    world_batches: int = 12  # live batches at each n (the first 2 not counted)
    world_horizons: list[int] = field(default_factory=lambda: [1000, 50])  # the worlds' episode lengths (steps)
    world_strategies: list[str] = field(default_factory=lambda: ["ADR", "PLR", "Bandit"])
    frames_per_worker: int = 480  # per worker and batch, as bench_curriculum.py
    batches: int = 8  # batches kept from each strategy's live run
    passes: int = 7  # timed replays of them (after one warm-up pass)
    profile: bool = False  # print cProfile's top entries of the replays at the most envs
    quick: bool = False
    out: Path = RESULTS


def quick(args: Args) -> Args:
    return replace(
        args, envs=[2], frames_per_worker=70, batches=4, passes=2, worlds=[256], world_batches=4, world_horizons=[8]
    )


def strategies(sender: EnvStateSender) -> dict[str, Callable[[], Any]]:
    """Each strategy measured, built afresh (same seed) for every run of it."""
    lessons = [curriculum.Lesson({"difficulty": d}, threshold=40.0, min_lesson_length=8) for d in DIFFICULTIES]
    return {
        "domain randomisation": lambda: DomainRandomization(sender, HALVES[0]),
        "ADR": lambda: curriculum.ADR(
            sender,
            ranges={"difficulty": (0.0, 0.2)},
            bounds={"difficulty": (0.0, 0.7)},
            delta=0.05,
            queue=8,
            thresholds=(30.0, 42.0),
            measures=MEASURES,
        ),
        "Lessons": lambda: curriculum.Lessons(sender, lessons, measures=MEASURES),
    }


@dataclass
class Recorded:
    """A strategy's live run: its batches, the version the run began at, the versions it pushed."""

    batches: list[TensorDictBase]
    start: int
    pushed: int
    live_us: list[float]


def record(build: Callable[[], Any], sender: EnvStateSender, batches: Any, count: int) -> Recorded:
    start = sender.version
    strategy = build()
    kept, live = [], []
    for _ in range(count):
        batch = with_measures(next(batches)).clone()
        begin = time.thread_time()
        strategy.observe(batch)
        live.append(1e6 * (time.thread_time() - begin))
        kept.append(batch)
    return Recorded(kept, start, sender.version - start, live)


def shifted(recorded: Recorded, sender: EnvStateSender) -> list[TensorDictBase]:
    """The batches as the run beginning at the sender's version now would have tagged them."""
    by = sender.version - recorded.start
    out = []
    for batch in recorded.batches:
        batch = batch.clone()
        for key in VERSION_KEYS:
            batch.set(key, batch.get(key) + by)
        out.append(batch)
    return out


def replay(
    build: Callable[[], Any], recorded: Recorded, sender: EnvStateSender, profiler: cProfile.Profile | None = None
) -> float:
    """CPU microseconds per batch of one replay through a fresh strategy (or ledger)."""
    batches = shifted(recorded, sender)
    start = sender.version
    strategy = build()
    spent = 0.0
    for batch in batches:
        if profiler is not None:
            profiler.enable()
        begin = time.thread_time()
        strategy.observe(batch)
        spent += time.thread_time() - begin
        if profiler is not None:
            profiler.disable()
    if sender.version - start != recorded.pushed:
        raise RuntimeError(f"the replay pushed {sender.version - start} versions, the live run {recorded.pushed}")
    return 1e6 * spent / len(batches)


def measure(n: int, args: Args) -> list[dict[str, Any]]:
    from torchrl.collectors import MultiSyncCollector

    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="reset")
    sender.config_history.keep, sender.config_history.keep_bytes = 1 << 30, 1 << 40  # every replayed version stays
    with start_method("fork"):
        collector = MultiSyncCollector(
            [sender.env_fn(make_stamped_env)] * n,
            None,
            frames_per_batch=n * args.frames_per_worker,
            total_frames=-1,
            weight_sync_schemes=sender.schemes(),
        )
    try:
        batches = iter(collector)
        builds = strategies(sender)
        recorded = {name: record(build, sender, batches, args.batches) for name, build in builds.items()}
        # the ledger alone, on the batches of the first strategy (it pushes nothing: no shift)
        builds["ledger only"] = lambda: curriculum.Ledger(sender, measures=MEASURES)
        first = recorded[next(iter(recorded))]
        recorded["ledger only"] = Recorded(first.batches, first.start, 0, [])
        samples: dict[str, list[float]] = {name: [] for name in builds}
        for p in range(args.passes + 1):
            for name, build in builds.items():
                us = replay(build, recorded[name], sender)
                if p > 0:
                    samples[name].append(us)
        if args.profile and n == max(args.envs):
            profile(builds, recorded, sender)
    finally:
        collector.shutdown()
        sender.close()
    return [_row(n, name, recorded[name], samples[name]) for name in builds]


def _row(n: int, name: str, recorded: Recorded, samples: list[float]) -> dict[str, Any]:
    frames = sum(b.numel() for b in recorded.batches) / len(recorded.batches)
    return {
        "envs": n,
        "what": name,
        "frames_per_batch": frames,
        "pushes_per_batch": recorded.pushed / len(recorded.batches),
        "cpu_us_per_batch": median(samples),
        "cpu_ns_per_frame": 1e3 * median(samples) / frames,
        "live_cpu_us_per_batch": median(recorded.live_us),
        "samples": {"cpu_us_per_batch": samples, "live_cpu_us_per_batch": recorded.live_us},
    }


def profile(builds: dict[str, Callable[[], Any]], recorded: dict[str, Recorded], sender: EnvStateSender) -> None:
    """Print the functions that took the most time in observe (wall clock: a CPU-time timer
    is a system call, whose cost would swamp the small functions)."""
    for name in ("ledger only", "domain randomisation"):
        profiler = cProfile.Profile()
        for _ in range(3):
            replay(builds[name], recorded[name], sender, profiler)
        print(f"\n---- cProfile: {name}, 3 replays of {len(recorded[name].batches)} batches")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


def mean(values: Sequence[float]) -> float:
    """The mean (a strategy decides every other batch or so: a median would pick one kind)."""
    return sum(values) / max(len(values), 1)


def world_strategy(name: str, sender: EnvStateSender) -> Any:
    """ADR over a difficulty range, PLR over ten difficulty levels (a level per world), or a
    UCB1 bandit over the same ten levels (an arm per world)."""
    if name == "PLR":
        return curriculum.PLR(sender, [{"difficulty": d / 10} for d in range(10)], seed=0)
    if name == "Bandit":
        return curriculum.Bandit(sender, [{"difficulty": d / 10} for d in range(10)], reward_range=(-100.0, 100.0))
    return curriculum.ADR(
        sender,
        ranges={"difficulty": (0.0, 0.1)},
        bounds={"difficulty": (0.0, 2.0)},
        delta=0.05,
        queue=10,
        thresholds=(-1e9, 1e9),
        seed=0,
    )


def live_worlds(n: int, horizon: int, name: str, args: Args, *, freeze: bool) -> dict[str, Any]:
    """Strategy ``name`` live over one collector of ``n`` worlds of ``horizon``-step episodes,
    ``world_batches`` batches, the first 2 not counted (``freeze``: ``gc.freeze()`` after them):
    CPU microseconds of each ``observe`` and of each batch it observed (16 steps of every
    world), the pushes and the episodes."""
    from bench_envs import WorldsEnv
    from torchrl.collectors import Collector

    gc.collect()  # each run starts from a heap without the garbage of the runs before it
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = Collector(
        sender.env_fn(lambda: WorldsEnv(n, horizon=horizon)),
        None,
        frames_per_batch=16 * n,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
    )
    strategy = world_strategy(name, sender)
    got: dict[str, Any] = {"observe": [], "batch": [], "pushes": 0, "episodes": 0}
    try:
        batches = iter(collector)
        for i in range(args.world_batches):
            if i == 2 and freeze:
                gc.freeze()  # what is alive now (torch's, the collector's) leaves the full collections
            begin = time.thread_time()
            batch = next(batches)
            middle = time.thread_time()
            version = sender.version
            ended = strategy.observe(batch)
            end = time.thread_time()
            if i >= 2:
                got["batch"].append(1e6 * (middle - begin))
                got["observe"].append(1e6 * (end - middle))
                got["pushes"] += sender.version - version
                got["episodes"] += len(ended)
    finally:
        gc.unfreeze()
        collector.shutdown()
        sender.close()
    return got


def measure_worlds(n: int, horizon: int, name: str, args: Args) -> dict[str, Any]:
    """:func:`live_worlds` as users run it, and again with ``gc.freeze()``."""
    got = live_worlds(n, horizon, name, args, freeze=False)
    frozen = live_worlds(n, horizon, name, args, freeze=True)["observe"]
    observe, counted = got["observe"], max(len(got["observe"]), 1)
    episodes = got["episodes"]
    return {
        "envs": n,
        "what": f"{name} over n worlds, {horizon}-step episodes",
        "frames_per_batch": 16 * n,
        "pushes_per_batch": got["pushes"] / counted,
        "episodes_per_batch": episodes / counted,
        "cpu_us_per_batch": mean(observe),
        "cpu_ns_per_frame": 1e3 * mean(observe) / (16 * n),
        "live_cpu_us_per_batch": mean(observe),
        "batch_cpu_us": mean(got["batch"]),
        "us_per_episode": mean(observe) / (episodes / counted) if episodes else None,
        "share_of_batch": mean(observe) / mean(got["batch"]),
        "frozen_cpu_us_per_batch": mean(frozen),
        "samples": {"cpu_us_per_batch": observe, "batch_cpu_us": got["batch"], "frozen_cpu_us_per_batch": frozen},
    }


COLUMNS = [
    ("envs", "envs"),
    ("what", "observe of"),
    ("frames_per_batch", "frames per batch"),
    ("pushes_per_batch", "pushes per batch"),
    ("cpu_us_per_batch", "CPU µs per batch (replayed, median)"),
    ("cpu_ns_per_frame", "CPU ns per frame"),
    ("live_cpu_us_per_batch", "CPU µs per batch (live run, median)"),
    ("batch_cpu_us", "the batch's own CPU µs (worlds)"),
    ("share_of_batch", "observe / batch (worlds)"),
    ("episodes_per_batch", "episodes ended a batch (worlds)"),
    ("us_per_episode", "observe µs per episode ended (worlds)"),
    ("frozen_cpu_us_per_batch", "observe CPU µs a batch after gc.freeze() (worlds)"),
]


def run(args: Args) -> dict[str, Any]:
    rows = [row for n in args.envs for row in measure(n, args)]
    sizes = [(n, h) for n in args.worlds for h in args.world_horizons]
    worlds = [measure_worlds(n, h, name, args) for n, h in sizes for name in args.world_strategies]
    notes = [
        "CPU time of the calling thread (time.thread_time()) in observe(batch): the ledger's "
        "attribution, and for a strategy its rule and its pushes (wait='received'; the wait "
        "itself costs no CPU of this thread)",
        "replayed: the batches of a live run through a fresh strategy with the collector idle, "
        "median over passes; live: the median batch of the live run",
    ]
    notes.append(
        "ADR, PLR and a UCB1 Bandit (ten difficulty levels) over worlds: one Collector of WorldsEnv(n, horizon) "
        "(world i's episodes run horizon + i % 17 steps, "
        f"all starting together), 16 steps a batch, apply_at='step', live, {args.world_batches} batches of which "
        "the first 2 (every world's first decision) are not counted, means over the rest (a strategy decides "
        "about every other batch); CPU time of the calling thread in observe "
        "and in the batch; with 1,000-step episodes none ends in these batches (the cost of carrying every "
        "world's running piece), with 50-step ones about a quarter of the worlds end one a batch; "
        "after gc.freeze(): the same run again in the same process, gc.freeze() called after its first 2 "
        "batches (the objects alive then, torch's and the collector's, leave Python's full collections, which "
        "an episode record per world makes frequent)"
    )
    report = Report(NAME, args, rows + worlds, [("CPU per batch", COLUMNS)], {"plots": []}, [], notes)
    return report.write(args.out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return run(parse_args(argv, Args, __doc__, quick))


if __name__ == "__main__":
    main()
