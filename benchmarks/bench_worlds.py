"""What does envsync cost a natively batched env of n worlds?

A single-process ``Collector`` drives ``WorldsEnv`` (``bench_envs.py``): one torchrl
``EnvBase`` of n worlds (``batch_size=[n]``), a cheap vectorised step, episodes of
``50 + i % 17`` steps (worlds reset at different steps: partial resets), and
``set_difficulty(difficulty, env_ids)``, one indexed write ``self.difficulty[env_ids] =
difficulty``. envsync is attached with ``apply="set_difficulty", apply_at="step"``; every
figure uses envsync's public API only. For each n of ``--worlds``, side by side in one run, one
row per (n, measure):

1. **attach**: seconds to build the collector with envsync (the sender, ``sender.env_fn`` and
   ``weight_sync_schemes=sender.schemes()``) to its first batch, against the same collector
   without envsync.
2. **idle**: frames/s with envsync attached and nothing pending / without; the two collectors
   take turns in windows of about ``--window-s`` seconds; medians. Beside it, the tags'
   floor: the collector without envsync, each batch followed by what any four int64 tags a
   frame cost whoever writes them (two filled from a column, four copied as the ``Collector``
   copies each batch it yields): how much of the ratio the tags alone take; and the copies
   alone, all that is left of it while no env's version changes (envsync then leaves the
   version tags its collector's buffer holds).
3. **push**: ``sender.push(config=TensorDict(difficulty=rows, batch_size=[n]), wait="applied")``
   (one row per world) to the idle collector after a batch, median over the pushes after the
   first; the floor is the env's own indexed write of the same rows, ``env.difficulty[ids] =
   rows``, timed directly. Reported in ms and in µs per world above the floor; the env's values
   are checked against the rows after every push.
4. **curriculum**: frames/s of a loop that after every batch pushes new rows to a random 10% of
   the worlds (``envs=`` their indices, a tensor, ``wait=--curriculum-wait``) / the same loop writing the
   same rows into the env of the collector without envsync (``env.difficulty[ids] = rows``);
   windows taking turns, medians.
5. **read**: ``sender.read_attributes(["difficulty"])`` of every world against a direct read,
   ``collector.env.difficulty.clone()``; the two must be equal.
6. **memory**: the resident set growth of the process over the attach with envsync, minus
   that of the attach without (both measured from a trimmed heap, in bytes per world), and
   the bytes of the files that appear in ``/dev/shm`` during envsync's attach and that this
   process maps or holds open. Of that growth, the frame tags the collector's batches hold
   (live tensors shaped per frame, ``(n, steps, ...)``, counted after each attach: envsync's
   less the collector's own) are frame data, not state: they grow with the frames a batch
   holds (``steps_per_batch`` x four int64 a frame x the copies the ``Collector`` keeps), not
   with the worlds; envsync's state per world is the growth less them (the target).
7. **mjlab push** (only where ``mjlab`` imports: run this script with the mjlab venv's
   python): mjlab's Cartpole (torchrl's ``MJLabEnv``, Warp's CPU device) of ``--mjlab-worlds``
   worlds, ``push(wait="applied")`` of one mass factor per world through
   ``envsync.apply.scales({"mass": ["sim.model.body_mass", "sim.model.body_inertia"]},
   finish=envsync.apply.recompute_constants())`` against mjlab's own write of the same rows
   (both fields at the rows, per-world memory) + ``sim.recompute_constants(set_const)``.
8. **playground push** (only where ``mujoco_playground`` imports: the playground venv's
   python): MuJoCo Playground's Cartpole as envsync's ``PlaygroundWorlds`` (MJX, JAX on the
   CPU) of ``--playground-worlds`` worlds, ``push(wait="applied")`` of one mass factor per
   world (``apply="set_physics"``) against the env's own ``set_physics`` of the same rows
   (the masked write and the derived constants of every row), the masked write alone (a friction
   push: no constants), and the rebuild a Playground user does today (randomise, wrap for
   training, jit, first reset and step with compilation); see ``worlds_playground.py``.
9. **multisync / multiasync** (unless ``--no-across``): the n worlds as 2 forked workers
   of n / 2 in a ``MultiSyncCollector`` and in a ``MultiAsyncCollector``: seconds to the first
   batch, the ``/dev/shm`` file of envsync's link (its size a world, and the bytes it holds: a
   sparse file's untouched pages hold none), one push of a row per world to applied, and
   ``read_attributes`` of every world checked equal to it.

The current envsync is slow at large n, so each n has a time budget (``--budget`` s): an n
whose attach or first push takes longer skips its remaining measures (their rows say so), a
push or read waits at most the budget, each repeated measure stops repeating after a quarter
of it (fewer repetitions at large n), and an error at attach (``OSError: Cannot allocate
memory``) is recorded in the n's rows. torch runs one intra-op thread (``--threads``; 0: its
default): with two on 2 shared cores the cheap step's frames/s moved by up to 10x between windows.

    python benchmarks/bench_worlds.py [--quick] [--worlds 1024 4096] [--budget 60]
    .venv-mjlab/bin/python benchmarks/bench_worlds.py --mjlab-only   # measure 7 alone
    .venv-playground/bin/python benchmarks/bench_worlds.py --playground-only   # measure 8 alone
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib.util
import io
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
from bench_common import RESULTS, Report, fmt, markdown_table, median, parse_args, save_plot, start_method, target
from bench_envs import make_mjlab_cartpole, make_worlds_env
from tensordict import TensorDict

from envsync import AckTimeout, EnvStateSender

NAME = "worlds"
MEASURES = ("attach", "idle", "push", "curriculum", "read", "memory")
ACROSS = ("multisync", "multiasync")
"""The multi-process collectors measure 9 attaches the n worlds to, as 2 workers of n / 2."""
MJLAB = "mjlab push"
PLAYGROUND = "playground push"
SIMULATORS = (MJLAB, PLAYGROUND)
SHM = "/dev/shm"
KB = 1024
READ_TARGET_WORLDS = 65536


@dataclass
class Args:
    worlds: list[int] = field(default_factory=lambda: [1024, 4096, 16384, 65536])
    steps_per_batch: int = 16  # frames_per_batch = n * steps_per_batch
    budget: float = 60.0  # seconds per n (see the module's docstring)
    pushes: int = 10  # pushes to applied, after the first
    reads: int = 10  # read_attributes calls, after the first
    windows: int = 8  # idle and curriculum windows per variant (at least 2)
    window_s: float = 0.5  # a window runs batches until this long
    fraction: float = 0.1  # of the worlds a curriculum push targets
    curriculum_wait: str = "received"  # or "applied", "none"
    mjlab_worlds: list[int] = field(default_factory=lambda: [1024, 4096])
    mjlab_pushes: int = 10
    mjlab_only: bool = False  # measure 7 alone
    playground_worlds: list[int] = field(default_factory=lambda: [1024, 4096])
    playground_pushes: int = 10
    playground_only: bool = False  # measure 8 alone
    no_across: bool = False  # skip measure 9 (the n worlds in a MultiSync- and a MultiAsyncCollector of 2 workers)
    threads: int = 1  # torch intra-op threads (0: torch's default); see the notes
    policy: str = "random"  # "random": policy=None (torchrl draws each step's action); "zeros": a fixed action
    seed: int = 0
    start_method: str = "fork"
    quick: bool = False
    out: Path = RESULTS


def quick(args: Args) -> Args:
    return replace(
        args,
        worlds=[256, 1024],
        budget=20.0,
        pushes=4,
        reads=4,
        windows=2,
        window_s=0.2,
        mjlab_worlds=[64],
        mjlab_pushes=3,
        playground_worlds=[64],
        playground_pushes=3,
    )


# ---- helpers -------------------------------------------------------------------------------


def _number(value: float | None) -> float | None:
    """``value``, or ``None`` for a missing or NaN one (JSON keeps ``None`` equal to itself)."""
    return None if value is None or math.isnan(value) else float(value)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _trim() -> None:
    """Collect garbage and hand the heap's free pages back, so the resident set measures what is held."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def _shm_files() -> dict[str, int]:
    """The files of /dev/shm and their sizes."""
    files = {}
    try:
        entries = list(os.scandir(SHM))
    except OSError:
        return {}
    for entry in entries:
        try:
            files[entry.path] = entry.stat(follow_symlinks=False).st_size
        except OSError:
            continue
    return files


