"""The state machine of the model-based test (``test_model.py``): one history drives a fresh
sender and collector of one cell (collector kind x env kind x apply mode) through random
operations, and checks envsync against the reference model (:mod:`model_ref`) after each.

Operations: push (to all, ``workers=``, ``envs=``, with one value or per-env rows, config
with or without the slow ``delay`` name, with or without env state), ``push_each``, ``wait``,
a push whose config method fails (rollback), a push that fails at a batched env's own level
(rollback at both levels), ``gather``, ``sync_stats``, a checkpoint round-trip into a new
sender and collector (resume), and collecting batches. Every frame of every batch goes
through :class:`model_ref.Frames`, and every env and version a batch shows through the
sender's record of past configs (``config_at``), which must name the config the frame's
observation shows.

"Collected from then on" after ``wait="applied"``: the workers of a ``Collector`` and a
``MultiSyncCollector`` are idle between batches, so every later frame must run the version;
a ``MultiAsyncCollector`` worker may have one rollout queued and one running, so each env
may show up to two rollouts' worth of older frames before its first frame of the version
(and none after it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps
from typing import Any, NamedTuple

import torch
from conftest import KINDS, build
from helpers import start_method, unconfirmed_rollback
from hypothesis.stateful import RuleBasedStateMachine
from model_envs import (
    LOC_KEY,
    OBSERVATION,
    SUB_ENVS,
    TABLE,
    TRIPWIRE,
    WIDE_TABLE,
    arm_read,
    disarm_reads,
    envs_per_worker,
    factories,
    has_env_state,
)
from model_ref import Frames, Model, Setting, Violation, expect
from tensordict import TensorDict, TensorDictBase

from envsync import AckTimeout, EnvStateSender, GatherError, ValidationError, WorkerApplyError, reinit

COUNTS: Counter[str] = Counter()
"""Histories and operations run in this process (the soak run prints them)."""
TIMEOUT = 20.0
"""Seconds for a wait that must succeed (slow config methods, a loaded 2-core machine)."""
SYNC_TIMEOUT = 5.0
"""Seconds for ``sync_stats`` (a gather at a safe point, then every worker applies the merge)."""
SHORT = 0.5
"""Seconds for a wait that may legitimately time out (``"applied"`` in reset mode)."""
ROLLOUT = 4
"""Steps per env in one rollout."""
SETTLE_BATCHES = 60


@dataclass(frozen=True)
class Cell:
    """One cell of the matrix."""

    kind: str  # "single" | "sync" | "async", or "ray-" and one of them (see make_collector)
    env_kind: str  # "plain" | "serial" | "parallel" | "native"
    mode: str  # "reset" | "step" | "truncate"
    level_reinit: bool = True
    """Whether a batched env's own level runs a ``reinit`` policy (the tripwire's check) at every
    version; without one, an env whose version asks nothing of its level is applied as soon as
    it holds it (the gate's early acknowledgement), and the level cannot be made to fail."""
    rows: int = SUB_ENVS
    """Rows of each worker's natively batched env (thousands: worlds by the thousand, each row
    with a table of :data:`WIDE_TABLE` floats instead of 1 MB)."""

    def __str__(self) -> str:
        rows = "" if self.rows == SUB_ENVS else f"-{self.rows}-rows"
        return f"{self.kind}-{self.env_kind}-{self.mode}" + ("" if self.level_reinit else "-bare-level") + rows

    @property
    def table(self) -> int:
        """Floats of the ``table`` config value."""
        return TABLE if self.rows == SUB_ENVS else WIDE_TABLE

    @property
    def ray(self) -> bool:
        return self.kind.startswith("ray-")

    @property
    def inner(self) -> str:
        """The collector kind that runs the envs (in each remote actor, over Ray)."""
        return self.kind.removeprefix("ray-")

    @property
    def workers(self) -> int:
        return 1 if self.kind == "single" else 2

    @property
    def per_worker(self) -> int:
        return envs_per_worker(self.env_kind, self.rows)

    @property
    def num_envs(self) -> int:
        return self.workers * self.per_worker

    @property
    def frames_per_batch(self) -> int:
        """One rollout of every env a batch comes from: one worker's (``MultiAsyncCollector``)
        or every env's (the others; a ``RayCollector(sync=True)`` splits it over its remote
        collectors)."""
        envs = self.per_worker if self.kind == "async" else self.num_envs
        return ROLLOUT * envs

    @property
    def idle_between_batches(self) -> bool:
        # a RayCollector(sync=True) asks every remote collector for one batch at a time
        return self.inner != "async"

    @property
    def applied_waits(self) -> bool:
        """Whether ``wait="applied"`` from the loop can succeed (API.md's first trap)."""
        return self.mode != "reset" or not self.idle_between_batches


class Target(NamedTuple):
    """Which envs an operation targets: ``all``, ``workers`` (fleet worker indices) or ``envs``."""

    kind: str
    ids: tuple[int, ...] = ()

    def kwargs(self) -> dict[str, Any]:
        """The push's keyword; ``envs=`` ids as a tensor for every odd sum of them (a user's
        ids are often a tensor; no draw of its own: each cell keeps its histories)."""
        if self.kind == "all":
            return {}
        if self.kind == "envs" and sum(self.ids) % 2:
            return {"envs": torch.tensor(self.ids)}
        return {self.kind: list(self.ids)}

    def envs(self, cell: Cell) -> list[int]:
        if self.kind == "all":
            return list(range(cell.num_envs))
        if self.kind == "envs":
            return list(self.ids)
        return [w * cell.per_worker + i for w in self.ids for i in range(cell.per_worker)]


def make_sender(cell: Cell) -> EnvStateSender:
    config = {"difficulty": 0.0, "delay": 0.0, "table": torch.zeros(cell.table)}
    # a batched env's own level checks its tripwire at every version it reaches
    rules = {"batched.Tripwire": reinit.call("check")} if cell.env_kind != "plain" and cell.level_reinit else None
    return EnvStateSender(config=config, apply="set_difficulty", apply_at=cell.mode, reinit=rules)


def make_collector(cell: Cell, sender: EnvStateSender) -> Any:
    """The cell's collector; a Ray cell's is a ``RayCollector(sync=True)`` of two remote
    collectors of the inner kind, each of one worker (fleet worker ``w`` is remote collector
    ``w``): one pinned to each node of the test cluster, or, for the ``ray-sync`` cells, both
    to one node (whose relays then share each large share as one object-store object; see
    :data:`TWO_ON_ONE_NODE`)."""
    if cell.ray:
        return make_ray_collector(cell, sender)
    with start_method("fork"):
        return build(
            cell.kind,
            sender,
            factories(cell.env_kind, cell.workers, cell.rows, cell.table),
            workers=cell.workers,
            frames_per_batch=cell.frames_per_batch,
        )


TWO_ON_ONE_NODE = ("sync",)
"""The inner kinds whose Ray cells put both remote collectors on one node: a large share for
that node goes through the object store (put once, held by the mailbox, mapped by both
relays); the other cells' shares go on each relay's connection, across nodes."""


def make_ray_collector(cell: Cell, sender: EnvStateSender) -> Any:
    from torchrl.collectors.distributed import RayCollector

    nodes = ("n0", "n0") if cell.inner in TWO_ON_ONE_NODE else ("n0", "n1")
    return RayCollector(
        [sender.env_fn(f) for f in factories(cell.env_kind, cell.workers, cell.rows, cell.table)],
        None,
        collector_class=KINDS[cell.inner],
        num_workers_per_collector=1,
        frames_per_batch=cell.frames_per_batch,
        total_frames=10**9,
        sync=True,
        remote_configs=[{"num_cpus": 0.25, "memory": 150 * 2**20, "resources": {n: 0.01}} for n in nodes],
        **sender.ray_kwargs(start_method="fork"),
    )


def operation(fn: Callable[..., None]) -> Callable[..., None]:
    """A rule's body, run through :meth:`ModelMachine.record` under its name and arguments."""

    @wraps(fn)
    def run(self: ModelMachine, **kwargs: Any) -> None:
        arguments = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        self.record(f"{fn.__name__}({arguments})", lambda: fn(self, **kwargs))

    return run


def value(version: int, position: int) -> float:
    """The difficulty an env is given by ``version`` (distinct per version and row)."""
    return 100.0 * version + position


class ModelMachine(RuleBasedStateMachine):
    """A history of one cell; :func:`test_model.machine_for` adds the rules."""

    cell: Cell

    def __init__(self) -> None:
        super().__init__()
        COUNTS["histories"] += 1
        cell = self.cell
        self.model = Model(cell.num_envs)
        allowance = 0 if cell.idle_between_batches else 2 * ROLLOUT
        self.frames = Frames(self.model, cell.mode == "reset", allowance, has_env_state(cell.env_kind))
        self.sender = make_sender(cell)
        self.collector = make_collector(cell, self.sender)
        self.iterator = iter(self.collector)
        self.merged = 0.0  # the count of the last merged statistics
        self.observations_bound = cell.num_envs  # every env's first reset
        self.healthy = True
        self.history = [f"{cell}"]

    # ---- helpers the rules share -------------------------------------------------------------

    def record(self, operation: str, body: Callable[[], None]) -> None:
        """Run one operation; a failure carries this run's history (a flaky replay may not
        show it) and marks the run so teardown only cleans up."""
        COUNTS["operations"] += 1
        self.history.append(operation)
        self.healthy = False
        try:
            body()
        except Exception as err:
            err.add_note("this run: " + "; ".join(self.history))
            raise
        self.healthy = True

    def collect(self, batches: int = 1) -> None:
        for _ in range(batches):
            batch = next(self.iterator)
            self.frames.check(batch)
            self.check_records(batch)

    def check_records(self, batch: TensorDictBase) -> None:
        """The sender's record of past configs (``config_at``) names, for every frame's env
        and version, the config its observation shows."""
        env = batch["next", "env_index"].reshape(-1)
        version = batch["next", "env_version"].reshape(-1)
        shown = batch["next", "observation"].reshape(-1, batch["next", "observation"].shape[-1])
        first: dict[tuple[int, int], int] = {}  # each (env, version) pair: its first frame
        for i, pair in enumerate(zip(env.tolist(), version.tolist(), strict=True)):
            first.setdefault(pair, i)
        for (e, v), i in first.items():
            config = self.sender.config_at(e, v)
            recorded = (float(config["difficulty"]), float(config["table"].reshape(-1)[0]))
            seen = (float(shown[i, 0]), float(shown[i, 3]))
            expect(
                all(abs(a - b) < 1e-4 for a, b in zip(recorded, seen, strict=True)),
                "the sender's records are what the workers run",
                f"config_at({e}, {v}) records difficulty, table {recorded}; the frame shows {seen}",
            )

    def call(self, what: str, fn: Callable[[], Any], *, may_time_out: bool = False) -> Any:
        """``fn()``, with an unexpected envsync error turned into a violation."""
        try:
            return fn()
        except WorkerApplyError as err:
            self.raised_once(err)
            raise Violation("no unexpected apply failure", f"{what}: {err}") from err
        except AckTimeout as err:
            if may_time_out:
                return err
            raise Violation("acks arrive", f"{what}: {err}") from err

    def raised_once(self, err: WorkerApplyError) -> None:
        once = err.version not in self.model.rolled_back
        expect(once, "a failure is raised once", f"version {err.version}, rolled back already, raised again: {err}")

    def published(self, updates: dict[int, Setting], *, default_loc: float | None = None) -> int:
        version = self.sender.version
        self.model.publish(version, updates, default_loc=default_loc)
        self.observations_bound += len(updates)  # a truncate-mode apply may reset an env once
        return version

    def setting(
        self, env: int, difficulty: float, delay: float | None, loc: float | None, table: bool = False
    ) -> Setting:
        """Env ``env``'s setting after a push of these values (``None``, ``False``: not pushed;
        a pushed table holds the env's new difficulty)."""
        current = self.model.current[env]
        return Setting(
            difficulty,
            current.delay if delay is None else delay,
            current.loc if loc is None else loc,
            difficulty if table else current.table,
        )

    def waited(self, version: int, envs: list[int], result: Any) -> None:
        """A ``wait="applied"`` for ``version`` on ``envs`` returned (or timed out, in reset mode)."""
        if isinstance(result, AckTimeout):
            expect(self.cell.mode == "reset", "acks arrive", f"wait('applied') for {version}: {result}")
            return
        self.frames.raise_floor(envs, version)

    # ---- operations ----------------------------------------------------------------------------

    def do_push(
        self, target: Target, rows: str, delay: float | None, loc: bool, wait: str | None, table: bool = False
    ) -> None:
        version = self.model.latest + 1
        envs = target.envs(self.cell)
        n = len(envs)
        difficulties = [value(version, i) for i in range(n)] if rows != "one" else [value(version, 0)] * n
        config: Any
        if rows == "one":
            config = {"difficulty": difficulties[0]} | ({} if delay is None else {"delay": delay})
            config |= {"table": torch.full((self.cell.table,), difficulties[0])} if table else {}
        else:
            columns = {"difficulty": torch.tensor(difficulties)}
            if delay is not None:
                columns["delay"] = torch.full((n,), delay)
            if table:
                columns["table"] = torch.tensor(difficulties).unsqueeze(1).expand(n, self.cell.table).contiguous()
            config = TensorDict(columns, batch_size=[n]) if rows == "tensordict" else columns
        loc_value = 1000.0 + version if loc else None
        env_state = None if loc_value is None else {LOC_KEY: torch.full((OBSERVATION,), loc_value)}
        timeout = SHORT if wait == "applied" and self.cell.mode == "reset" else TIMEOUT
        result = self.call(
            f"push {version}",
            lambda: self.sender.push(config, env_state, wait=wait, timeout=timeout, **target.kwargs()),
            may_time_out=wait == "applied" and self.cell.mode == "reset",
        )
        updates = {e: self.setting(e, d, delay, loc_value, table) for e, d in zip(envs, difficulties, strict=True)}
        self.published(updates, default_loc=loc_value if target.kind == "all" else None)
        self.scribble(config, env_state)
        if wait == "applied":
            self.waited(version, envs, result)

    @staticmethod
    def scribble(config: Any, env_state: dict[str, torch.Tensor] | None) -> None:
        """The caller reuses its buffers after the push: nothing pushed may change."""
        if isinstance(config, dict):
            for column in config.values():
                if isinstance(column, torch.Tensor):
                    column.fill_(-7.0)
        elif isinstance(config, TensorDict):
            config.apply_(lambda x: x.fill_(-7.0))
        if env_state is not None:
            env_state[LOC_KEY].fill_(-999.0)

    def do_push_each(self, workers: tuple[int, ...], delay: float | None, wait: str | None) -> None:
        version = self.model.latest + 1
        configs = {w: {"difficulty": value(version, w)} | ({} if delay is None else {"delay": delay}) for w in workers}
        timeout = TIMEOUT if wait != "applied" or self.cell.mode != "reset" else SHORT
        result = self.call(
            f"push_each {version}",
            lambda: self.sender.push_each(configs, wait=wait, timeout=timeout),
            may_time_out=wait == "applied" and self.cell.mode == "reset",
        )
        envs = Target("workers", workers).envs(self.cell)
        updates = {e: self.setting(e, value(version, e // self.cell.per_worker), delay, None) for e in envs}
        self.published(updates)
        if wait == "applied":
            self.waited(version, envs, result)

    def do_wait(self, until: str) -> None:
        version = self.model.latest
        envs = sorted(self.model.table[version])
        kwargs = {} if len(envs) == self.cell.num_envs else {"envs": envs}
        timeout = SHORT if until == "applied" and self.cell.mode == "reset" else TIMEOUT
        result = self.call(
            f"wait {version} {until}",
            lambda: self.sender.wait(version, until=until, timeout=timeout, **kwargs),
            may_time_out=until == "applied" and self.cell.mode == "reset",
        )
        if until == "applied":
            self.waited(version, envs, result)

    def do_fail(self, target: Target, all_marked: bool) -> None:
        """A push whose config method raises on the marked envs: ``WorkerApplyError``, then
        every targeted env runs its previous setting again (a rollback version)."""
        version = self.model.latest + 1
        envs = target.envs(self.cell)
        marked = set(envs) if all_marked else {envs[0]}
        difficulties = [-value(version, i) if e in marked else value(version, i) for i, e in enumerate(envs)]
        updates = {e: self.setting(e, d, None, None) for e, d in zip(envs, difficulties, strict=True)}
        failure = self.push_failing(version, {"difficulty": torch.tensor(difficulties)}, target)
        self.rolled_back(version, updates, failure, {e // self.cell.per_worker for e in marked})

    def do_fail_batched(self, workers: tuple[int, ...]) -> None:
        """A push that arms the batched level's tripwire on whole workers: their batched level
        fails the version (every env under it had applied it): ``WorkerApplyError`` with
        that level's traceback, then every level runs the previous version again (the
        rollback disarms the tripwire)."""
        version = self.model.latest + 1
        target = Target("workers", workers)
        updates = {e: self.model.current[e] for e in target.envs(self.cell)}
        failure = self.push_failing(version, None, target, env_state={TRIPWIRE: torch.ones(())})
        failure = self.rolled_back(version, updates, failure, set(workers))
        expect(
            "own transforms failed" in failure.remote_traceback and "tripwire" in failure.remote_traceback,
            "a batched-level failure carries that level's traceback",
            failure.remote_traceback[-300:],
        )

    def rolled_back(
        self, version: int, updates: dict[int, Setting], failure: WorkerApplyError | None, workers: set[int]
    ) -> WorkerApplyError:
        """A failing push of ``version`` to the envs of ``updates`` (their settings had it
        applied) was raised (``failure``; ``None``: surface it first) by one of ``workers``
        and rolled back as the next version; return the error."""
        envs = list(updates)
        self.model.publish(version, updates)
        # a truncate-mode env resets for the failed version (its apply fails at that reset) and
        # again for the rollback: two observations each that no frame shows
        self.observations_bound += 2 * len(envs)
        if failure is None:
            failure = self.surface_failure(version, envs)
        self.raised_once(failure)
        unconfirmed = unconfirmed_rollback(failure)
        expect(not unconfirmed, "a failure is raised with its rollback in place", f"{unconfirmed}")
        expect(failure.version == version, "rollback", f"WorkerApplyError for version {failure.version}, not {version}")
        expect(failure.worker in workers, "rollback", f"the error names worker {failure.worker}, not one of {workers}")
        expect(failure.rollback == version + 1 == self.sender.version, "rollback", f"rollback {failure.rollback}")
        self.model.roll_back(version, version + 1)
        return failure

    def push_failing(
        self, version: int, config: Any, target: Target, env_state: dict[str, torch.Tensor] | None = None
    ) -> WorkerApplyError | None:
        """The failing push: raises at once where a push can wait for "applied"; ``None`` in
        reset mode (the envs fail later, at their resets)."""
        wait = "received" if self.cell.mode == "reset" else "applied"
        try:
            self.sender.push(config, env_state, wait=wait, timeout=TIMEOUT, **target.kwargs())
        except WorkerApplyError as err:
            return err
        except AckTimeout as err:
            raise Violation("a failing apply raises WorkerApplyError", f"push {version}: {err}") from err
        expect(wait == "received", "a failing apply raises WorkerApplyError", f"push {version} returned")
        return None

    def surface_failure(self, version: int, envs: list[int]) -> WorkerApplyError:
        """Reset mode: the envs fail at their next reset; collect until a wait raises it."""
        for _ in range(SETTLE_BATCHES):
            self.collect()
            try:
                self.sender.wait(version, until="received", envs=envs, timeout=TIMEOUT)
            except WorkerApplyError as err:
                return err
        raise Violation("a failing apply raises WorkerApplyError", f"version {version}: never raised")

    def held_between(self, env: int, first: int, last: int) -> list[Any]:
        """Every setting the model says ``env`` may have held while a read ran, from version
        ``first`` (what ``env_versions()`` counted before it) to ``last`` (after it). Under a
        batched level a sub-env holds a version it *reached* before its siblings let the level
        acknowledge it *applied* (docs/batched.md): there, up to the latest version published."""
        if self.cell.env_kind != "plain":
            last = max(last, self.model.latest)
        return [s for v in range(first, last + 1) for s in self.model.table.get(v, {}).get(env, ())]

    def do_gather(self) -> None:
        """Each env's ``loc``, read back at a safe point, is one the model says it held."""
        before = self.sender.env_versions()
        try:
            gathered = self.call("gather", lambda: self.sender.gather([LOC_KEY], timeout=TIMEOUT))
        except ValidationError as err:  # README "Not there yet": gather does not reach sub-envs
            expect(self.cell.per_worker > 1, "gather works", f"gather: {err}")
            return
        after = self.sender.env_versions()
        locs = gathered.flatten_keys(".")[LOC_KEY]
        expect(locs.shape[0] == self.cell.num_envs, "gather works", f"gather gave {locs.shape[0]} rows")
        for env, row in enumerate(locs.tolist()):
            held = {s.loc for s in self.held_between(env, before[env], after[env])}
            expect(
                any(all(abs(x - loc) < 1e-4 for x in row) for loc in held),
                "gather returns what each env holds",
                f"env {env} (versions {before[env]}..{after[env]}): gathered loc {row}, the model says {sorted(held)}",
            )

    def do_read_attributes(self) -> None:
        """Each env's difficulty, read back from the env itself at a safe point, is one the
        model says it held meanwhile."""
        before = self.sender.env_versions()
        held = self.call("read_attributes", lambda: self.sender.read_attributes(["difficulty"], timeout=TIMEOUT))
        after = self.sender.env_versions()
        values = held["difficulty"].reshape(-1).tolist()
        expect(len(values) == self.cell.num_envs, "read_attributes works", f"{len(values)} rows")
        for env, difficulty in enumerate(values):
            allowed = {s.difficulty for s in self.held_between(env, before[env], after[env])}
            expect(
                any(abs(difficulty - d) < 1e-3 for d in allowed),
                "read_attributes returns what each env holds",
                f"env {env} (versions {before[env]}..{after[env]}): difficulty {difficulty}, model {sorted(allowed)}",
            )

    def do_refused_read(self, env: int) -> None:
        """A read that fails once in ``env``'s worker: ``GatherError`` naming that env (its
        traceback attached), no version failed; the next read works. An env in this process
        (a single-process ``Collector``'s, or its ``SerialEnv``'s) is never refused."""
        label = env - env % self.cell.per_worker if self.cell.env_kind == "native" else env
        versions = self.sender.env_versions()
        arm_read(label)
        try:
            self.sender.read_attributes(["trouble"], timeout=TIMEOUT)
            refused = None
        except GatherError as err:
            refused = err
        except AckTimeout as err:
            raise Violation("a refused read raises GatherError", f"read_attributes: {err}") from err
        finally:
            disarm_reads()
        if refused is None:
            in_process = self.cell.kind == "single" and self.cell.env_kind in ("plain", "serial", "native")
            expect(in_process, "a refused read raises GatherError", f"env {env}'s armed read was not refused")
        else:
            expect(
                refused.env // self.cell.per_worker == env // self.cell.per_worker
                and "fails once" in refused.remote_traceback,
                "a refused read names its env and carries its traceback",
                f"GatherError for env {refused.env}, armed env {env}: {refused.remote_traceback[-200:]}",
            )
        expect(
            all(a >= b for a, b in zip(self.sender.env_versions(), versions, strict=True)),
            "a refused read fails no version",
            f"versions {versions} -> {self.sender.env_versions()}",
        )
        self.do_read_attributes()

    def do_sync_stats(self) -> None:
        """Merged counts add up: never fewer than the last merge (nor, with idle workers that
        apply at once, than the frames collected), never more observations than were made."""
        try:
            version = self.call("sync_stats", lambda: self.sender.sync_stats("VecNormV2", timeout=SYNC_TIMEOUT))
        except ValidationError as err:  # README "Not there yet": sync_stats does not reach sub-envs
            expect(self.cell.per_worker > 1, "sync_stats works", f"sync_stats: {err}")
            return
        self.published(dict(enumerate(self.model.current)))
        expect(version == self.model.latest, "versions", f"sync_stats gave {version}, published {self.model.latest}")
        counts = [float(v) for k, v in self.sender.state_dict()["env_state"].items() if "count" in k]
        expect(len(counts) == 1, "sync_stats works", f"the checkpoint holds {len(counts)} merged counts")
        merged = counts[0]
        lower = self.merged
        if self.cell.idle_between_batches and self.cell.mode != "reset":
            lower = max(lower, self.frames.steps_this_generation)
        upper = self.frames.steps + self.frames.dones + self.observations_bound + self.in_flight
        expect(lower <= merged <= upper, "sync_stats counts each observation once", f"{lower} <= {merged} <= {upper}")
        self.merged = merged

    def do_resume(self, order: str, gather: bool) -> None:
        """``state_dict()`` holds the model's desired state; a new sender and collector
        restored from it run exactly that (``order``: load before building the collector,
        or after)."""
        state = self.call("state_dict", lambda: self.sender.state_dict(gather=gather))
        self.check_checkpoint(state)
        self.collector.shutdown()
        self.sender.close()
        self.sender = make_sender(self.cell)
        if order == "load_then_build":
            version = self.sender.load_state_dict(state)
            self.collector = make_collector(self.cell, self.sender)
            self.model.restart(version)
        else:
            self.collector = make_collector(self.cell, self.sender)
            before = self.sender.version
            version = self.call("load_state_dict", lambda: self.sender.load_state_dict(state))
            self.model.restart(version, intermediate=range(version))
            # the load publishes several versions (env state, each env's own row, the config
            # rows): a truncate-mode env applying them one by one resets once for each
            self.observations_bound += (version - before) * self.cell.num_envs
        self.iterator = iter(self.collector)
        self.frames.new_generation()
        self.observations_bound += self.cell.num_envs
        # workers that run ahead of the loop (MultiAsyncCollector) observed the frames of the
        # batches in flight, which the shutdown threw away: their statistics (merged by a sync,
        # or gathered into the checkpoint) count observations that no collected frame shows
        self.observations_bound += self.in_flight

    @property
    def in_flight(self) -> int:
        """The most frames the workers may have made beyond those collected."""
        return 0 if self.cell.idle_between_batches else 2 * 2 * ROLLOUT * self.cell.num_envs

    def check_checkpoint(self, state: dict[str, Any]) -> None:
        latest = self.model.latest
        expect(
            state["version"] == latest, "checkpoint holds the desired state", f"version {state['version']} != {latest}"
        )
        config = state["config"]
        expect(tuple(config.batch_size) == (self.cell.num_envs,), "checkpoint", f"config rows {config.batch_size}")
        for env, setting in enumerate(self.model.current):
            table = config[env]["table"]
            row = (float(config[env]["difficulty"]), float(config[env]["delay"]), float(table[0]), float(table[-1]))
            expect(
                abs(row[0] - setting.difficulty) < 1e-4
                and abs(row[1] - setting.delay) < 1e-6
                and all(abs(x - setting.table) < 1e-4 for x in row[2:]),
                "checkpoint holds the desired state",
                f"env {env}: (difficulty, delay, table's first and last) {row}, the model says {setting}",
            )
        if self.model.default_loc:
            pushed = TensorDict(state["env_state"]).flatten_keys(".").get(LOC_KEY, None)
            expect(
                pushed is not None and bool((pushed - self.model.default_loc).abs().max() < 1e-4),
                "checkpoint holds the desired state",
                f"env_state {LOC_KEY}: {pushed}, the model says {self.model.default_loc}",
            )

    def settle(self) -> None:
        """Every env comes to run its latest version within a bounded number of batches."""
        for _ in range(SETTLE_BATCHES):
            if all(self.frames.ran(e) == v for e, v in enumerate(self.model.current_version)):
                return
            self.collect()
        ran = [self.frames.ran(e) for e in range(self.cell.num_envs)]
        raise Violation("every env comes to run its latest version", f"ran {ran}, latest {self.model.current_version}")

    def teardown(self) -> None:
        try:
            if self.healthy:
                self.record("teardown", self.settle)
        finally:
            self.collector.shutdown()
            self.sender.close()
