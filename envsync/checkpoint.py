"""Checkpoints of a sender: what :meth:`Sender.state_dict` writes and how
:meth:`Sender.load_state_dict` restores it, before or after a collector is attached.

A checkpoint holds the version, the desired config of every env (one row per env when
attached; an unbatched worker drives one env), the pushed ``env_state`` (which includes
statistics computed in main or merged), each env's own pushed entries (``env_state_rows``:
pushed with ``workers=``/``envs=``, or computed in main for its own config), the
``sync_stats`` bookkeeping and, with ``gather=True``, every worker's own entries.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from tensordict import TensorDict, TensorDictBase

from envsync import desired
from envsync.books import StatsBook
from envsync.core import Core
from envsync.errors import ValidationError
from envsync.gather import read_settled
from envsync.levels import is_batched
from envsync.records import DesiredState
from envsync.state import ConfigTemplate, EnvStateTemplate, Leaf, flat_names, nest


class Push(Protocol):
    """The sender's push, as a restore uses it."""

    def __call__(
        self, config: Any = None, env_state: Any = None, *, workers: Any = None, envs: Any = None, wait: str | None
    ) -> int: ...


PushRows = Callable[[dict[int, dict[str, Leaf]]], int]
"""The sender's push of one config row per env (by fleet env index), not waited for."""


def state_dict(
    core: Core, template: Callable[[], EnvStateTemplate], *, gather: bool = False, timeout: float = 30.0
) -> dict[str, Any]:
    """A checkpoint of ``core``'s records (see :meth:`Sender.state_dict`); ``template`` gives
    the env-state template (asked for only with a collector attached)."""
    with core.lock:
        core.prune()
        indices = core.fleet.collected()  # an env outside any collector rejoins from the default
        default = core.desired.default
        rows = [nest(desired.section(core.mirror(e), "config"), copy=True) for e in indices]
        config = TensorDict.stack(rows) if rows else nest(desired.section(default, "config"), copy=True)
        env_state = {k: v.clone() for k, v in desired.pushed_env_state(default).items()}
        out: dict[str, Any] = {"version": core.desired.version, "config": config, "env_state": env_state}
        covers = template().covers if indices else {}
        own = [_own_entries(core.mirror(e), default, covers) for e in indices]
        if any(own):
            out["env_state_rows"] = own
        if not indices and core.desired.restored_rows is not None:  # a restored checkpoint no collector took yet
            _keep_restored_rows(core.desired, out)
        heads = [core.head(e) for e in indices]
        if not (gather and indices):
            _stats_of(core, out, indices, heads, held=False)
    if gather and indices:
        books = {False: core.books.of(False), True: core.books.of(True)}
        gathered, applied = read_settled(core, template(), None, indices, books, timeout)
        out["worker_env_state"] = gathered
        with core.lock:
            _stats_of(core, out, indices, heads, held=True, applied=applied[False], applied_whole=applied[True])
    return out


def _stats_of(
    core: Core,
    out: dict[str, Any],
    indices: list[int],
    heads: list[int],
    *,
    held: bool,
    applied: Mapping[int, int] | None = None,
    applied_whole: Mapping[int, int] | None = None,
) -> None:
    """The statistics books, each worker's baseline that of the env state the checkpoint
    gives it: what it holds (``held``: its gathered state, at the ``applied`` versions it was
    read at) or its desired state."""
    own, whole = core.books.of(False), core.books.of(True)
    if own is not None:
        applied = core.applied_versions(indices) if applied is None else applied
        out["stats"] = own.state_dict(indices, applied, held=held)
    if whole is not None:  # kept per env: each env's row is its worker's
        if applied_whole is None:
            applied_whole = core.applied_versions(sorted(set(heads)), whole=True)
        out["batched_stats"] = whole.state_dict(heads, applied_whole, held=held)


def _keep_restored_rows(state: DesiredState, out: dict[str, Any]) -> None:
    """The per-worker rows a loaded checkpoint holds for the next collector: saved again
    before that collector exists, they are not lost."""
    assert state.restored_rows is not None
    out["config"] = TensorDict.stack([nest(desired.section(r, "config")) for r in state.restored_rows])
    if state.unchecked_rows is not None:
        out["env_state_rows"] = [{k: v.clone() for k, v in r.items()} for r in state.unchecked_rows]


def _own_entries(
    mirror: Mapping[Any, Any], default: Mapping[Any, Any], covers: Mapping[str, Sequence[str]]
) -> dict[str, Any]:
    """The env-state entries pushed to one env that are not the default's (pushed with
    ``workers=``/``envs=``, or computed in main for its own config), less those a later push
    of the same statistics superseded (a ``sync_stats`` merge after a worker's own row)."""
    pushed = desired.pushed_env_state(mirror)

    def stamp(name: str) -> int:
        return int(mirror.get(("stamp", name), 0))

    stale: set[str] = set()
    for prefix, keys in covers.items():
        latest = max((stamp(k) for k in pushed if k.startswith(f"{prefix}.")), default=0)
        stale |= {k for k in keys if k in pushed and stamp(k) < latest}
    return {
        k: v.clone()
        for k, v in pushed.items()
        if k not in stale and default.get(("env_state", k)) is not mirror[("env_state", k)]
    }


