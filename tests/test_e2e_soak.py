"""End to end: pushes while a collector is iterated without pause.

The short run (200 pushes into a MultiAsyncCollector) is the core's guarantee (``make test``
runs it with forked workers; the spawn run is marked ``wide``); the load run (at least 2,000
pushes over at least 60 s into a MultiAsyncCollector) is the load guarantee of
docs/guarantees.md, repeated shorter (600 pushes over 20 s) for the single-process
``Collector`` and the ``MultiSyncCollector``. ``make soak`` runs the load runs at those sizes
(``ENVSYNC_SOAK_FULL=1``); ``make wide`` (CI) at a quarter of them (500 pushes over 15 s; 200
over 6 s); ``make test`` leaves them out.
"""

from __future__ import annotations

import itertools
import os
import time
from functools import partial

import psutil
import pytest
from conftest import build
from helpers import check_truthful, make_counter_env, rows, start_method

from envsync import EnvStateSender

WORKERS = 2
FRAMES = 20


def rss(pids: list[int]) -> list[int]:
    return [psutil.Process(pid).memory_info().rss for pid in pids]


def soak(method: str, min_pushes: int, min_seconds: float, kind: str = "async") -> dict[str, float]:
    """Iterate a collector of ``kind`` and push (waits mixed) until both minimums are met;
    check every batch."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    workers = 1 if kind == "single" else WORKERS
    makers = [partial(make_counter_env, label=i, max_steps=10**9) for i in range(workers)]
    with start_method(method):
        collector = build(kind, sender, makers, frames_per_batch=FRAMES)
    pids = [psutil.Process().pid, *(p.pid for p in getattr(collector, "procs", []))]
    waits = itertools.cycle(["received", None, "applied"])
    difficulty = {0: 0.0}
    last_step = dict.fromkeys(range(workers), 0.0)
    last_version = dict.fromkeys(range(workers), 0)
    batches = frames = 0
    start = time.monotonic()
    memory_after_warmup: list[int] = []
    try:
        for batch in collector:
            batches += 1
            frames += batch.numel()
            pushes = len(difficulty) - 1
            if pushes < min_pushes or time.monotonic() - start < min_seconds:
                value = float(len(difficulty))
                version = sender.push(config={"difficulty": value}, wait=next(waits))
                difficulty[version] = value
            check_truthful(batch, difficulty, index=0)
            for row in rows(batch):
                worker = int(row["observation"][0, 1])
                steps = row["observation"][:, 2]
                # episodes never end, so each worker's step counter runs on without a gap:
                # a dropped or duplicated batch would break it
                assert steps[0].item() == last_step[worker]
                assert bool((steps.diff() == 1).all())
                last_step[worker] = row["next", "observation"][-1, 2].item()
                versions = row["next", "env_version"]
                assert versions[0].item() >= last_version[worker]
                assert bool((versions.diff() >= 0).all())
                last_version[worker] = versions[-1].item()
            if not memory_after_warmup and time.monotonic() - start > min(5.0, min_seconds / 4):
                memory_after_warmup = rss(pids)
            done_pushing = len(difficulty) - 1 >= min_pushes and time.monotonic() - start >= min_seconds
            if done_pushing and sender.versions() == [sender.version] * workers:
                break
            assert batches < 100 * (min_pushes + 100)
        memory_at_end = rss(pids)
        elapsed = time.monotonic() - start
        acknowledged = sender.versions()
    finally:
        collector.shutdown()
        sender.close()
    assert frames == batches * FRAMES
    assert sum(last_step.values()) == frames
    # every push acknowledged: each worker ended up applying the last one
    assert acknowledged == [sender.version] * workers
    assert max(last_version.values()) <= sender.version
    growth = max(
        end / begin - 1 for begin, end in zip(memory_after_warmup or memory_at_end, memory_at_end, strict=True)
    )
    return {"pushes": float(sender.version), "seconds": elapsed, "batches": float(batches), "rss_growth": growth}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", [pytest.param("spawn", marks=pytest.mark.wide), "fork"])
def test_pushes_while_iterating_lose_nothing(method: str) -> None:
    result = soak(method, min_pushes=200, min_seconds=0)
    assert result["pushes"] == 200


FULL = os.environ.get("ENVSYNC_SOAK_FULL") == "1"  # make soak; make wide runs a shorter load
LOAD = (
    {"async": (2000, 60.0), "single": (600, 20.0), "sync": (600, 20.0)}
    if FULL
    else {"async": (500, 15.0), "single": (200, 6.0), "sync": (200, 6.0)}
)
"""Per collector kind: (minimum pushes, minimum seconds) of the load run."""


@pytest.mark.wide
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["single", "sync", "async"])
def test_load_pushes_while_iterating(kind: str) -> None:
    min_pushes, min_seconds = LOAD[kind]
    result = soak("fork", min_pushes=min_pushes, min_seconds=min_seconds, kind=kind)
    assert result["pushes"] >= min_pushes and result["seconds"] >= min_seconds
    assert result["rss_growth"] < 0.10, result
