"""A curriculum against Syllabus: what it costs the collection, how fast a decision reaches
the envs, and whether every episode is credited to the task it ran.

The same domain-randomisation curriculum runs on both sides: each env's next task is drawn
uniformly from the current half of eight DriftEnv difficulties (0.0 ... 0.7), and a decision,
in the middle of every timed window, switches to the other half. The env
(``StampedDriftEnv``) shows its difficulty and the time its episode began in every
observation, so the run sees what each episode really ran and when it started.

- **envsync**: a ``MultiSyncCollector`` of one env per worker, ``apply_at="reset"``; the
  curriculum is a ``curriculum.Strategy`` that draws for every due env and, at a decision,
  pushes a fresh draw to every env at once. Baselines: the same collector without envsync,
  and with envsync attached but no curriculum.
- **Syllabus** (``syllabus-rl``, the ``bench`` extra): ``make_multiprocessing_curriculum`` of a
  ``DomainRandomization`` over the current half, ``GymnasiumSyncWrapper`` on every env of a
  gymnasium ``AsyncVectorEnv`` (``context="fork"``: under spawn its workers die at their first
  reset), with one and two prefetched tasks. Baseline: the same vector env without Syllabus.

Frames/s, and frames per CPU second (this process and the variant's workers), with the
curriculum / without come from windows that take turns (medians). CPU time shows envsync's
cost through the load of a shared machine; it does not show Syllabus's, which is mostly
waiting: a worker blocked on the task queue burns no CPU. A stale
episode starts after a decision has returned on a task of the half it left. Then a second run
changes tasks mid-episode: envsync with ``apply_at="step"`` (the ledger cuts each episode at
the change), Syllabus with ``change_task_on_completion=True`` (its env completes its task at
step ``complete_at``), and counts the frames credited to the task they ran.

    python benchmarks/bench_curriculum.py [--quick] [--systems envsync syllabus]
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from bench_common import RESULTS, Report, median, parse_args, save_plot, start_method, target
from bench_envs import make_stamped_env
from bench_syllabus import SyllabusRun, syllabus_missing
from bench_tasks import HALVES, Decision, Ran, Tally, cpu_seconds, credit, staleness
from tensordict import TensorDictBase
from tqdm import tqdm

from envsync import EnvStateSender, curriculum

NAME = "curriculum"
MEASURES = {
    "start": curriculum.Measure(("next", "start"), "first"),
    "low": curriculum.Measure(("next", "task"), "min"),
    "high": curriculum.Measure(("next", "task"), "max"),
}


@dataclass
class Args:
    envs: list[int] = field(default_factory=lambda: [1, 4, 8])
    systems: list[str] = field(default_factory=lambda: ["envsync", "syllabus"])
    rounds: int = 6  # timed windows per variant, variants taking turns (after one warm-up window each)
    window_frames: int = 6400  # frames per window (envsync: whole batches, at least 2)
    frames_per_worker: int = 480  # per worker and batch of the MultiSyncCollector
    credit_envs: int = 8
    credit_frames: int = 8000  # frames per system in the mid-episode run
    complete_at: int = 10  # Syllabus's env completes its task at this step of each episode
    quick: bool = False
    out: Path = RESULTS


def quick(args: Args) -> Args:
    return replace(args, envs=[2], rounds=1, window_frames=400, frames_per_worker=70, credit_envs=2, credit_frames=400)


# ---- envsync ---------------------------------------------------------------------------


class DomainRandomization(curriculum.Strategy):
    """Each due env's next difficulty drawn uniformly from ``tasks``; :meth:`decide` replaces
    ``tasks`` and draws for every env at once (one push)."""

    def __init__(self, sender: EnvStateSender, tasks: Sequence[float], seed: int = 0) -> None:
        super().__init__(sender, measures=MEASURES)
        self.tasks = tuple(tasks)
        self.rng = random.Random(seed)

    def update(self, episodes: list[curriculum.Episode]) -> None:
        self._draw(self.due())

    def decide(self, tasks: Sequence[float]) -> None:
        self.tasks = tuple(tasks)
        self._draw(range(self.sender.num_envs or 0))

    def _draw(self, envs: Sequence[int]) -> None:
        if envs:
            self.assign({env: {"difficulty": self.rng.choice(self.tasks)} for env in envs})


def with_measures(batch: TensorDictBase) -> TensorDictBase:
    """The observation's difficulty and episode start as keys of their own, for the ledger's measures."""
    observation = batch["next", "observation"]
    batch.set(("next", "task"), observation[..., 1])
    batch.set(("next", "start"), observation[..., 2])
    return batch


def ran_of(episode: curriculum.Episode) -> Ran:
    credited = round(episode.config["difficulty"].item(), 6)
    low, high = round(episode.measures["low"], 6), round(episode.measures["high"], 6)
    right = episode.length if low == high == credited else 0
    return Ran(episode.measures["start"], low, low, high, credited, episode.length, right, episode.whole)


class EnvsyncRun:
    """A ``MultiSyncCollector`` of ``n`` workers: plain, envsync attached, or with the curriculum.

    A ``MultiSyncCollector``'s workers are idle between batches, as an ``AsyncVectorEnv``'s are
    between steps, so variants can take turns without one's workers running during another's
    window; the curriculum's work in the loop body is then on the collection's critical path.
    """

    def __init__(self, n: int, args: Args, kind: str, apply_at: str = "reset") -> None:
        from torchrl.collectors import MultiSyncCollector

        self.kind, self.args, self.tally = kind, args, Tally()
        self.sender = (
            None
            if kind == "plain"
            else EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at=apply_at)
        )
        factory = make_stamped_env if self.sender is None else self.sender.env_fn(make_stamped_env)
        schemes = {} if self.sender is None else {"weight_sync_schemes": self.sender.schemes()}
        with start_method("fork"):
            self.collector = MultiSyncCollector(
                [factory] * n, None, frames_per_batch=n * args.frames_per_worker, total_frames=-1, **schemes
            )
        self.batch_frames = n * args.frames_per_worker
        self.batches = iter(self.collector)
        self.loop_s = 0.0  # seconds the curriculum took in the loop body (observe, decide) so far
        self.dr = DomainRandomization(self.sender, HALVES[0]) if kind == "curriculum" and self.sender else None
        self.wrong_frames = self.frames = 0

    def take(self, check: bool = False) -> None:
        batch = next(self.batches)
        if self.dr is not None:
            begin = time.perf_counter()
            episodes = self.dr.observe(with_measures(batch))
            self.loop_s += time.perf_counter() - begin
            self.tally.ran += [ran_of(e) for e in episodes]
            if check:
                self._check(batch)

    def window(self, decide: tuple[float, ...] | None) -> None:
        """Time the window's batches (the workers' CPU and this process's), a decision in the middle."""
        count = max(self.args.window_frames // self.batch_frames, 2)
        pids = [process.pid for process in self.collector.procs]
        start, cpu, loop = time.perf_counter(), cpu_seconds(pids), self.loop_s
        for i in range(count):
            if i == count // 2 and decide is not None and self.dr is not None:
                begin = time.monotonic()
                self.dr.decide(decide)
                end = time.monotonic()
                self.tally.decisions.append(Decision(begin, end, decide))
                self.loop_s += end - begin
            self.take()
        wall = time.perf_counter() - start
        self.tally.window(count * self.batch_frames, wall, cpu_seconds(pids) - cpu)
        self.tally.loop_share.append((self.loop_s - loop) / wall)

    def _check(self, batch: TensorDictBase) -> None:
        """Count the frames whose observed difficulty is not their tags' config (``sender.config_at``)."""
        assert self.sender is not None
        pairs = torch.stack([batch["next", "env_index"].flatten(), batch["next", "env_version"].flatten()], 1)
        unique, inverse = torch.unique(pairs, dim=0, return_inverse=True)
        named = torch.tensor([self.sender.config_at(e, v)["difficulty"].item() for e, v in unique.tolist()])
        shown = batch["next", "observation"][..., 1].flatten().to(named.dtype)
        self.wrong_frames += int((~torch.isclose(shown, named[inverse])).sum())
        self.frames += shown.numel()

    def close(self) -> None:
        self.collector.shutdown()
        if self.sender is not None:
            self.sender.close()


# ---- Syllabus --------------------------------------------------------------------------


# ---- measuring -------------------------------------------------------------------------


def variants(n: int, args: Args) -> dict[str, Any]:
    built: dict[str, Any] = {}
    if "envsync" in args.systems:
        for kind in ("plain", "attached", "curriculum"):
            built[f"envsync {kind}"] = EnvsyncRun(n, args, kind)
    if "syllabus" in args.systems:
        for prefetch in (0, 1, 2):
            built[f"syllabus prefetch {prefetch}" if prefetch else "syllabus plain"] = SyllabusRun(
                n, prefetch, args.window_frames
            )
    return built


def measure_envs(n: int, args: Args, bar: tqdm) -> list[dict[str, Any]]:
    """Windows of every variant taking turns (a warm-up window each first); one row per curriculum."""
    runs = variants(n, args)
    try:
        names = list(runs)
        for r in range(args.rounds + 1):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                runs[name].window(HALVES[(r + 1) % 2])
                if r == 0:
                    runs[name].tally.fps.clear()
                    runs[name].tally.cpu_fps.clear()
                bar.update()
        for run in runs.values():
            if isinstance(run, SyllabusRun):
                run.settle()
    finally:
        for run in runs.values():
            run.close()
    return [_row(n, runs, name, base) for name, base in _curricula(runs)]


def _curricula(runs: dict[str, Any]) -> list[tuple[str, str]]:
    out = [("envsync curriculum", "envsync plain")] if "envsync curriculum" in runs else []
    return out + [(name, "syllabus plain") for name in runs if name.startswith("syllabus prefetch")]


def _row(n: int, runs: dict[str, Any], name: str, base: str) -> dict[str, Any]:
    tally = runs[name].tally
    stale, first = staleness(tally)
    with_fps, without = median(tally.fps), median(runs[base].tally.fps)
    row = {
        "envs": n,
        "system": name.split()[0],
        "variant": "MultiSyncCollector, apply_at=reset" if name.startswith("envsync") else name.split(" ", 1)[1],
        "fps_without": without,
        "fps_with": with_fps,
        "with_over_without": with_fps / without,
        "paired_with_over_without": median([w / o for w, o in zip(tally.fps, runs[base].tally.fps, strict=False)]),
        "cpu_with_over_without": median(tally.cpu_fps) / median(runs[base].tally.cpu_fps),
        "decisions": len(stale),
        "stale_episodes": sum(stale),
        "stale_per_decision": sum(stale) / max(len(stale), 1),
        "decision_to_first_ms": 1e3 * median([f for f in first if f == f]),
        **credit(tally),
        "samples": {
            "fps_with": tally.fps,
            "fps_without": runs[base].tally.fps,
            "cpu_fps_with": tally.cpu_fps,
            "cpu_fps_without": runs[base].tally.cpu_fps,
            "stale": stale,
            "first_s": first,
        },
    }
    if name.startswith("envsync"):
        row["loop_share"] = median(tally.loop_share)
        row["samples"]["loop_share"] = tally.loop_share
        attached = runs["envsync attached"].tally
        row["attached_over_without"] = median(attached.fps) / without
        row["cpu_attached_over_without"] = median(attached.cpu_fps) / median(runs[base].tally.cpu_fps)
        row["samples"]["fps_attached"] = runs["envsync attached"].tally.fps
    return row


def measure_mid_episode(args: Args, bar: tqdm) -> list[dict[str, Any]]:
    """Tasks changing mid-episode: envsync in step mode, Syllabus changing on completion."""
    rows = []
    n = args.credit_envs
    if "envsync" in args.systems:
        run = EnvsyncRun(n, args, "curriculum", apply_at="step")
        try:
            for _ in range(max(args.credit_frames // run.batch_frames, 1)):
                run.take(check=True)
                bar.update()
        finally:
            run.close()
        exact = 100 * (1 - run.wrong_frames / max(run.frames, 1))
        rows.append(
            {
                "envs": n,
                "system": "envsync",
                "variant": "apply_at=step, changes mid-episode",
                **credit(run.tally),
                "frames_tagged_right_pct": exact,
            }
        )
    if "syllabus" in args.systems:
        syllabus = SyllabusRun(n, 1, args.window_frames, complete_at=args.complete_at)
        try:
            syllabus.steps(args.credit_frames // n)
            syllabus.settle()
        finally:
            syllabus.close()
        bar.update()
        variant = f"change_task_on_completion=True (task completed at step {args.complete_at})"
        rows.append({"envs": n, "system": "syllabus", "variant": variant, **credit(syllabus.tally)})
    return rows


# ---- reporting -------------------------------------------------------------------------

COLUMNS = [
    ("envs", "envs"),
    ("system", "system"),
    ("variant", "curriculum"),
    ("fps_without", "frames/s without"),
    ("fps_with", "frames/s with"),
    ("with_over_without", "with / without"),
    ("paired_with_over_without", "with / without, paired windows"),
    ("loop_share", "curriculum's share of the loop's time"),
    ("attached_over_without", "envsync attached, no curriculum / without"),
    ("cpu_with_over_without", "frames per CPU s, with / without"),
    ("cpu_attached_over_without", "frames per CPU s, attached / without"),
    ("decisions", "decisions"),
    ("stale_per_decision", "stale episodes per decision"),
    ("decision_to_first_ms", "decision -> first episode on it (ms, median)"),
]
CREDIT_COLUMNS = [
    ("envs", "envs"),
    ("system", "system"),
    ("variant", "curriculum"),
    ("episodes", "episodes (pieces) credited"),
    ("mixed_episodes", "of them ran two tasks (envsync: pieces cut at a change)"),
    ("credited_exact_pct", "credited to exactly the task they ran (%)"),
    ("credited_start_pct", "credited to the task they started on (%)"),
    ("frames_right_pct", "frames credited to the task they show (%)"),
    ("frames_tagged_right_pct", "frames whose tags name the config they show (%)"),
]


def _plot(rows: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib.pyplot as plt

    timed = [r for r in rows if "fps_with" in r]
    labels = sorted({f"{r['system']} {r['variant'].split(',')[0]}" for r in timed})
    envs = sorted({r["envs"] for r in timed})
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    width = 0.8 / max(len(labels), 1)
    for j, label in enumerate(labels):
        mine = {r["envs"]: r for r in timed if f"{r['system']} {r['variant'].split(',')[0]}" == label}
        xs = [i + j * width for i, n in enumerate(envs) if n in mine]
        for ax, key in zip(axes, ("with_over_without", "stale_per_decision", "decision_to_first_ms"), strict=True):
            ax.bar(xs, [mine[n][key] for n in envs if n in mine], width, label=label)
    titles = (
        "frames/s with the curriculum / without",
        "stale episodes per decision (reset mode)",
        "decision -> first episode on it (ms)",
    )
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xticks([i + width * (len(labels) - 1) / 2 for i in range(len(envs))], [f"{n} envs" for n in envs])
        ax.set_title(title, fontsize=9)
    axes[0].axhline(0.99, color="grey", ls=":", lw=1)
    axes[0].legend(fontsize=7, loc="upper left")
    return save_plot(fig, out, NAME)


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    mine = [r for r in rows if r["system"] == "envsync"]
    out = [
        target(
            f"curriculum, {r['envs']} envs: {what} with the curriculum / without (envsync)",
            r[key],
            0.99,
            higher_is_better=True,
        )
        for r in mine
        if "with_over_without" in r
        for what, key in (
            ("frames/s", "with_over_without"),
            ("frames/s, paired windows,", "paired_with_over_without"),
            ("frames per CPU s", "cpu_with_over_without"),
        )
    ]
    out += [
        target(
            f"curriculum, {r['envs']} envs: observe + decide in the loop / the loop's wall time (envsync)",
            r["loop_share"],
            0.01,
            higher_is_better=False,
            unit="",
        )
        for r in mine
        if "loop_share" in r
    ]
    timed = [r for r in mine if "stale_episodes" in r]
    if timed:
        out.append(
            target(
                "curriculum: episodes started on a stale task after a decision, reset mode (envsync)",
                float(sum(r["stale_episodes"] for r in timed)),
                0,
                higher_is_better=False,
                unit="",
            )
        )
        out.append(
            target(
                "curriculum: episodes credited to exactly the config they ran, reset mode (envsync, %)",
                min(r["credited_exact_pct"] for r in timed),
                100,
                higher_is_better=True,
                unit="",
            )
        )
    for r in mine:
        if "frames_tagged_right_pct" in r:
            out.append(
                target(
                    "curriculum: frames credited to the config they show, step mode (envsync, %)",
                    min(r["frames_right_pct"], r["frames_tagged_right_pct"]),
                    100,
                    higher_is_better=True,
                    unit="",
                )
            )
    return out


def _notes(args: Args, skipped: bool) -> list[str]:
    notes = [
        f"envs {args.envs}; {args.rounds} timed windows per variant, variants taking turns after a warm-up window "
        f"each, {args.window_frames} frames per window; envsync: MultiSyncCollector, {args.frames_per_worker} frames "
        f"per worker and batch, workers started with fork; Syllabus: AsyncVectorEnv(context='fork'), zero actions",
        "with / without: medians of the windows ('paired': the median over rounds of one round's two windows' "
        "ratio); the curriculum's share: the seconds its observe and decide calls took in the loop body / the "
        "window's wall time (median), the part of the collection the curriculum itself holds up; 'without' is "
        "the same collector or vector env without envsync or Syllabus (envsync's 'attached' column: envsync "
        "attached, nothing pushed)",
        "a stale episode starts (env clock, time.monotonic() at its reset) after the decision call returned and "
        "before the next decision, on a task of the half the decision left; 'decision -> first episode' runs from "
        "the start of the decision call (envsync: the push, wait='received'; Syllabus: setting the distribution)",
        "envsync draws a task for an env once the ledger has seen it run its previous draw (at most one push per "
        "batch), so an env may run one draw for several episodes; Syllabus draws one per reset",
        "torchrl resets an env in the step that ends its episode, so a decision made between batches reaches each "
        "env at the end of the episode it is running; gymnasium resets at the next step, when Syllabus takes a task",
        "frames per CPU s misses Syllabus's cost: a worker blocked on its task queue burns no CPU",
        f"mid-episode run: {args.credit_envs} envs, {args.credit_frames} frames per system, untimed",
    ]
    if skipped:
        notes.append("Syllabus skipped: syllabus-rl is not installed (pip install -e '.[bench]')")
    return notes


def run(args: Args) -> dict[str, Any]:
    skipped = "syllabus" in args.systems and syllabus_missing()
    if skipped:
        print("bench_curriculum: syllabus-rl is not installed; measuring envsync only (pip install -e '.[bench]')")
        args = replace(args, systems=[s for s in args.systems if s != "syllabus"])
    windows = len(args.envs) * (args.rounds + 1) * 3 * len(args.systems)
    mid_episode = max(args.credit_frames // (args.credit_envs * args.frames_per_worker), 1) * (
        "envsync" in args.systems
    )
    with tqdm(total=windows + mid_episode + ("syllabus" in args.systems), desc=NAME, unit="window") as bar:
        rows = [row for n in args.envs for row in measure_envs(n, args, bar)]
        rows += measure_mid_episode(args, bar)
    summary = {"plots": [_plot(rows, args.out).name]}
    report = Report(
        name=NAME,
        args=args,
        rows=rows,
        tables=[("Reset mode: frames/s and decisions", COLUMNS), ("Credit", CREDIT_COLUMNS)],
        summary=summary,
        targets=_targets(rows),
        notes=_notes(args, skipped),
    )
    return report.write(args.out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return run(parse_args(argv, Args, __doc__, quick))


if __name__ == "__main__":
    main()
