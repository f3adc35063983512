"""The reference model of the model-based test (``test_model.py``): what every env of the
fleet should run at every version, and the checks every collected frame must pass.

The model is plain Python, no envsync: a table ``version -> env -> Setting`` (the config and
env state an env runs under a version that reached it), each env's current version, and what
the latest push replaced (to know what a rollback restores). :class:`Frames` reads batches and
raises :class:`Violation` (an ``AssertionError`` naming the invariant) at the first frame that
breaks one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from helpers import rows
from tensordict import TensorDictBase

START = 0


@dataclass(frozen=True, order=True)
class Setting:
    """What one env runs: its config (``difficulty``, ``delay``, the value of every element of
    its ``table``) and the pushed ``loc``."""

    difficulty: float = 0.0
    delay: float = 0.0
    loc: float = 0.0
    table: float = 0.0


class Violation(AssertionError):
    """An invariant of the model does not hold; ``invariant`` names which."""

    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"[{invariant}] {detail}")
        self.invariant = invariant


def expect(condition: bool, invariant: str, detail: str) -> None:
    if not condition:
        raise Violation(invariant, detail)


@dataclass
class Model:
    """The desired state of ``num_envs`` envs, version by version."""

    num_envs: int
    table: dict[int, dict[int, frozenset[Setting]]] = field(default_factory=dict)
    current: list[Setting] = field(default_factory=list)
    current_version: list[int] = field(default_factory=list)
    default_loc: float = 0.0
    latest: int = START
    undo: tuple[int, dict[int, tuple[Setting, int]], float] | None = None
    rolled_back: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.current = [Setting()] * self.num_envs
        self.current_version = [START] * self.num_envs
        self.table[START] = {e: frozenset({Setting()}) for e in range(self.num_envs)}

    def publish(self, version: int, updates: Mapping[int, Setting], *, default_loc: float | None = None) -> None:
        """``version`` gives each env in ``updates`` its new setting (and, fleet-wide env
        state, a new ``loc`` to envs that join later)."""
        expect(version == self.latest + 1, "versions", f"version {version} published after {self.latest}")
        self.undo = (version, {e: (self.current[e], self.current_version[e]) for e in updates}, self.default_loc)
        self.table[version] = {e: frozenset({s}) for e, s in updates.items()}
        for env, setting in updates.items():
            self.current[env] = setting
            self.current_version[env] = version
        if default_loc is not None:
            self.default_loc = default_loc
        self.latest = version

    def roll_back(self, failed: int, rollback: int) -> None:
        """``rollback`` puts back what the failed version ``failed`` replaced."""
        expect(self.undo is not None and self.undo[0] == failed, "rollback", f"no undo for version {failed}")
        assert self.undo is not None
        _, replaced, default = self.undo
        self.publish(rollback, {e: setting for e, (setting, _) in replaced.items()})
        self.default_loc = default
        self.undo = None
        self.rolled_back.add(failed)

    def restart(self, version: int, intermediate: Iterable[int] = ()) -> None:
        """A resumed sender: every env runs its current setting at ``version``; each of the
        ``intermediate`` versions (a restore pushed piece by piece: the fleet-wide env state
        first, then each env's own, then the config rows) may show any mix of the fresh start,
        the restored fleet-wide ``loc`` and the restored setting."""
        self.table.clear()  # the new sender's versions name nothing of the old one's
        self.rolled_back.clear()
        for v in intermediate:
            self.table[v] = {e: frozenset(_mixes(s, self.default_loc)) for e, s in enumerate(self.current)}
        self.table[version] = {e: frozenset({s}) for e, s in enumerate(self.current)}
        self.current_version = [version] * self.num_envs
        self.latest = version
        self.undo = None

    def settings(self, version: int, env: int) -> frozenset[Setting]:
        """What env ``env`` may show under ``version``."""
        reached = self.table.get(version, {})
        expect(env in reached, "tags name a version", f"env {env} tagged with version {version}, which never reached")
        return reached[env]


def _mixes(restored: Setting, default_loc: float) -> set[Setting]:
    fresh = Setting()
    return {
        Setting(d, dl, lc, tb)
        for d in {fresh.difficulty, restored.difficulty}
        for dl in {fresh.delay, restored.delay}
        for lc in {fresh.loc, default_loc, restored.loc}
        for tb in {fresh.table, restored.table}
    }


def _near(a: float, b: float) -> bool:
    return abs(a - b) < 1e-3


@dataclass
class Frames:
    """Every frame's checks, and what later checks need (floors, counts, trajectories).

    Args:
        model: the reference model.
        reset_mode: check that no trajectory mixes two versions.
        stale_allowance: frames per env that may still run an older version after a
            ``wait="applied"`` returned (a ``MultiAsyncCollector``'s queued and running
            rollouts); 0 when the workers are idle between batches.
    """

    model: Model
    reset_mode: bool
    stale_allowance: int
    with_loc: bool
    generation: int = 0
    floors: dict[int, int] = field(default_factory=dict)
    stale_seen: Counter[int] = field(default_factory=Counter)
    last_version: dict[int, int] = field(default_factory=dict)
    trajectories: dict[tuple[int, int, int], int] = field(default_factory=dict)
    steps: int = 0
    steps_this_generation: int = 0
    dones: int = 0
    batches: int = 0

    def new_generation(self) -> None:
        """A new collector (resume): its trajectories and versions start afresh."""
        self.generation += 1
        self.floors.clear()
        self.last_version.clear()
        self.steps_this_generation = 0

    def raise_floor(self, envs: Iterable[int], version: int) -> None:
        """``wait="applied"`` returned for ``version`` on ``envs``."""
        for env in envs:
            if version > self.floors.get(env, -1):
                self.floors[env] = version
                self.stale_seen[env] = 0

    def check(self, batch: TensorDictBase) -> None:
        self.batches += 1
        for row in rows(batch):
            self._check_stream(row)

    def _check_stream(self, row: TensorDictBase) -> None:
        env = int(row["env_index"][0])
        for key in ("env_index", ("next", "env_index")):
            indices = row[key].reshape(-1).tolist()
            expect(set(indices) == {env}, "env_index", f"one stream carries env indices {sorted(set(indices))}")
        for obs_key in ("observation", ("next", "observation")):
            labels = row[obs_key][:, 1].tolist()
            expect(all(_near(x, env) for x in labels), "env_index", f"env_index {env} on frames of envs {labels}")
        root, nxt = row["env_version"].reshape(-1).tolist(), row["next", "env_version"].reshape(-1).tolist()
        done = row["next", "done"].reshape(-1).tolist()
        for t, (vr, vn) in enumerate(zip(root, nxt, strict=True)):
            self._check_obs(row, t, env, vr, "observation")
            self._check_obs(row, t, env, vn, ("next", "observation"))
            previous = self.last_version.get(env)
            if previous is not None:
                ok = vr >= previous if (t == 0 or done[t - 1]) else vr == previous
                expect(ok, "root tag follows next", f"env {env}: root version {vr} after next version {previous}")
            expect(vn >= vr, "versions never go back", f"env {env}: step from version {vr} to {vn}")
            self.last_version[env] = vn
            self._check_floor(env, vn)
            if self.reset_mode:
                self._check_trajectory(env, int(row["collector", "traj_ids"].reshape(-1)[t]), {vr, vn})
        self.steps += len(nxt)
        self.steps_this_generation += len(nxt)
        self.dones += sum(done)

    def _check_obs(self, row: TensorDictBase, t: int, env: int, version: int, obs_key: str | tuple[str, ...]) -> None:
        allowed = self.model.settings(version, env)
        difficulty = float(row[obs_key][t, 0])
        table = float(row[obs_key][t, 3])
        shown = [s for s in allowed if _near(s.difficulty, difficulty) and _near(s.table, table)]
        where = f"env {env}, version {version}, {obs_key!r} frame {t}"
        detail = f"{where}: difficulty {difficulty}, table {table}, the model says {sorted(allowed)}"
        expect(bool(shown), "tags are truthful", detail)
        if self.with_loc:
            key = "observation_shifted" if obs_key == "observation" else ("next", "observation_shifted")
            locs = (row[key][t] - row[obs_key][t]).tolist()
            expect(
                any(all(_near(x, s.loc) for x in locs) for s in shown),
                "env state is truthful",
                f"{where}: loc {locs}, the model says {sorted(shown)}",
            )

    def _check_floor(self, env: int, version: int) -> None:
        floor = self.floors.get(env)
        if floor is None or version >= floor:
            if floor is not None:
                self.stale_seen[env] = self.stale_allowance + 1  # no older frame may follow
            return
        self.stale_seen[env] += 1
        expect(
            self.stale_seen[env] <= self.stale_allowance,
            "after wait='applied' later frames run it",
            f"env {env} ran version {version} after wait('applied') for version {floor} returned",
        )

    def _check_trajectory(self, env: int, traj: int, versions: set[int]) -> None:
        key = (self.generation, env, traj)
        for version in versions:
            first = self.trajectories.setdefault(key, version)
            expect(first == version, "no trajectory mixes versions", f"env {env} trajectory {traj}: {first}, {version}")

    def ran(self, env: int) -> int | None:
        """The version of env ``env``'s latest collected frame in this generation."""
        return self.last_version.get(env)
