"""What both sides of ``bench_curriculum.py`` share: the tasks, the records of what ran and
what was credited, and the measures taken from them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import psutil

DIFFICULTIES = tuple(round(0.1 * i, 1) for i in range(8))
HALVES = (DIFFICULTIES[:4], DIFFICULTIES[4:])


@dataclass(frozen=True)
class Ran:
    """One finished episode (a piece of one, in envsync's step mode): what it ran, what it was credited to."""

    start: float  # time.monotonic() at its reset (the env's clock)
    first: float  # the difficulty of its first frame
    low: float  # the lowest and highest difficulty its frames show
    high: float
    credited: float  # the difficulty the curriculum credited it to
    length: int
    right: int  # frames showing the credited difficulty
    whole: bool = True  # False: a piece of an episode cut where its config changed (envsync, step mode)


@dataclass
class Decision:
    begin: float  # time.monotonic() when the decision began
    end: float  # ... and when the call that made it returned
    tasks: tuple[float, ...]


@dataclass
class Tally:
    """What one variant saw: frames per second and per CPU second of each window, decisions,
    finished episodes."""

    fps: list[float] = field(default_factory=list)
    cpu_fps: list[float] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    ran: list[Ran] = field(default_factory=list)
    loop_share: list[float] = field(default_factory=list)  # share of each window's wall time in the curriculum

    def window(self, frames: int, wall_s: float, cpu_s: float) -> None:
        self.fps.append(frames / wall_s)
        self.cpu_fps.append(frames / max(cpu_s, 1e-9))


def cpu_seconds(pids: Sequence[int]) -> float:
    """CPU seconds used so far by this process (all its threads) and the processes ``pids``
    (read from /proc in 10 ms ticks)."""
    total = 0.0
    for process in [psutil.Process(), *map(psutil.Process, pids)]:
        times = process.cpu_times()
        total += times.user + times.system
    return total


def staleness(tally: Tally) -> tuple[list[int], list[float]]:
    """Per decision: the episodes started after it returned (and before the next began) on a
    task of the half it left; and the seconds from its beginning to the first episode on its half."""
    stale, first = [], []
    ends = [d.begin for d in tally.decisions[1:]] + [float("inf")]
    for decision, until in zip(tally.decisions, ends, strict=True):
        after = [r for r in tally.ran if decision.end < r.start < until]
        stale.append(sum(r.first not in decision.tasks for r in after))
        new = [r.start for r in tally.ran if r.start > decision.begin and r.first in decision.tasks]
        first.append(min(new) - decision.begin if new else float("nan"))
    return stale, first


def credit(tally: Tally) -> dict[str, float]:
    """Shares of episodes (pieces) credited to exactly the task they ran, to the one they
    started on, and of frames credited to the task they show."""
    ran = tally.ran
    frames = sum(r.length for r in ran)
    return {
        "episodes": len(ran),
        "credited_exact_pct": 100 * sum(r.low == r.high == r.credited for r in ran) / max(len(ran), 1),
        "credited_start_pct": 100 * sum(r.first == r.credited for r in ran) / max(len(ran), 1),
        "frames_right_pct": 100 * sum(r.right for r in ran) / max(frames, 1),
        "mixed_episodes": sum(r.low != r.high or not r.whole for r in ran),
    }
