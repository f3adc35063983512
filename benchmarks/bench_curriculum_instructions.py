"""What does a curriculum cost a collector, counted in instructions?

``bench_curriculum.py`` asks for frames/s with the curriculum ÷ without ≥ 0.99; its timed
windows on a shared 2-core machine move by ±5-25%, more than the 1% in question. Here its
set-up (a ``MultiSyncCollector`` of ``n`` workers of one ``StampedDriftEnv`` each,
``apply_at="reset"``, 480 frames per worker and batch, and its ``DomainRandomization``
curriculum) runs under valgrind's callgrind in three variants:

- **plain**: the torchrl collector without envsync;
- **attached**: envsync attached (``sender.env_fn``, ``sender.schemes()``), nothing pushed;
- **curriculum**: the curriculum observes every batch and pushes as it decides (a draw for
  every due env, at most one push per batch), and in the middle of the counted batches one
  decision switches to the other half of the tasks, as in ``bench_curriculum.py``'s windows.

Counting is on (``callgrind_control -i on``) only for the counted batches, in the main
process and in every worker (spawned, each under its own valgrind: ``--trace-children``), so
a worker's receipt and apply of a push count with the main process's ledger, rule and push.
The count repeats within ~0.1% from run to run, whatever else the machine does.

What it does not show: valgrind weighs every instruction alike (a cache miss, a system call's
kernel time and torch's intra-op threads under load weigh nothing), and waiting costs no
instructions. A ``MultiSyncCollector``'s workers wait for the loop body, so the curriculum's
wall time in the loop holds the collection up whatever it costs in CPU: each ``n`` is also run
without valgrind (forked workers, as ``bench_curriculum.py`` has them) to time the
curriculum's ``observe`` and ``decide`` calls against the loop's wall time. And what follows
the wall clock counts as work: a worker's listener checks that the sender lives after each
quiet 0.5 s, which valgrind's slowdown (40-200 ms a frame here) makes a per-frame cost of
the attached and curriculum variants that a native frame seldom pays.

``--quick`` runs the children without valgrind (the loop's timing only): under valgrind
each process takes ~50 s to import torch, more than a smoke run may take.

    python benchmarks/bench_curriculum_instructions.py [--quick] [--envs 1 8]   # ~30 min
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench_common import (
    RESULTS,
    CountedChild,
    Report,
    parse_args,
    require_callgrind,
    save_plot,
    start_method,
    target,
)

NAME = "curriculum_instructions"
VARIANTS = ("plain", "attached", "curriculum")


@dataclass
class Args:
    envs: list[int] = field(default_factory=lambda: [1, 8])  # ~9 and ~22 min here (4 envs: ~12 more)
    frames_per_worker: int = 480  # per worker and batch, as bench_curriculum.py
    warmup: int = 2  # batches before counting (the curriculum observes them, and pushes)
    batches: int = 3  # counted batches per variant (a decision before the middle one)
    timed_batches: int = 40  # batches of the run without valgrind that times the loop
    count: bool = True  # count instructions (valgrind imports torch in ~50 s a process: quick leaves it out)
    quick: bool = False
    out: Path = RESULTS


def quick(args: Args) -> Args:
    return replace(args, envs=[2], frames_per_worker=60, warmup=1, batches=2, timed_batches=4, count=False)


@dataclass
class Plan:
    """What one child process runs: a variant on ``envs`` workers, how many batches."""

    variant: str
    envs: int
    frames_per_worker: int
    warmup: int
    batches: int
    method: str  # "spawn" under valgrind (each worker its own valgrind), "fork" when timed

    def argv(self) -> list[str]:
        return [str(v) for v in asdict(self).values()]

    @classmethod
    def of(cls, argv: Sequence[str]) -> Plan:
        variant, envs, per_worker, warmup, batches, method = argv
        return cls(variant, int(envs), int(per_worker), int(warmup), int(batches), method)


def child(plan: Plan) -> None:
    """Build the variant, warm it up, then run the counted batches between two prompts:
    print ``ready`` and the pids, wait for a line, collect, print what the window did."""
    import torch
    from bench_curriculum import DomainRandomization, with_measures
    from bench_envs import make_stamped_env
    from bench_tasks import HALVES
    from torchrl.collectors import MultiSyncCollector

    from envsync import EnvStateSender

    torch.set_num_threads(1)
    torch.manual_seed(0)
    sender = (
        None
        if plan.variant == "plain"
        else EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="reset")
    )
    factory = make_stamped_env if sender is None else sender.env_fn(make_stamped_env)
    schemes = {} if sender is None else {"weight_sync_schemes": sender.schemes()}
    with start_method(plan.method):
        collector = MultiSyncCollector(
            [factory] * plan.envs, None, frames_per_batch=plan.envs * plan.frames_per_worker, total_frames=-1, **schemes
        )
    dr = DomainRandomization(sender, HALVES[0]) if plan.variant == "curriculum" and sender is not None else None
    try:
        batches = iter(collector)
        for _ in range(plan.warmup):
            batch = next(batches)
            if dr is not None:
                dr.observe(with_measures(batch))
        print("ready", os.getpid(), *(p.pid for p in collector.procs), flush=True)
        sys.stdin.readline()
        version = 0 if sender is None else sender.version
        frames = episodes = 0
        spent = 0.0  # seconds in the curriculum's calls
        start = time.perf_counter()
        for i in range(plan.batches):
            if dr is not None and i == plan.batches // 2:
                begin = time.perf_counter()
                dr.decide(HALVES[1])
                spent += time.perf_counter() - begin
            batch = next(batches)
            frames += batch.numel()
            if dr is not None:
                begin = time.perf_counter()
                episodes += len(dr.observe(with_measures(batch)))
                spent += time.perf_counter() - begin
        loop = time.perf_counter() - start
        pushes = 0 if sender is None else sender.version - version
        print("done", frames, pushes, episodes, spent, loop, flush=True)
        sys.stdin.readline()
    finally:
        collector.shutdown()
        if sender is not None:
            sender.close()


def _window(done: list[str]) -> dict[str, Any]:
    frames, pushes, episodes = (int(v) for v in done[:3])
    spent, loop = (float(v) for v in done[3:])
    return {"frames": frames, "pushes": pushes, "episodes": episodes, "spent": spent, "loop": loop}


def _child(plan: Plan, count: bool) -> CountedChild:
    # one thread per process: an idle intra-op pool's spinning would follow the wall clock
    return CountedChild(
        __file__,
        plan.argv(),
        count=count,
        env={"OMP_NUM_THREADS": "1"},
        what=f"{plan.variant} child ({plan.envs} envs)",
    )


def count(plan: Plan) -> dict[str, Any]:
    """Run one variant under callgrind; its counted batches' instructions, main and workers."""
    child = _child(plan, count=True)
    try:
        pids, done, seconds = child.counted()
        window = _window(done)
        main, total = child.instructions(pids[0]), child.instructions()
    finally:
        child.close()
    return window | {
        "main": main,
        "workers": total - main,
        "total": total,
        "valgrind_s": seconds,
        "processes": len(pids),
    }