def _shm_allocated(paths: Sequence[str]) -> int:
    """The bytes /dev/shm actually holds for ``paths`` (their allocated blocks: a sparse file's
    untouched pages hold none)."""
    total = 0
    for path in paths:
        with contextlib.suppress(OSError):
            total += os.stat(path).st_blocks * 512
    return total


def _shm_held() -> set[str]:
    """The /dev/shm files this process maps or holds open (other jobs' files left out)."""
    held = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith(SHM + "/"):
                    held.add(parts[5].strip())
    except OSError:
        pass
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                target_path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target_path.startswith(SHM + "/"):
                held.add(target_path)
    except OSError:
        pass
    return held


def _repeat(fn: Callable[[], Any], count: int, allowance: float, minimum: int = 1) -> list[Any]:
    """``fn()`` up to ``count`` times, at least ``minimum``, stopping once ``allowance`` seconds are spent."""
    out: list[Any] = []
    start = time.perf_counter()
    while len(out) < count and (len(out) < minimum or time.perf_counter() - start < allowance):
        out.append(fn())
    return out


def _floor_seconds(fn: Callable[[], Any], repeats: int = 51) -> float:
    """Median seconds of a cheap call (one warm-up call first)."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return median(samples)


def _error(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".replace("\n", " ").replace("|", "/")
    return "error: " + (text if len(text) <= 160 else text[:157] + "...")


def _row(n: int, measure: str, **values: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "n": n,
        "measure": measure,
        "envsync": None,
        "baseline": None,
        "unit": "",
        "ratio": None,
        "per_world": None,
        "per_world_unit": "",
        "exact": None,
        "samples": 0,
        "status": "ok",
        "detail": "",
    }
    row.update(values)
    for key in ("envsync", "baseline", "ratio", "per_world"):
        row[key] = _number(row[key])
    return row


class OverBudget(Exception):
    """An attach or a first push that took longer than the n's budget."""


# ---- one n ---------------------------------------------------------------------------------


@dataclass
class Side:
    """One of the two collectors of an n: its iterator, and the sender when envsync is attached."""

    collector: Any
    batches: Iterator[Any]
    sender: EnvStateSender | None
    frames_per_batch: int

    @property
    def env(self) -> Any:
        return self.collector.env

    def close(self) -> None:
        try:
            self.collector.shutdown()
        finally:
            if self.sender is not None:
                self.sender.close()


class ZeroAction:
    """A policy of no cost: every world's action is 0 (``--policy zeros``). With ``policy=None``
    torchrl draws each step's action from the action spec, through ``TensorDict.from_any``,
    which looks pandas up on ``sys.path`` at every call: on this cheap env that is most of a
    step (at 1,024 worlds ~7 ms a batch of 16 steps against ~4 ms with this policy), and every
    ratio's denominator carries it."""

    def __init__(self, n: int) -> None:
        self.action = torch.zeros(n, 1)

    def __call__(self, tensordict: Any) -> Any:
        return tensordict.set("action", self.action.clone())


POLICIES = ("random", "zeros")


def _policy(n: int, args: Args) -> Any:
    return None if args.policy == "random" else ZeroAction(n)


def _attach(n: int, args: Args, with_envsync: bool) -> tuple[Side, float]:
    """Build a collector of ``WorldsEnv(n)`` (with envsync or not) to its first batch; its seconds."""
    from torchrl.collectors import Collector

    make = partial(make_worlds_env, n)
    policy = _policy(n, args)
    frames = n * args.steps_per_batch
    sender = None
    start = time.perf_counter()
    try:
        with start_method(args.start_method):
            if with_envsync:
                sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
                collector = Collector(
                    sender.env_fn(make),
                    policy,
                    frames_per_batch=frames,
                    total_frames=-1,
                    weight_sync_schemes=sender.schemes(),
                )
            else:
                collector = Collector(make, policy, frames_per_batch=frames, total_frames=-1)
        batches = iter(collector)
        next(batches)
    except BaseException:
        if sender is not None:
            sender.close()
        raise
    return Side(collector, batches, sender, frames), time.perf_counter() - start


def _frame_storages(n: int, steps: int) -> dict[int, int]:
    """The storages of the live tensors shaped per frame (``n`` worlds x ``steps``, then any),
    by address: their bytes (a batch's entries and the collector's buffers)."""
    found = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on torch's deprecated module attributes warns
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.dim() >= 2 and tuple(obj.shape[:2]) == (n, steps):
                storage = obj.untyped_storage()
                found[storage.data_ptr()] = storage.nbytes()
    return found


def _new_bytes(before: dict[int, int], after: dict[int, int]) -> int:
    return sum(size for address, size in after.items() if address not in before)


