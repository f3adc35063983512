"""Model-based test of the whole matrix: collector kinds x env kinds x apply modes, each
driven through random histories of pushes, waits, failing applies, gathers, statistics syncs,
checkpoint round-trips and collected batches, checked against a reference model.

The pieces: the envs (``model_envs.py``), the reference model and the per-frame checks
(``model_ref.py``), the state machine (``model_machine.py``); here, the rules each cell may
draw and the two runs:

- ``test_model[cell]``: a fixed seed per cell (from ``ENVSYNC_MODEL_SEED``, default 18), a few
  short histories per cell (``ENVSYNC_MODEL_EXAMPLES``, ``ENVSYNC_MODEL_STEPS``). ``make test``
  runs the covering subset (:data:`COVERING`: each collector kind, env kind, apply mode and
  operation at least once); the other cells are marked ``wide`` (``make wide``, CI's second
  step, runs them: every cell once);
- ``test_model_soak`` (``make soak``): for ``ENVSYNC_MODEL_SECONDS`` seconds, fresh seeds and
  longer histories over every cell; it prints how many histories and operations ran and the
  violations found (each with the history that produced it), and fails if there was one.

A failure prints the history (hypothesis' steps); ``ENVSYNC_MODEL_SHRINK=1`` shrinks it first
(slow: every shrink step builds collectors); ``ENVSYNC_MODEL_VERBOSE=1`` prints every history.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, Verbosity, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import get_state_machine_test, rule
from model_envs import ENV_KINDS, has_env_state
from model_machine import COUNTS, Cell, ModelMachine, Target, operation
from model_ref import Violation

KINDS = ("single", "sync", "async")
MODES = ("reset", "step", "truncate")
CELLS = [Cell(kind, env_kind, mode) for kind in KINDS for env_kind in ENV_KINDS for mode in MODES]
# batched levels without a reinit in "reset" mode: each env applied at its own reset, its level
# acknowledging it at once (appended: the cells above keep their seeds)
CELLS += [Cell(kind, env_kind, "reset", level_reinit=False) for kind in KINDS for env_kind in ENV_KINDS[1:]]
# worlds by the thousand: a natively batched env of 1,024 rows per worker, in each collector
# kind, "step" and "reset" mode (appended: the cells above keep their seeds)
CELLS += [Cell(kind, "native", mode, rows=1024) for kind in KINDS for mode in ("step", "reset")]
COVERING = [
    Cell("single", "plain", "reset"),
    Cell("sync", "parallel", "step"),
    Cell("async", "serial", "truncate"),
    Cell("sync", "native", "truncate"),
    Cell("async", "plain", "step"),
]
"""The cells ``make test`` runs: every collector kind, env kind and apply mode; a plain env (the
only kind whose resume may load gathered state) and envs with state (gather, sync_stats) under
a single collector and under both Multi* ones; a collector idle between batches in "reset"
mode (whose waits for "applied" are left out) and collectors that take applied waits. The
cells of 1,024 worlds a worker run in ``make wide`` (every collector kind, two modes)."""
SEED = int(os.environ.get("ENVSYNC_MODEL_SEED", "18"))
EXAMPLES = int(os.environ.get("ENVSYNC_MODEL_EXAMPLES", "3"))
STEPS = int(os.environ.get("ENVSYNC_MODEL_STEPS", "8"))
SHRINK = os.environ.get("ENVSYNC_MODEL_SHRINK") == "1"
VERBOSE = os.environ.get("ENVSYNC_MODEL_VERBOSE") == "1"
SOAK_SECONDS = float(os.environ.get("ENVSYNC_MODEL_SECONDS", "0"))
DELAYS = st.sampled_from([None, 0.0, 0.002, 0.01, 0.05])
"""A pushed ``delay`` (seconds the config method sleeps); ``None``: the name is not pushed."""
ORDERS = st.sampled_from(["load_then_build", "build_then_load"])
"""Resume orders: load the checkpoint into the new sender before building its collector, or after."""


def subsets(n: int) -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True).map(lambda ids: tuple(sorted(ids)))


def targets(cell: Cell) -> st.SearchStrategy[Target]:
    return st.one_of(
        st.just(Target("all")),
        subsets(cell.workers).map(lambda ids: Target("workers", ids)),
        subsets(cell.num_envs).map(lambda ids: Target("envs", ids)),
    )


def machine_for(cell: Cell) -> type[ModelMachine]:
    """The state machine of ``cell``: the operations it may draw, with readable arguments."""
    waits = st.sampled_from(["received", None, "applied"] if cell.applied_waits else ["received", None])
    untils = st.sampled_from(["received", "applied"] if cell.applied_waits else ["received"])
    state = has_env_state(cell.env_kind)

    class Machine(ModelMachine):
        @rule(batches=st.integers(1, 3))
        @operation
        def collect_batches(self, batches: int) -> None:
            self.collect(batches)

        @rule(
            to=targets(cell),
            rows=st.sampled_from(["one", "tensordict", "dict"]),
            delay=DELAYS,
            loc=st.booleans() if state else st.just(False),
            wait=waits,
            table=st.booleans(),
        )
        @operation
        def push(self, to: Target, rows: str, delay: float | None, loc: bool, wait: str | None, table: bool) -> None:
            self.do_push(to, rows, delay, loc, wait, table)

        @rule(workers=subsets(cell.workers), delay=DELAYS, wait=waits)
        @operation
        def push_each(self, workers: tuple[int, ...], delay: float | None, wait: str | None) -> None:
            self.do_push_each(workers, delay, wait)

        @rule(until=untils)
        @operation
        def wait(self, until: str) -> None:
            self.do_wait(until)

        @rule(to=targets(cell), all_marked=st.booleans())
        @operation
        def failing_push(self, to: Target, all_marked: bool) -> None:
            self.do_fail(to, all_marked)

        if cell.env_kind != "plain" and cell.level_reinit:

            @rule(workers=subsets(cell.workers))
            @operation
            def failing_batched_level(self, workers: tuple[int, ...]) -> None:
                self.do_fail_batched(workers)

        @rule(order=ORDERS)
        @operation
        def resume(self, order: str) -> None:
            self.do_resume(order, gather=False)

        @rule()
        @operation
        def read_attributes(self) -> None:
            self.do_read_attributes()

        @rule(env=st.integers(0, cell.num_envs - 1))
        @operation
        def refused_read(self, env: int) -> None:
            self.do_refused_read(env)

        if state:

            @rule()
            @operation
            def gather(self) -> None:
                self.do_gather()

            @rule()
            @operation
            def sync_stats(self) -> None:
                self.do_sync_stats()

        if cell.env_kind == "plain":

            @rule(order=ORDERS)
            @operation
            def resume_with_gathered_state(self, order: str) -> None:
                self.settle()  # every env holds its desired state: what is gathered agrees
                self.do_resume(order, gather=True)

    Machine.cell = cell
    Machine.__name__ = Machine.__qualname__ = f"Model_{cell}".replace("-", "_")
    return Machine


def run(cell: Cell, *, seed_value: int, examples: int, steps: int, shrink: bool = SHRINK) -> None:
    """Run ``examples`` histories of up to ``steps`` operations of ``cell`` from ``seed_value``."""
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    test: Any = get_state_machine_test(
        machine_for(cell),
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,
            phases=phases,
            suppress_health_check=list(HealthCheck),
            report_multiple_bugs=False,
            print_blob=False,
            verbosity=Verbosity.debug if VERBOSE else Verbosity.normal,
        ),
    )
    seed(seed_value)(test)
    test()


def invariant_of(err: BaseException) -> str:
    """The invariant a failure broke (a flaky replay wraps the first failure in a group)."""
    if isinstance(err, BaseExceptionGroup) and err.exceptions:
        return invariant_of(err.exceptions[0])
    return err.invariant if isinstance(err, Violation) else type(err).__name__


def describe(err: BaseException) -> str:
    """A failure with its notes (the history), and those of the failures a group wraps."""
    lines = [f"{type(err).__name__}: {err}", *getattr(err, "__notes__", [])]
    for inner in err.exceptions if isinstance(err, BaseExceptionGroup) else ():
        lines.append(describe(inner))
    return "\n".join(lines)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "cell", [pytest.param(c, marks=() if c in COVERING else pytest.mark.wide) for c in CELLS], ids=str
)
def test_model(cell: Cell) -> None:
    seed_value = SEED * 1000 + CELLS.index(cell)  # each cell its own histories
    # a ParallelEnv takes ~2 s to shut down (torchrl waits for its processes): fewer, longer
    # histories there keep the matrix within ~3 minutes on 2 cores
    if cell.env_kind == "parallel":
        run(cell, seed_value=seed_value, examples=max(1, EXAMPLES - 1), steps=STEPS + 2)
    else:
        run(cell, seed_value=seed_value, examples=EXAMPLES, steps=STEPS)


def soak(cells: list[Cell], seconds: float, *, examples: int, steps: int, what: str) -> None:
    """Run fresh histories over ``cells`` for ``seconds``; print what ran and every
    violation (each with the history that produced it); fail if there was one."""
    master = os.environ.get("ENVSYNC_MODEL_SEED")
    rng = random.Random(None if master is None else int(master))
    deadline = time.monotonic() + seconds
    violations: Counter[str] = Counter()
    start = COUNTS.copy()
    while time.monotonic() < deadline:
        for cell in rng.sample(cells, len(cells)):
            history_seed = rng.getrandbits(32)
            try:
                run(cell, seed_value=history_seed, examples=examples, steps=steps, shrink=False)
            except Exception as err:  # every failure is a finding: count it, print it, go on
                violations[invariant_of(err)] += 1
                print(f"\nVIOLATION in {cell} (history seed {history_seed}):\n{describe(err)}")
            if time.monotonic() >= deadline:
                break
    ran = COUNTS - start
    print(
        f"\n{what}: {ran['histories']} histories, {ran['operations']} operations, "
        f"{sum(violations.values())} invariant violations {dict(violations)}"
    )
    assert not violations


@pytest.mark.skipif(not SOAK_SECONDS, reason="the soak run: make soak (ENVSYNC_MODEL_SECONDS)")
@pytest.mark.timeout(SOAK_SECONDS + 900)
def test_model_soak() -> None:
    soak(CELLS, SOAK_SECONDS, examples=3, steps=25, what="model soak")


# histories the soak found, replayed in make test: (cell, history seed, what it broke)
REGRESSIONS = [
    # a batched level failing every version it reached (reset mode: its envs skip the
    # rollbacks) left "applied" behind while the sub-envs loaded each sync_stats merge; the
    # merge counted their statistics from a stale baseline (87 observations of at most 57)
    (Cell("single", "serial", "reset"), 3517895387, "sync_stats counts each observation once"),
]


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("cell", "history_seed", "broke"), REGRESSIONS, ids=[f"{c}-{s}" for c, s, _ in REGRESSIONS])
def test_model_regression(cell: Cell, history_seed: int, broke: str) -> None:
    run(cell, seed_value=history_seed, examples=3, steps=25, shrink=False)