def timed(plan: Plan) -> dict[str, Any]:
    """Run one variant without valgrind: the curriculum's seconds in the loop, and the loop's."""
    child = _child(plan, count=False)
    try:
        _, done, _ = child.counted(timeout=300)
        return _window(done)
    finally:
        child.close()


def measure(n: int, args: Args) -> dict[str, Any]:
    loop = timed(Plan("curriculum", n, args.frames_per_worker, args.warmup, args.timed_batches, "fork"))
    row = {
        "envs": n,
        "loop_share": loop["spent"] / loop["loop"],
        "timed_pushes": loop["pushes"],
        "timed_batches": args.timed_batches,
    }
    if not args.count:
        return row | {"frames": loop["frames"], "pushes": loop["pushes"], "episodes": loop["episodes"]}
    counts = {
        variant: count(Plan(variant, n, args.frames_per_worker, args.warmup, args.batches, "spawn"))
        for variant in VARIANTS
    }
    return row | _counted(counts)


def _counted(counts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The instructions per frame of the three variants, their ratios, where they went."""
    per_frame = {v: c["total"] / c["frames"] for v, c in counts.items()}
    plain, attached, curriculum = (per_frame[v] for v in VARIANTS)
    mine = counts["curriculum"]
    return {
        "frames": mine["frames"],
        "processes": mine["processes"],
        "pushes": mine["pushes"],
        "episodes": mine["episodes"],
        **{f"instructions_per_frame_{v}": per_frame[v] for v in VARIANTS},
        **{f"main_per_frame_{v}": counts[v]["main"] / counts[v]["frames"] for v in VARIANTS},
        **{f"workers_per_frame_{v}": counts[v]["workers"] / counts[v]["frames"] for v in VARIANTS},
        "attached_over_plain": plain / attached,
        "curriculum_over_plain": plain / curriculum,
        "curriculum_over_attached": attached / curriculum,
        "curriculum_added_main": (mine["main"] - counts["attached"]["main"]) / mine["frames"],
        "curriculum_added_workers": (mine["workers"] - counts["attached"]["workers"]) / mine["frames"],
        "valgrind_s": sum(c["valgrind_s"] for c in counts.values()),
    }


COLUMNS = [
    ("envs", "envs"),
    ("frames", "frames counted"),
    ("pushes", "pushes counted (one a decision)"),
    ("episodes", "episodes observed"),
    ("instructions_per_frame_plain", "instructions per frame: plain"),
    ("instructions_per_frame_attached", "envsync attached, nothing pushed"),
    ("instructions_per_frame_curriculum", "with the curriculum"),
    ("attached_over_plain", "frames per instruction: attached / plain"),
    ("curriculum_over_plain", "curriculum / plain"),
    ("curriculum_over_attached", "curriculum / attached"),
]
SPLIT_COLUMNS = [
    ("envs", "envs"),
    ("main_per_frame_plain", "main process per frame: plain"),
    ("main_per_frame_attached", "attached"),
    ("main_per_frame_curriculum", "curriculum"),
    ("workers_per_frame_plain", "workers per frame: plain"),
    ("workers_per_frame_attached", "attached"),
    ("workers_per_frame_curriculum", "curriculum"),
    ("curriculum_added_main", "the curriculum adds per frame: main"),
    ("curriculum_added_workers", "workers"),
    ("loop_share", "its calls' share of the loop's wall time (no valgrind)"),
    ("timed_pushes", "pushes in that run"),
]


def _plot(rows: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5, 2.2 * len(rows)), 3.6))
    width = 0.27
    for j, variant in enumerate(VARIANTS):
        xs = [i + (j - 1) * width for i in range(len(rows))]
        ax.bar(xs, [r[f"instructions_per_frame_{variant}"] for r in rows], width, label=variant)
    for i, r in enumerate(rows):
        label = f"{(1 / r['curriculum_over_plain'] - 1) * 100:+.2f}%"
        ax.annotate(label, (i + width, r["instructions_per_frame_curriculum"]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), [f"{r['envs']} envs" for r in rows])
    ax.set(ylabel="instructions per frame (callgrind)", title="A curriculum's cost, counted in instructions")
    ax.legend(fontsize=8, loc="lower right")
    return save_plot(fig, out, NAME)


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        target(
            f"curriculum, {r['envs']} envs: frames per instruction with the curriculum / {what}",
            r[key],
            0.99,
            higher_is_better=True,
        )
        for r in rows
        if "curriculum_over_plain" in r
        for what, key in (
            ("without envsync", "curriculum_over_plain"),
            ("envsync attached", "curriculum_over_attached"),
        )
    ]


def run(args: Args) -> dict[str, Any]:
    if args.count:
        require_callgrind()
    rows = [measure(n, args) for n in args.envs]
    report = Report(
        name=NAME,
        args=args,
        rows=rows,
        tables=[
            ("Instructions executed per frame, counted by callgrind (every process)", COLUMNS),
            ("Where the instructions go, and the loop's wall time", SPLIT_COLUMNS),
        ],
        summary={"plots": [_plot(rows, args.out).name] if args.count else []},
        targets=_targets(rows),
        notes=[
            f"bench_curriculum.py's set-up: MultiSyncCollector of n StampedDriftEnv workers, apply_at='reset', "
            f"{args.frames_per_worker} frames per worker and batch, policy=None, torch.manual_seed(0), one thread per "
            f"process; {args.warmup} warm-up batches, then {args.batches} counted batches per variant, each variant in "
            "its own process with spawned workers, each under its own valgrind (--trace-children); every process "
            "counted",
            "curriculum: bench_curriculum.py's DomainRandomization observes every batch (warm-up included) and draws "
            "for every due env (one push per batch at most, wait='received'); a decision (switch to the other half "
            "of the tasks, one push) comes before the middle counted batch; 'pushes counted' are the versions "
            "published in the counted window",
            "instructions weigh alike whatever they cost in time (cache misses, system calls, thread wake-ups) and "
            "waiting costs none: the loop-share column times the curriculum's observe and decide calls against the "
            f"loop's wall time in a run without valgrind ({args.timed_batches} batches, forked workers)",
        ],
    )
    return report.write(args.out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return run(parse_args(argv, Args, __doc__, quick))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(Plan.of(sys.argv[2:]))
    else:
        main()