def _own_rows(state: Mapping[str, Any], count: int) -> list[dict[str, Any]] | None:
    """Each env's own entries: those pushed to it alone, then what was gathered from it."""
    pushed = state.get("env_state_rows")
    gathered = state.get("worker_env_state")
    if pushed is None and gathered is None:
        return None
    rows = [dict(r) for r in pushed] if pushed is not None else [{} for _ in range(count)]
    if gathered is not None:
        read = [flat_names(r) for r in gathered.unbind(0)]
        if len(read) != len(rows):
            raise ValidationError(f"the checkpoint has {len(rows)} env state rows and {len(read)} gathered ones")
        for row, entries in zip(rows, read, strict=True):
            row.update(entries)
    return rows


def load_state_dict(
    core: Core, template: ConfigTemplate, push: Push, push_rows: PushRows, state: Mapping[str, Any]
) -> int:
    """Restore a checkpoint into ``core`` (see :meth:`Sender.load_state_dict`): kept for the
    next collector when none is attached, else pushed as new versions through ``push`` and
    ``push_rows``; returns the version now desired."""
    if "version" not in state or "config" not in state:
        raise ValidationError("a sender checkpoint has the keys 'version' and 'config'")
    config = state["config"]
    if not isinstance(config, TensorDictBase):
        config = TensorDict(config)
    rows = [template.fit(r) for r in ([config] if config.batch_dims == 0 else config.unbind(0))]
    env_state = state.get("env_state") or None
    own = _own_rows(state, len(rows))
    if own is not None and len(own) != len(rows):
        raise ValidationError(f"the checkpoint has {len(rows)} worker configs and {len(own)} worker env states")
    with core.lock:
        core.check_open()
        core.prune()
        indices = core.fleet.collected()
        if not indices and core.fleet.attachments:
            raise ValidationError(
                "load the checkpoint before attach_env: an env outside any collector joins from the "
                "restored desired state"
            )
        # what the running envs' statistics count from until they apply the checkpoint's
        before = _baselines(core, core.books.of(False), indices)
        before_whole = _baselines(core, core.books.of(True), indices, whole=True)
        if "stats" in state:
            own_stats = None if own is None else [any(k.startswith("stats.") for k in row) for row in own]
            core.books.put(False, StatsBook.from_state_dict(state["stats"], own_stats))
        if "batched_stats" in state:
            own_outer = None if own is None else [any(is_batched(k) and ".stats." in k for k in row) for row in own]
            core.books.put(True, StatsBook.from_state_dict(state["batched_stats"], own_outer))
        if not indices:
            return core.desired.keep_for_attach(int(state["version"]), rows, env_state, own)
        workers = len({core.fleet.worker_of(e) for e in indices})
    if len(rows) != len(indices) and (len(rows) != 1 or own is not None):
        what = "workers" if len(indices) == workers else "envs"
        raise ValidationError(
            f"the checkpoint has {len(rows)} {what[:-1]} configs; the collector has {len(indices)} {what}"
        )
    # the version at which each env (and each worker's batched env) holds the checkpoint's
    # statistics: its statistics book counts from there (the env runs on meanwhile)
    at: dict[int, int] = {}
    at_whole: dict[int, int] = {}
    if env_state:
        version = push(env_state=env_state, wait=None)
        at = dict.fromkeys(indices, version)
        at_whole = {core.head(index): version for index in indices}
    for index, entries in zip(indices, own or [{} for _ in indices], strict=True):
        mine = {k: v for k, v in entries.items() if not is_batched(k)}
        if mine:
            at[index] = push(env_state=mine, envs=[index], wait=None)
        whole = {k: v for k, v in entries.items() if is_batched(k)}
        if whole and core.head(index) == index:  # a batched env's own: its worker's
            at_whole[index] = push(env_state=whole, workers=[core.fleet.worker_of(index)], wait=None)
    own_book, whole_book = core.books.of(False), core.books.of(True)
    if "stats" in state and own_book is not None:
        own_book.loaded_into_running(at, indices, before)
    if "batched_stats" in state and whole_book is not None:
        heads = sorted({core.head(index) for index in indices})
        whole_book.loaded_into_running(at_whole, heads, before_whole)
    if len(rows) == 1:
        return push(config=rows[0], wait=None)
    return push_rows(dict(zip(indices, rows, strict=True)))


def _baselines(
    core: Core, book: StatsBook | None, indices: list[int], *, whole: bool = False
) -> dict[int, dict[str, Any]]:
    """What each running env (``whole``: each worker's batched env, by its first env) counts
    its statistics from by ``book`` (none without a book)."""
    if book is None or not indices:
        return {}
    targets = sorted({core.head(index) for index in indices}) if whole else indices
    return book.baselines(core.applied_versions(targets, whole=whole))