def _attach_and_memory(n: int, args: Args) -> tuple[Side, Side, dict[str, Any], dict[str, Any], float]:
    """Measures 1 and 6: the collector without envsync, then the one with, each from a trimmed
    heap; the frame data each holds counted after its attach (:func:`_frame_storages`)."""
    frames = _frame_storages(n, args.steps_per_batch)
    _trim()
    before = _rss()
    without, without_s = _attach(n, args, with_envsync=False)
    grown_without = _rss() - before
    frames_without = _frame_storages(n, args.steps_per_batch)
    frame_bytes_without = _new_bytes(frames, frames_without)
    _trim()
    before = _rss()
    files_before = _shm_files()
    try:
        with_, with_s = _attach(n, args, with_envsync=True)
    except BaseException:
        without.close()
        raise
    grown_with = _rss() - before
    frame_bytes = _new_bytes(frames_without, _frame_storages(n, args.steps_per_batch)) - frame_bytes_without
    state = grown_with - grown_without - frame_bytes
    new = {path: size for path, size in _shm_files().items() if path not in files_before}
    held = _shm_held()
    ours = {path: size for path, size in new.items() if path in held}
    shm_bytes = sum(ours.values())
    config_bytes = TensorDict(difficulty=torch.zeros(n), batch_size=[n]).bytes() / n
    attach = _row(
        n,
        "attach",
        envsync=with_s,
        baseline=without_s,
        unit="s",
        ratio=_ratio(with_s, without_s),
        per_world=(with_s - without_s) / n * 1e6,
        per_world_unit="µs",
        samples=1,
        detail="build to first batch; per world: above the collector without envsync",
    )
    memory = _row(
        n,
        "memory",
        envsync=grown_with,
        baseline=grown_without,
        unit="bytes",
        ratio=_ratio(grown_with, grown_without),
        per_world=(grown_with - grown_without) / n,
        per_world_unit="B",
        samples=1,
        detail=f"RSS growth over the attach; of it, frame tags the batches hold {frame_bytes / n:,.0f} B/world "
        f"({args.steps_per_batch} frames a world), envsync's state {state / n:,.0f} B/world; /dev/shm: "
        f"{shm_bytes:,} B in {len(ours)} new files ({shm_bytes / n:.3g} B/world); config "
        f"{config_bytes:g} B/world",
        frame_bytes=frame_bytes,
        frame_bytes_per_world=frame_bytes / n,
        state_per_world=state / n,
        shm_bytes=shm_bytes,
        shm_bytes_per_world=shm_bytes / n,
        shm_files=len(ours),
        shm_new_files_any_process=len(new),
        config_bytes_per_world=config_bytes,
    )
    return without, with_, attach, memory, with_s


def _push(n: int, args: Args, with_: Side, without: Side, generator: torch.Generator) -> dict[str, Any]:
    """Measure 3: push to applied, one row per world, against the env's own indexed write."""
    assert with_.sender is not None
    sender = with_.sender
    exact = []

    def push() -> float:
        rows = torch.rand(n, generator=generator)
        start = time.perf_counter()
        sender.push(config=TensorDict(difficulty=rows, batch_size=[n]), wait="applied", timeout=args.budget)
        seconds = time.perf_counter() - start
        exact.append(bool(torch.equal(with_.env.difficulty, rows)))
        return seconds

    try:
        first = push()
    except AckTimeout as error:
        raise OverBudget(f"first push not applied within the budget ({args.budget:g} s): {error}") from error
    if first > args.budget:
        raise OverBudget(f"first push {first:.1f} s > budget {args.budget:g} s")
    later = _repeat(push, args.pushes, args.budget / 4 - first, minimum=0)
    samples = later or [first]
    ids = torch.arange(n)
    rows = torch.rand(n, generator=generator)
    env = without.env

    def write() -> None:
        env.difficulty[ids] = rows

    floor = _floor_seconds(write)
    pushed = median(samples)
    return _row(
        n,
        "push",
        envsync=pushed * 1e3,
        baseline=floor * 1e3,
        unit="ms",
        ratio=_ratio(pushed, floor),
        per_world=(pushed - floor) / n * 1e6,
        per_world_unit="µs",
        exact=all(exact),
        samples=len(samples),
        detail="push(wait='applied') of n rows, idle; floor: env.difficulty[ids] = rows",
        first_push_ms=first * 1e3,
        raw={"push_s": samples, "first_push_s": first, "floor_s": floor},
    )


def _read(n: int, args: Args, with_: Side) -> dict[str, Any]:
    """Measure 5: read_attributes of every world against a direct read of the env."""
    assert with_.sender is not None
    sender = with_.sender
    checks = []

    def read() -> float:
        start = time.perf_counter()
        got = sender.read_attributes(["difficulty"], timeout=args.budget)
        seconds = time.perf_counter() - start
        direct = with_.env.difficulty.clone()
        values = got["difficulty"]
        checks.append(values.shape == direct.shape and bool(torch.equal(values.to(direct.dtype), direct)))
        return seconds

    try:
        first = read()
    except AckTimeout as error:
        return _row(n, "read", unit="ms", status=f"over budget: no reply within {args.budget:g} s ({error})")
    later = _repeat(read, args.reads, args.budget / 4 - first, minimum=0)
    samples = later or [first]
    direct = _floor_seconds(lambda: with_.env.difficulty.clone())
    got = median(samples)
    return _row(
        n,
        "read",
        envsync=got * 1e3,
        baseline=direct * 1e3,
        unit="ms",
        ratio=_ratio(got, direct),
        per_world=(got - direct) / n * 1e6,
        per_world_unit="µs",
        exact=all(checks),
        samples=len(samples),
        detail="read_attributes(['difficulty']) of every world, idle; direct: collector.env.difficulty.clone()",
        raw={"read_s": samples, "first_read_s": first, "direct_s": direct},
    )


def _window(side: Side, args: Args, body: Callable[[], None] | None) -> tuple[float, float]:
    """Frames/s and frames per CPU second of batches (each followed by ``body``) for about ``window_s``."""
    next(side.batches)  # the first batch after the other variant's window: not counted
    if body is not None:
        body()
    frames = 0
    wall, cpu = time.perf_counter(), time.process_time()
    while True:
        next(side.batches)
        if body is not None:
            body()
        frames += side.frames_per_batch
        elapsed = time.perf_counter() - wall
        if elapsed >= args.window_s:
            return frames / elapsed, frames / max(time.process_time() - cpu, 1e-9)


