"""Checkpoints of a sender, decided without moving a byte: records in, a checkpoint dict out
(:func:`state_dict`); a checkpoint in, a :class:`RestorePlan` out (:func:`plan_restore`),
validated whole before anything changes. :mod:`envsync.sender.restore` carries a plan out through
the sender's pushes; the sender gathers the workers' state for ``state_dict(gather=True)``.

A checkpoint holds the version, the desired config of every env (one row per env when
attached; an unbatched worker drives one env), the pushed ``env_state`` (which includes
statistics computed in main or merged), each env's own pushed entries (``env_state_rows``:
pushed with ``workers=``/``envs=``, or computed in main for its own config), the
``sync_stats`` bookkeeping and, with ``gather=True``, every worker's own entries.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from envsync.errors import ValidationError
from envsync.levels import is_batched
from envsync.sender import desired
from envsync.sender.books import StatsBook
from envsync.sender.core import Core
from envsync.sender.records import DesiredState
from envsync.state import ConfigTemplate, EnvStateTemplate, Leaf, flat_names, nest

Gathered = tuple[Any, dict[bool, dict[int, int]]]
"""Every collected env's state as :func:`envsync.sender.gather.read_settled` read it, and the applied
versions it was read at (per level: ``True`` is the batched envs' own)."""


def state_dict(
    core: Core, template: Callable[[], EnvStateTemplate], gathered: Gathered | None = None
) -> dict[str, Any]:
    """A checkpoint of ``core``'s records (see :meth:`Sender.state_dict`); ``template`` gives
    the env-state template (asked for only with a collector attached); ``gathered``: the
    workers' own state, read back (``state_dict(gather=True)``)."""
    with core.lock:
        core.prune()
        indices = core.fleet.collected()  # an env outside any collector rejoins from the default
        default = core.desired.default
        config = _configs(core, indices) if indices else nest(desired.section(default, "config"), copy=True)
        env_state = {k: v.clone() for k, v in desired.pushed_env_state(default).items()}
        out: dict[str, Any] = {"version": core.desired.version, "config": config, "env_state": env_state}
        covers = template().covers if indices else {}
        own = _own(core, indices, default, covers)
        if any(own):
            out["env_state_rows"] = own
        if not indices and core.desired.restored is not None:  # a restored checkpoint no collector took yet
            _keep_restored_rows(core.desired, out)
        heads = core.fleet.heads(np.asarray(indices, dtype=np.int64)).tolist()
        if gathered is None or not indices:
            _stats_of(core, out, indices, heads, held=False)
        else:
            out["worker_env_state"], applied = gathered
            _stats_of(core, out, indices, heads, held=True, applied=applied[False], applied_whole=applied[True])
    return out


def _configs(core: Core, indices: list[int]) -> TensorDict:
    """Every env's desired config of ``indices`` (collected, in fleet order), one row each:
    a ``TensorDict`` of batch ``len(indices)`` read as columns from each collector's mirror (a
    checkpoint of 65,536 worlds makes no object per world)."""
    targets = np.asarray(indices, dtype=np.int64)
    columns: dict[str, torch.Tensor] = {}
    for part in core.fleet.split(targets):
        mirror = part.attachment.mirror
        shared, rows = mirror.gather(part.slots, mirror.config_keys())
        at: Any = slice(None) if part.positions is None else torch.from_numpy(part.positions)
        values = {k: torch.as_tensor(v).expand(len(part.slots), *np.shape(v)) for k, v in shared.items()}
        for key, value in {**values, **rows}.items():
            if key[1] not in columns:
                columns[key[1]] = torch.empty((len(targets), *value.shape[1:]), dtype=value.dtype)
            columns[key[1]][at] = value
    return nest(columns, batch_size=[len(targets)])


def _own(
    core: Core, indices: list[int], default: Mapping[Any, Any], covers: Mapping[str, Sequence[str]]
) -> list[dict[str, Any]]:
    """:func:`_own_entries` of each env of ``indices``: looked at env by env only in a collector
    whose envs were pushed env state of their own (else every env of it has the first one's)."""
    out: list[dict[str, Any]] = [{} for _ in indices]
    for part in core.fleet.split(np.asarray(indices, dtype=np.int64)):
        mirror = part.attachment.mirror
        positions = range(len(part.slots)) if part.positions is None else part.positions.tolist()
        alike = mirror.uniform("env_state") and mirror.uniform("stamp")
        if alike and not _own_entries(mirror.row(int(part.slots[0])), default, covers):
            continue  # none of its envs has entries of its own: the common case, no walk
        for position, slot in zip(positions, part.slots.tolist(), strict=True):
            out[position] = _own_entries(mirror.row(slot), default, covers)
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
    columns = state.restored_columns("config")
    assert columns is not None
    out["config"] = nest(columns, batch_size=[state.restored_count])
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


@dataclass
class RestorePlan:
    """What loading a checkpoint does, decided and checked before anything changes.

    Args:
        version: the checkpoint's version.
        first: the first row's config (the only one when every env has the same config).
        columns: a checkpoint of many rows: its config as columns by dotted name, fitted to
            the template at once (65,536 rows are not split into 65,536 configs); ``None``
            for one row.
        count: how many rows the checkpoint has.
        env_state: the env state pushed to every env, if any.
        own: each env's own env-state entries (pushed to it alone, or gathered from it).
        books: the statistics books the checkpoint restores, per level (``True``: the
            batched envs' own).
        indices: the running envs it goes to, in fleet order; empty: kept for the next
            collector.
        before: per level, what each running env counts its statistics from until it
            applies the checkpoint's.
    """

    version: int
    first: dict[str, Leaf]
    columns: dict[str, torch.Tensor] | None
    count: int
    env_state: Any
    own: list[dict[str, Any]] | None
    books: dict[bool, StatsBook] = field(default_factory=dict)
    indices: list[int] = field(default_factory=list)
    before: dict[bool, dict[int, dict[str, Any]]] = field(default_factory=dict)


def plan_restore(core: Core, template: ConfigTemplate, state: Mapping[str, Any]) -> RestorePlan:
    """Read and check a checkpoint against the template and the fleet (call under the core's
    lock); nothing changes.

    Raises:
        ValidationError: not a checkpoint, a row that does not fit the template, a number of
            rows that is not the number of envs (naming both), or an env outside any
            collector attached before the load.
    """
    if "version" not in state or "config" not in state:
        raise ValidationError("a sender checkpoint has the keys 'version' and 'config'")
    config = state["config"]
    if not isinstance(config, TensorDictBase):
        config = TensorDict(config)
    count = 1 if config.batch_dims == 0 else int(config.batch_size[0])
    indices = core.fleet.collected()
    first = template.fit(config if config.batch_dims == 0 else config[0])
    columns = template.fit_rows(config, count)[1] if count > 1 else None  # every row checked at once
    own = _own_rows(state, count)
    if own is not None and len(own) != count:
        raise ValidationError(f"the checkpoint has {count} worker configs and {len(own)} worker env states")
    if not indices and core.fleet.attachments:
        raise ValidationError(
            "load the checkpoint before attach_env: an env outside any collector joins from the restored desired state"
        )
    if indices and count != len(indices) and (count != 1 or own is not None):
        workers = len({core.fleet.worker_of(e) for e in indices})
        what = "workers" if len(indices) == workers else "envs"
        raise ValidationError(
            f"the checkpoint has {count} {what[:-1]} configs; the collector has {len(indices)} {what}"
        )
    env_state = state.get("env_state") or None
    plan = RestorePlan(int(state["version"]), first, columns, count, env_state, own, indices=indices)
    if "stats" in state:
        own_stats = None if own is None else [any(k.startswith("stats.") for k in row) for row in own]
        plan.books[False] = StatsBook.from_state_dict(state["stats"], own_stats)
    if "batched_stats" in state:
        own_outer = None if own is None else [any(is_batched(k) and ".stats." in k for k in row) for row in own]
        plan.books[True] = StatsBook.from_state_dict(state["batched_stats"], own_outer)
    # what the running envs' statistics count from until they apply the checkpoint's
    plan.before = {whole: _baselines(core, core.books.of(whole), indices, whole=whole) for whole in plan.books}
    return plan


def _baselines(
    core: Core, book: StatsBook | None, indices: list[int], *, whole: bool = False
) -> dict[int, dict[str, Any]]:
    """What each running env (``whole``: each worker's batched env, by its first env) counts
    its statistics from by ``book`` (none without a book)."""
    if book is None or not indices:
        return {}
    targets = sorted({core.head(index) for index in indices}) if whole else indices
    return book.baselines(core.applied_versions(targets, whole=whole))