def _turns(
    args: Args, sides: dict[str, Side], bodies: dict[str, Callable[[], None] | None]
) -> dict[str, dict[str, list[float]]]:
    """Windows of each variant, taking turns (order alternating), until ``windows`` each or a quarter of the budget."""
    got: dict[str, dict[str, list[float]]] = {name: {"fps": [], "cpf": []} for name in sides}
    order = list(sides)
    start = time.perf_counter()
    i = 0
    while i < args.windows and (i < 2 or time.perf_counter() - start < args.budget / 4):
        for name in order[i % 2 :] + order[: i % 2]:
            fps, cpf = _window(sides[name], args, bodies[name])
            got[name]["fps"].append(fps)
            got[name]["cpf"].append(cpf)
        i += 1
    return got


def _tags_floor(n: int, args: Args, *, fills: bool = True) -> Callable[[], None]:
    """What any per-frame int64 tag costs a batch, whoever writes it: the two version tags
    filled from a column of n versions (``fills``), and the four tags (``env_version``,
    ``env_index``, at the root and under ``"next"``) copied as the ``Collector`` copies every
    batch it yields. Without ``fills``: the copies alone, what is left of the tags' cost in a
    rollout whose versions did not change (envsync then leaves the tags its buffer holds)."""
    tags = [torch.empty(n, args.steps_per_batch, dtype=torch.int64) for _ in range(4)]
    versions = np.arange(n, dtype=np.int64).reshape(-1, 1)

    def body() -> None:
        if fills:
            for tag in tags[:2]:
                tag.numpy()[...] = versions
        for tag in tags:
            tag.clone()

    return body


def _idle(n: int, args: Args, with_: Side, without: Side) -> dict[str, Any]:
    """Measure 2: frames/s with envsync attached, nothing pending / without; and against the
    collector without envsync whose every batch pays the tags' floor (:func:`_tags_floor`),
    and the tags' copies alone."""
    sides = {"without": without, "with": with_, "tags": without, "copies": without}
    floors = {"tags": _tags_floor(n, args), "copies": _tags_floor(n, args, fills=False)}
    got = _turns(args, sides, {"without": None, "with": None, **floors})
    fps = {name: median(v["fps"]) for name, v in got.items()}
    cpf = {name: median(v["cpf"]) for name, v in got.items()}
    cpu_ratio = _ratio(cpf["with"], cpf["without"])
    over_tags = _ratio(fps["with"], fps["tags"])
    over_copies = _ratio(fps["with"], fps["copies"])
    return _row(
        n,
        "idle",
        envsync=fps["with"],
        baseline=fps["without"],
        unit="frames/s",
        ratio=_ratio(fps["with"], fps["without"]),
        samples=len(got["with"]["fps"]),
        detail=f"nothing pending; frames per CPU s ratio {fmt(cpu_ratio)}; {args.steps_per_batch} steps a batch; "
        f"the tags' floor alone {fmt(_ratio(fps['tags'], fps['without']))}, envsync / the floor {fmt(over_tags)}; "
        f"the tags' copies alone {fmt(_ratio(fps['copies'], fps['without']))}, envsync / them {fmt(over_copies)}",
        cpu_ratio=cpu_ratio,
        tags_floor=fps["tags"],
        tags_floor_ratio=_ratio(fps["tags"], fps["without"]),
        over_tags_floor=over_tags,
        tags_copies_ratio=_ratio(fps["copies"], fps["without"]),
        over_tags_copies=over_copies,
        raw=got,
    )


def _curriculum(n: int, args: Args, with_: Side, without: Side, generator: torch.Generator) -> dict[str, Any]:
    """Measure 4: after every batch, new rows for a random ``fraction`` of the worlds."""
    assert with_.sender is not None
    sender = with_.sender
    k = max(1, round(n * args.fraction))
    wait = None if args.curriculum_wait.lower() == "none" else args.curriculum_wait
    env = without.env

    def pick() -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randperm(n, generator=generator)[:k].sort().values
        return ids, torch.rand(k, generator=generator)

    def push() -> None:
        ids, rows = pick()  # the ids as a torch user holds them: a tensor
        sender.push(config={"difficulty": rows}, envs=ids, wait=wait, timeout=args.budget)

    def write() -> None:
        ids, rows = pick()
        env.difficulty[ids] = rows

    tags = _tags_floor(n, args)

    def write_and_tag() -> None:
        write()
        tags()

    sides = {"without": without, "with": with_, "tags": without}
    got = _turns(args, sides, {"without": write, "with": push, "tags": write_and_tag})
    fps = {name: median(v["fps"]) for name, v in got.items()}
    cpf = {name: median(v["cpf"]) for name, v in got.items()}
    cpu_ratio = _ratio(cpf["with"], cpf["without"])
    over_tags = _ratio(fps["with"], fps["tags"])
    return _row(
        n,
        "curriculum",
        envsync=fps["with"],
        baseline=fps["without"],
        unit="frames/s",
        ratio=_ratio(fps["with"], fps["without"]),
        samples=len(got["with"]["fps"]),
        detail=f"push of {k} rows (envs=, wait={wait!r}) after every batch vs the env's own write of them; "
        f"frames per CPU s ratio {fmt(cpu_ratio)}; the tags' floor alone {fmt(_ratio(fps['tags'], fps['without']))},"
        f" envsync / the floor {fmt(over_tags)}",
        cpu_ratio=cpu_ratio,
        tags_floor=fps["tags"],
        tags_floor_ratio=_ratio(fps["tags"], fps["without"]),
        over_tags_floor=over_tags,
        worlds_per_push=k,
        raw=got,
    )


def _across(n: int, args: Args, kind: str, generator: torch.Generator) -> dict[str, Any]:
    """Measure 9: ``n`` worlds in a multi-process collector of 2 workers of ``n / 2`` worlds
    (forked): build to the first batch, the /dev/shm file envsync's link makes (its size and
    the bytes it holds), one push of a row per world to applied, checked exact with
    ``read_attributes`` of every world."""
    from torchrl.collectors import MultiAsyncCollector, MultiSyncCollector

    cls = MultiSyncCollector if kind == "multisync" else MultiAsyncCollector
    half = n // 2
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    files_before = _shm_files()
    collector = None
    try:
        start = time.perf_counter()
        with start_method(args.start_method):
            collector = cls(
                [sender.env_fn(partial(make_worlds_env, half))] * 2,
                None,
                frames_per_batch=2 * n,
                total_frames=-1,
                weight_sync_schemes=sender.schemes(),
            )
        batches = iter(collector)
        next(batches)
        attach_s = time.perf_counter() - start
        new = {path: size for path, size in _shm_files().items() if path not in files_before}
        ours = sorted(set(new) & _shm_held())
        size = sum(new[path] for path in ours)
        held = _shm_allocated(ours)
        rows = torch.rand(2 * half, generator=generator)
        start = time.perf_counter()
        sender.push(config=TensorDict(difficulty=rows, batch_size=[2 * half]), wait="applied", timeout=args.budget)
        push_s = time.perf_counter() - start
        got = sender.read_attributes(["difficulty"], timeout=args.budget)["difficulty"]
        exact = got.shape == rows.shape and bool(torch.equal(got.to(rows.dtype), rows))
    except Exception as error:
        return _row(n, kind, unit="s", status=_error(error))
    finally:
        if collector is not None:
            with contextlib.suppress(Exception):
                collector.shutdown()
        sender.close()
        _trim()
    return _row(
        n,
        kind,
        envsync=attach_s,
        unit="s",
        per_world=size / n,
        per_world_unit="B",
        exact=exact,
        samples=1,
        detail=f"{cls.__name__} of 2 forked workers x {half:,} worlds: attach to the first batch; /dev/shm: "
        f"{len(ours)} file(s) of {size / n:,.0f} B a world, {held / n:,.0f} B a world held (allocated); one "
        f"push of a row per world to applied {push_s * 1e3:.1f} ms, read_attributes of every world equal to it",
        shm_bytes=size,
        shm_held_bytes=held,
        shm_held_per_world=held / n,
        push_ms=push_s * 1e3,
    )


def _one_n(n: int, args: Args, generator: torch.Generator) -> list[dict[str, Any]]:
    """Every measure of one n, in the order of ``MEASURES``; skipped ones say why."""
    rows: dict[str, dict[str, Any]] = {}
    print(f"[{NAME}] n={n}: attach", flush=True)
    try:
        without, with_, rows["attach"], rows["memory"], attach_s = _attach_and_memory(n, args)
    except Exception as error:  # OSError: Cannot allocate memory, among others
        status = _error(error)
        return [_row(n, m, status=status) for m in MEASURES]
    skipped: str | None = None
    if attach_s > args.budget:
        skipped = f"skipped: over budget (attach {attach_s:.1f} s > {args.budget:g} s)"
    try:
        steps: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("push", lambda: _push(n, args, with_, without, generator)),
            ("read", lambda: _read(n, args, with_)),
            ("idle", lambda: _idle(n, args, with_, without)),
            ("curriculum", lambda: _curriculum(n, args, with_, without, generator)),
        ]
        for measure, run_measure in steps:
            if skipped is not None:
                rows[measure] = _row(n, measure, status=skipped)
                continue
            print(f"[{NAME}] n={n}: {measure}", flush=True)
            try:
                rows[measure] = run_measure()
            except OverBudget as error:
                rows[measure] = _row(n, measure, unit="ms", status=f"over budget: {error}")
                skipped = "skipped: over budget (first push)"
            except Exception as error:
                rows[measure] = _row(n, measure, status=_error(error))
                if measure == "push":
                    skipped = "skipped: the first push failed"
    finally:
        for side in (with_, without):
            try:
                side.close()
            except Exception as error:  # a collector that cannot shut down must not stop the run
                print(f"[{NAME}] n={n}: shutdown failed: {_error(error)}", flush=True)
        _trim()
    out = [rows[m] for m in MEASURES]
    if not args.no_across:
        for kind in ACROSS:
            print(f"[{NAME}] n={n}: {kind}", flush=True)
            out.append(_across(n, args, kind, generator))
    return out


def _warm_up(args: Args) -> None:
    """Pay the one-time costs (lazy imports, first allocations) before anything is measured."""
    small = replace(args, steps_per_batch=2)
    without, with_, _, _, _ = _attach_and_memory(64, small)
    try:
        assert with_.sender is not None
        with_.sender.push(config=TensorDict(difficulty=torch.rand(64), batch_size=[64]), wait="applied")
        with_.sender.read_attributes(["difficulty"])
        next(with_.batches)
        next(without.batches)
    finally:
        with_.close()
        without.close()
        _trim()


# ---- 7: mjlab ------------------------------------------------------------------------------


def _mjlab(n: int, args: Args, generator: torch.Generator) -> dict[str, Any]:
    """Measure 7: a per-world mass push to mjlab's Cartpole against mjlab's own write + recompute."""
    from mjlab.managers.event_manager import RecomputeLevel, requires_model_fields
    from torchrl.collectors import Collector

    import envsync

    fields = ("body_mass", "body_inertia")
    # the floor: a plain env, its fields (and the constants set_const derives) given per-world memory
    with contextlib.redirect_stdout(io.StringIO()):  # mjlab prints its managers' tables at every build
        env = make_mjlab_cartpole(n)
    env.reset()
    sim = env.sim  # torchrl's wrapper hands attributes on to mjlab's env
    derived = requires_model_fields(recompute=RecomputeLevel.set_const)(lambda: None).model_fields
    sim.expand_model_fields(tuple(f for f in (*fields, *derived) if hasattr(sim.mj_model, f)))
    built = {f: getattr(sim.model, f)[...].clone() for f in fields}
    ids = torch.arange(n)

    def write(rows: torch.Tensor) -> None:
        sim.model.body_mass[ids] = built["body_mass"][ids] * rows[:, None]
        sim.model.body_inertia[ids] = built["body_inertia"][ids] * rows[:, None, None]
        sim.recompute_constants(RecomputeLevel.set_const)

    apply = envsync.apply.scales(
        {"mass": ["sim.model.body_mass", "sim.model.body_inertia"]}, finish=envsync.apply.recompute_constants()
    )
    sender = EnvStateSender(config={"mass": 1.0}, apply=apply, apply_at="step")
    collector = None
    pushes: list[float] = []
    floors: list[float] = []
    exact: list[bool] = []
    try:
        start = time.perf_counter()
        with start_method(args.start_method), contextlib.redirect_stdout(io.StringIO()):
            collector = Collector(
                sender.env_fn(partial(make_mjlab_cartpole, n)),
                None,
                frames_per_batch=n,
                total_frames=-1,
                weight_sync_schemes=sender.schemes(),
            )
        next(iter(collector))
        attach_s = time.perf_counter() - start
        write(0.5 + torch.rand(n, generator=generator))  # warm: the first recompute compiles Warp's kernels
        model = collector.env.sim.model

        def push() -> None:
            rows = 0.5 + torch.rand(n, generator=generator)
            start = time.perf_counter()
            sender.push(config=TensorDict(mass=rows, batch_size=[n]), wait="applied", timeout=args.budget)
            pushes.append(time.perf_counter() - start)
            start = time.perf_counter()
            write(rows)
            floors.append(time.perf_counter() - start)
            exact.append(all(bool(torch.equal(getattr(model, f)[...], getattr(sim.model, f)[...])) for f in fields))

        push()  # the first: warm-up, and the budget check
        first = pushes.pop(0)
        floors.pop(0)
        if first <= args.budget:
            _repeat(push, args.mjlab_pushes, args.budget / 2, minimum=1)
    except Exception as error:
        return _row(n, MJLAB, unit="ms", status=_error(error))
    finally:
        if collector is not None:
            collector.shutdown()
        sender.close()
        env.close()
    if not pushes:
        return _row(n, MJLAB, unit="ms", status=f"over budget: first push {first:.1f} s > {args.budget:g} s")
    pushed, floor = median(pushes), median(floors)
    return _row(
        n,
        MJLAB,
        envsync=pushed * 1e3,
        baseline=floor * 1e3,
        unit="ms",
        ratio=_ratio(pushed, floor),
        per_world=(pushed - floor) / n * 1e6,
        per_world_unit="µs",
        exact=all(exact),
        samples=len(pushes),
        detail="Cartpole mass scales, push(wait='applied') vs mjlab's write of both fields + "
        f"recompute_constants(set_const); attach {attach_s:.1f} s",
        first_push_ms=first * 1e3,
        raw={"push_s": pushes, "floor_s": floors},
    )


def _playground(n: int, args: Args, generator: torch.Generator) -> dict[str, Any]:
    """Measure 8: a per-world mass push to Playground's Cartpole (``worlds_playground.py``)."""
    from worlds_playground import measure

    try:
        got = measure(n, args.playground_pushes, generator)
    except Exception as error:
        return _row(n, PLAYGROUND, unit="ms", status=_error(error))
    pushed, floor = got["push_s"], got["write_s"]
    return _row(
        n,
        PLAYGROUND,
        envsync=pushed * 1e3,
        baseline=floor * 1e3,
        unit="ms",
        ratio=_ratio(pushed, floor),
        per_world=(pushed - floor) / n * 1e6,
        per_world_unit="µs",
        exact=got["exact"],
        samples=got["samples"],
        detail="Cartpole mass scales, push(wait='applied') vs the masked write alone; apply "
        f"{got['apply_s'] * 1e3:.1f} ms, rebuild {got['rebuild_s']:.1f} s; attach {got['attach_s']:.1f} s",
        apply_ms=got["apply_s"] * 1e3,
        friction_push_ms=got["friction_push_s"] * 1e3,
        friction_ratio=_ratio(got["friction_push_s"], floor),
        rebuild_s=got["rebuild_s"],
        rebuild_ratio=_ratio(got["rebuild_s"], pushed),
        traces_added=got["traces_added"],
        raw=got["raw"],
    )


# ---- the report ----------------------------------------------------------------------------

COLUMNS = [
    ("n", "worlds"),
    ("measure", "measure"),
    ("envsync", "with envsync"),
    ("baseline", "without / floor"),
    ("unit", "unit"),
    ("ratio", "with / without"),
    ("per_world", "per world above"),
    ("per_world_unit", "unit"),
    ("exact", "exact"),
    ("samples", "samples"),
    ("status", "status"),
    ("detail", "what"),
]

SUMMARY_COLUMNS = [
    ("worlds", "worlds"),
    ("attach_s", "attach s (without)"),
    ("idle_ratio", "idle frames/s ratio"),
    ("tags_floor_ratio", "the tags' floor alone"),
    ("tags_copies_ratio", "their copies alone"),
    ("push_ms", "push -> applied ms (floor)"),
    ("push_us_per_world", "push µs/world above floor"),
    ("curriculum_ratio", "10% curriculum ratio (over the tags' floor)"),
    ("read_ms", "read_attributes ms (direct)"),
    ("rss_per_world", "RSS B/world"),
    ("frame_per_world", "of it frame tags"),
    ("state_per_world", "of it envsync's state"),
    ("shm_per_world", "/dev/shm B/world"),
    ("across_attach_s", "2 workers, MultiSync / MultiAsync: attach s"),
    ("across_shm", "their /dev/shm B/world (held)"),
]

MJLAB_COLUMNS = [
    ("worlds", "worlds"),
    ("push_ms", "push -> applied ms"),
    ("floor_ms", "mjlab write + recompute ms"),
    ("push_us_per_world", "µs/world above"),
    ("exact", "same model"),
]


PLAYGROUND_COLUMNS = [
    ("worlds", "worlds"),
    ("push_ms", "push -> applied ms"),
    ("apply_ms", "set_physics ms (write + constants)"),
    ("write_ms", "masked write alone ms"),
    ("friction_push_ms", "friction push -> applied ms"),
    ("friction_ratio", "friction push / masked write"),
    ("rebuild_s", "rebuild + recompile s"),
    ("rebuild_ratio", "rebuild / push"),
    ("traces_added", "traces added by the pushes"),
    ("exact", "model holds the rows"),
]


def _short(row: dict[str, Any]) -> str:
    status = str(row["status"])
    return "over budget" if "over budget" in status else status.split(":")[0] + ("" if ":" not in status else "*")


def _cell(row: dict[str, Any] | None, key: str, paired: str | None = None) -> Any:
    """A summary cell: the row's figure (``paired`` in brackets), or why there is none."""
    if row is None:
        return "-"
    if row["status"] != "ok":
        return _short(row)
    if paired is None:
        return row.get(key, "-")  # a figure an older run did not measure
    return f"{fmt(row[key])} ({fmt(row[paired])})"


def _across_cell(row: dict[str, Any] | None, key: str) -> Any:
    """A cell of measure 9: its attach seconds, or its /dev/shm bytes a world (held), or why none."""
    if row is None or row["status"] != "ok":
        return _cell(row, key)
    if key == "shm":
        return f"{fmt(row['per_world'])} ({fmt(row['shm_held_per_world'])})"
    return fmt(row[key]) + ("" if row["exact"] else " (not exact)")


def summary_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per n of the native measures: the short table for docs/performance.md."""
    out = []
    for n in dict.fromkeys(r["n"] for r in rows if r["measure"] not in SIMULATORS):
        by = {r["measure"]: r for r in rows if r["n"] == n and r["measure"] not in SIMULATORS}
        memory = by.get("memory")
        counted = memory is not None and "frame_bytes" in memory
        out.append(
            {
                "worlds": n,
                "attach_s": _cell(by.get("attach"), "envsync", "baseline"),
                "idle_ratio": _cell(by.get("idle"), "ratio"),
                "tags_floor_ratio": _cell(by.get("idle"), "tags_floor_ratio"),
                "tags_copies_ratio": _cell(by.get("idle"), "tags_copies_ratio"),
                "push_ms": _cell(by.get("push"), "envsync", "baseline"),
                "push_us_per_world": _cell(by.get("push"), "per_world"),
                "curriculum_ratio": _cell(by.get("curriculum"), "ratio", "over_tags_floor")
                if by.get("curriculum") and "over_tags_floor" in by["curriculum"]
                else _cell(by.get("curriculum"), "ratio"),
                "read_ms": _cell(by.get("read"), "envsync", "baseline"),
                "rss_per_world": _cell(memory, "per_world"),
                "frame_per_world": _cell(memory, "frame_bytes_per_world") if counted else "-",
                "state_per_world": _cell(memory, "state_per_world") if counted else "-",
                "shm_per_world": _cell(memory, "shm_bytes_per_world") if memory and "shm_bytes" in memory else "-",
                "across_attach_s": " / ".join(str(_across_cell(by.get(kind), "envsync")) for kind in ACROSS),
                "across_shm": " / ".join(str(_across_cell(by.get(kind), "shm")) for kind in ACROSS),
            }
        )
    return out


def mjlab_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "worlds": r["n"],
            "push_ms": _cell(r, "envsync"),
            "floor_ms": _cell(r, "baseline"),
            "push_us_per_world": _cell(r, "per_world"),
            "exact": r["exact"],
        }
        for r in rows
        if r["measure"] == MJLAB
    ]


def playground_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "worlds": r["n"],
            "push_ms": _cell(r, "envsync"),
            "apply_ms": _cell(r, "apply_ms"),
            "write_ms": _cell(r, "baseline"),
            "friction_push_ms": _cell(r, "friction_push_ms"),
            "friction_ratio": _cell(r, "friction_ratio"),
            "rebuild_s": _cell(r, "rebuild_s"),
            "rebuild_ratio": _cell(r, "rebuild_ratio"),
            "traces_added": _cell(r, "traces_added"),
            "exact": r["exact"],
        }
        for r in rows
        if r["measure"] == PLAYGROUND
    ]


@dataclass
class WorldsReport(Report):
    """:class:`Report` with the short per-n tables first."""

    short: list[dict[str, Any]] = field(default_factory=list)
    mjlab: list[dict[str, Any]] = field(default_factory=list)
    playground: list[dict[str, Any]] = field(default_factory=list)

    def markdown(self) -> str:
        head, _, rest = super().markdown().partition("\n")
        parts = [head]
        if self.short:
            parts += ["", "Per number of worlds (medians):", "", markdown_table(self.short, SUMMARY_COLUMNS)]
        if self.mjlab:
            parts += ["", "mjlab's Cartpole, a mass factor per world (medians):", ""]
            parts += [markdown_table(self.mjlab, MJLAB_COLUMNS)]
        if self.playground:
            parts += ["", "MuJoCo Playground's Cartpole (MJX, JAX on the CPU), a mass factor per world (medians):", ""]
            parts += [markdown_table(self.playground, PLAYGROUND_COLUMNS)]
        return "\n".join(parts) + "\n" + rest


def _targets(rows: list[dict[str, Any]], args: Args) -> list[dict[str, Any]]:
    def one(name: str, row: dict[str, Any] | None, key: str, goal: float, higher: bool, unit: str) -> dict[str, Any]:
        value = None if row is None or row["status"] != "ok" else row.get(key)
        if value is None:
            goal_text = f"{'>=' if higher else '<='} {goal:g}{unit}"
            return {"target": name, "measured": None, "goal": goal_text, "met": False}
        return target(name, value, goal, higher_is_better=higher, unit=unit)

    out = []
    for n in dict.fromkeys(r["n"] for r in rows if r["measure"] not in SIMULATORS):
        by = {r["measure"]: r for r in rows if r["n"] == n and r["measure"] not in SIMULATORS}
        memory = by.get("memory")
        config = memory.get("config_bytes_per_world", 4.0) if memory else 4.0
        out += [
            one(
                f"{n} worlds: frames/s with envsync attached, nothing pending / without",
                by.get("idle"),
                "ratio",
                0.97,
                True,
                "x",
            ),
            one(
                f"{n} worlds: push -> applied to every world, µs per world above the env's own indexed write",
                by.get("push"),
                "per_world",
                1.0,
                False,
                " µs",
            ),
            one(
                f"{n} worlds: 10% curriculum (a push to a random 10% after every batch), frames/s with / without",
                by.get("curriculum"),
                "ratio",
                0.95,
                True,
                "x",
            ),
            one(
                f"{n} worlds: resident memory of envsync's state per world, the frame tags the batches hold aside "
                f"(1 KB + the config's {config:g} B)",
                memory,
                "state_per_world",
                KB + config,
                False,
                " B",
            ),
        ]
        if n == READ_TARGET_WORLDS:
            read = by.get("read")
            out.append(one(f"{n} worlds: read_attributes of every world", read, "envsync", 10.0, False, " ms"))
            for kind in ACROSS:
                row = by.get(kind)
                if row is not None and row.get("exact") is False:
                    row = None  # attached, but the push did not reach every world: not met
                name = "MultiSyncCollector" if kind == "multisync" else "MultiAsyncCollector"
                out.append(
                    one(
                        f"{n} worlds in a {name} of 2 x {n // 2:,}: attach to the first batch (a push then applied "
                        "to every world, read back exact)",
                        row,
                        "envsync",
                        args.budget,
                        False,
                        " s",
                    )
                )
    return out


def _plot(rows: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, (ratio_ax, ms_ax) = plt.subplots(1, 2, figsize=(10, 3.8))

    def series(measure: str, key: str) -> tuple[list[int], list[float]]:
        got = [(r["n"], r[key]) for r in rows if r["measure"] == measure and r[key] is not None]
        return [n for n, _ in got], [v for _, v in got]

    def draw(ax: Any, lines: Sequence[tuple[str, str, str]]) -> bool:
        drawn = False
        for measure, key, label in lines:
            x, y = series(measure, key)
            if x:
                ax.plot(x, y, marker="o", label=label)
                drawn = True
        if drawn:
            ax.set_xscale("log", base=2)
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        return drawn

    if draw(ratio_ax, [("idle", "ratio", "idle (nothing pending)"), ("curriculum", "ratio", "10% curriculum")]):
        ratio_ax.axhline(1.0, color="grey", lw=0.8)
    ratio_ax.set(xlabel="worlds", ylabel="frames/s with envsync / without", title="throughput")
    lines = [
        ("push", "envsync", "push -> applied"),
        ("push", "baseline", "floor: env.difficulty[ids] = rows"),
        ("read", "envsync", "read_attributes"),
        ("read", "baseline", "direct read"),
        (MJLAB, "envsync", "mjlab: push -> applied"),
        (MJLAB, "baseline", "mjlab: write + recompute"),
        (PLAYGROUND, "envsync", "playground: push -> applied"),
        (PLAYGROUND, "baseline", "playground: masked write"),
    ]
    if draw(ms_ax, lines):
        ms_ax.set_yscale("log")
    ms_ax.set(xlabel="worlds", ylabel="median ms", title="one push / read of every world")
    fig.suptitle("A natively batched env of n worlds")
    return save_plot(fig, out, NAME)


def _playgrounds(args: Args, generator: torch.Generator, notes: list[str]) -> list[dict[str, Any]]:
    """Measure 8 at each n of ``--playground-worlds``, where Playground imports."""
    if args.mjlab_only:
        return []
    if importlib.util.find_spec("mujoco_playground") is None:
        message = "mujoco_playground is not installed here: measure 8 skipped; run with the playground venv's python"
        print(f"[{NAME}] {message}", flush=True)
        notes.append(message)
        return []
    rows = []
    for n in args.playground_worlds:
        print(f"[{NAME}] playground n={n}", flush=True)
        rows.append(_playground(n, args, generator))
    return rows


def run(args: Args) -> dict[str, Any]:
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: Args) -> dict[str, Any]:
    if args.policy not in POLICIES:
        raise SystemExit(f"--policy {args.policy!r}: expected one of {POLICIES}")
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    rows: list[dict[str, Any]] = []
    notes = []
    start = time.perf_counter()
    native = not (args.mjlab_only or args.playground_only)
    if native:
        _warm_up(args)
        for n in args.worlds:
            began = time.perf_counter()
            rows += _one_n(n, args, generator)
            print(f"[{NAME}] n={n}: {time.perf_counter() - began:.1f} s", flush=True)
    if args.playground_only:
        pass
    elif importlib.util.find_spec("mjlab") is None:
        message = "mjlab is not installed here: measure 7 (mjlab's Cartpole) skipped; run with the mjlab venv's python"
        print(f"[{NAME}] {message}", flush=True)
        notes.append(message)
    else:
        for n in args.mjlab_worlds:
            print(f"[{NAME}] mjlab n={n}", flush=True)
            rows.append(_mjlab(n, args, generator))
    rows += _playgrounds(args, generator, notes)
    wait = args.curriculum_wait
    if native:
        notes += [
            f"one process: a torchrl Collector of WorldsEnv(n), frames_per_batch = n x {args.steps_per_batch}, "
            + (
                "random policy (policy=None: torchrl draws each step's action, ~45% of this cheap env's batch "
                "at 1,024 worlds; --policy zeros leaves it out)"
                if args.policy == "random"
                else "a fixed zero action as the policy (--policy zeros: no action drawn)"
            )
            + "; envsync attached with apply='set_difficulty', apply_at='step'; cells that say 'over "
            f"budget' or 'error*' did not run or failed at that n (the rows in the JSON give the text); budget "
            f"{args.budget:g} s per n; torch threads {torch.get_num_threads()} (with two on 2 shared cores, OpenMP's "
            "waits moved the cheap step's frames/s by up to 10x between windows)",
            "attach: one build of each collector, the one without envsync first, after a warm-up at 64 worlds; "
            "memory: the resident set growth over each attach from a trimmed heap (malloc_trim), envsync's the "
            "difference; of it, the frame tags: the bytes of live tensors shaped (n, steps, ...) after envsync's "
            "attach less those after the other's (a Collector holds its rollout buffer and the batch it yielded: "
            f"2 x 4 int64 tags x {args.steps_per_batch} frames = {2 * 4 * 8 * args.steps_per_batch} B a world), "
            "frame data that grows with the frames a batch holds, not with the worlds; envsync's state: the "
            "rest; /dev/shm: files that appeared during envsync's attach and that this process maps or holds open",
            f"idle and curriculum: windows of >= {args.window_s:g} s per variant taking turns, medians (the first "
            f"batch of a window not counted); curriculum push wait={wait!r}, the loop without envsync writes the "
            "same rows into its env; the tags' floor: the loop without envsync paying, after each batch, what the "
            "four int64 tags of its frames cost whoever writes them; both collectors live in this process, so the "
            "one without envsync also walks envsync's objects in Python's garbage collections (if anything, a bias "
            "towards 1)",
            "push and read: the collector idle after a batch; median of the calls after the first (the first alone "
            "where the budget allowed no other); the values are compared with the env's own after each call; "
            "floors timed directly, median of 51",
            "targets: idle >= 0.97, push <= 1 µs per world above the floor, 10% curriculum >= 0.95, envsync's "
            "state in RSS (the growth less the frame tags) <= 1 KB per world + the config's bytes, "
            f"read_attributes <= 10 ms at {READ_TARGET_WORLDS} worlds (a target only where that n was asked for)",
        ]
    if any(r["measure"] == MJLAB for r in rows):
        notes.append(
            "mjlab: Mjlab-Cartpole-Balance through torchrl's MJLabEnv on Warp's CPU device, a Collector of one step a "
            "batch, apply_at='step'; the floor writes the same rows into a second env of n worlds (body_mass and "
            "body_inertia at the rows, per-world memory, then sim.recompute_constants(set_const)); push and floor "
            "alternate, the first push not counted; 'same model' compares both fields of the two models after "
            "each push"
        )
    if any(r["measure"] == PLAYGROUND for r in rows):
        notes.append(
            "playground: CartpoleBalance as envsync's PlaygroundWorlds (MJX impl='jax', XLA on the CPU), a Collector "
            "of "
            "one step a batch, apply='set_physics', apply_at='step'; a second env of n worlds in this process takes "
            "env.set_physics(ids, mass=rows) (masked write of body_mass and body_inertia + the derived constants "
            "of the rows) and "
            "env.set_physics(ids, friction=rows) (the masked write alone), and a second Collector takes a push of "
            "the same rows as friction factors (config={'friction': 1.0}: nothing derived); pushes, apply and write "
            "alternate, the "
            "first not counted; rebuild: randomisation_fn -> wrap_for_brax_training -> jit reset and step -> first "
            "reset and step (one run per n); 'traces added': JAX traces of both envs over the pushes"
        )
    notes.append(f"the run took {time.perf_counter() - start:.0f} s")
    report = WorldsReport(
        name=NAME,
        args=args,
        rows=rows,
        tables=[("Every measure (medians)", COLUMNS)],
        summary={"plots": [_plot(rows, args.out).name], "by_worlds": summary_rows(rows)},
        targets=_targets(rows, args),
        notes=notes,
        short=summary_rows(rows),
        mjlab=mjlab_rows(rows),
        playground=playground_rows(rows),
    )
    return report.write(args.out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return run(parse_args(argv, Args, __doc__, quick))


if __name__ == "__main__":
    main()
