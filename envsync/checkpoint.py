"""Checkpoints of a sender: what :meth:`Sender.state_dict` writes and how
:meth:`Sender.load_state_dict` restores it, before or after a collector is attached.

A checkpoint holds the version, the desired config of every env (one row per env when
attached; an unbatched worker drives one env), the pushed ``env_state`` (which includes
statistics computed in main or merged), each env's own pushed entries (``env_state_rows``:
pushed with ``workers=``/``envs=``, or computed in main for its own config), the
``sync_stats`` bookkeeping and, with ``gather=True``, every worker's own entries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tensordict import TensorDict, TensorDictBase

from envsync import desired, gather
from envsync.errors import AckTimeout, ValidationError
from envsync.gather import applied_versions, head
from envsync.levels import is_batched
from envsync.state import Leaf, flat_names, nest

if TYPE_CHECKING:
    from envsync.sender import Sender


def state_dict(sender: Sender, *, gather: bool = False) -> dict[str, Any]:
    """Implementation of :meth:`Sender.state_dict`."""
    with sender._lock:
        sender._prune()
        indices = sender._fleet.collected()  # an env outside any collector rejoins from the default
        rows = [sender.desired_config(env=e) for e in indices]
        config = TensorDict.stack(rows) if rows else sender.desired_config()
        env_state = {k: v.clone() for k, v in desired.pushed_env_state(sender._default).items()}
        out: dict[str, Any] = {"version": sender.version, "config": config, "env_state": env_state}
        covers = sender.env_state_template().covers if indices else {}
        own = [_own_entries(sender._mirror(e), sender._default, covers) for e in indices]
        if any(own):
            out["env_state_rows"] = own
        if not indices and sender._rows is not None:  # a restored checkpoint no collector took yet
            _keep_restored_rows(sender, out)
        heads = [head(sender, e) for e in indices]
        if not (gather and indices):
            _stats_of(sender, out, indices, heads, held=False)
    if gather and indices:
        out["worker_env_state"], applied, applied_whole = _gather_settled(sender, indices, heads)
        with sender._lock:
            _stats_of(sender, out, indices, heads, held=True, applied=applied, applied_whole=applied_whole)
    return out


def _stats_of(
    sender: Sender,
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
    if sender._stats is not None:
        applied = applied_versions(sender, indices) if applied is None else applied
        out["stats"] = sender._stats.state_dict(indices, applied, held=held)
    if sender._whole_stats is not None:  # kept per env: each env's row is its worker's
        if applied_whole is None:
            applied_whole = applied_versions(sender, sorted(set(heads)), whole=True)
        out["batched_stats"] = sender._whole_stats.state_dict(heads, applied_whole, held=held)


def _gather_settled(sender: Sender, indices: list[int], heads: list[int]) -> tuple[Any, dict[int, int], dict[int, int]]:
    """Every env's state, read while each env's applied version was known: gathered again
    while an env may have applied a pending merge as it answered (its baseline would be
    unknown)."""
    workers = sorted({sender._fleet.worker_of(e) for e in indices})
    unique_heads = sorted(set(heads))
    for _ in range(_MAX_GATHERS):
        before = applied_versions(sender, indices)
        before_whole = applied_versions(sender, unique_heads, whole=True)
        gathered = sender.gather(None, workers=workers)
        after = applied_versions(sender, indices)
        after_whole = applied_versions(sender, unique_heads, whole=True)
        unclear = sender._stats.unclear(before, after) if sender._stats is not None else []
        if sender._whole_stats is not None:
            unclear += sender._whole_stats.unclear(before_whole, after_whole)
        if not unclear:
            return gathered, after, after_whole
    raise AckTimeout(sender.version, unclear, dead=[], until="gathered")


_MAX_GATHERS = 5
"""Gathers a checkpoint tries before it gives up on envs that keep applying merges."""


def _keep_restored_rows(sender: Sender, out: dict[str, Any]) -> None:
    """The per-worker rows a loaded checkpoint holds for the next collector: saved again
    before that collector exists, they are not lost."""
    assert sender._rows is not None
    out["config"] = TensorDict.stack([nest(desired.section(r, "config")) for r in sender._rows])
    if sender._unchecked_rows is not None:
        out["env_state_rows"] = [{k: v.clone() for k, v in r.items()} for r in sender._unchecked_rows]


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


def load_state_dict(sender: Sender, state: Mapping[str, Any]) -> int:
    """Implementation of :meth:`Sender.load_state_dict`."""
    if "version" not in state or "config" not in state:
        raise ValidationError("a sender checkpoint has the keys 'version' and 'config'")
    config = state["config"]
    if not isinstance(config, TensorDictBase):
        config = TensorDict(config)
    rows = [sender.template.fit(r) for r in ([config] if config.batch_dims == 0 else config.unbind(0))]
    env_state = state.get("env_state") or None
    own = _own_rows(state, len(rows))
    if own is not None and len(own) != len(rows):
        raise ValidationError(f"the checkpoint has {len(rows)} worker configs and {len(own)} worker env states")
    with sender._lock:
        sender._check_open()
        sender._prune()
        indices = sender._fleet.collected()
        if not indices and sender._fleet.attachments:
            raise ValidationError(
                "load the checkpoint before attach_env: an env outside any collector joins from the "
                "restored desired state"
            )
        # what the running envs' statistics count from until they apply the checkpoint's
        before = _baselines(sender, sender._stats, indices)
        before_whole = _baselines(sender, sender._whole_stats, indices, whole=True)
        if "stats" in state:
            own_stats = None if own is None else [any(k.startswith("stats.") for k in row) for row in own]
            sender._stats = gather.StatsBook.from_state_dict(state["stats"], own_stats)
        if "batched_stats" in state:
            own_outer = None if own is None else [any(is_batched(k) and ".stats." in k for k in row) for row in own]
            sender._whole_stats = gather.StatsBook.from_state_dict(state["batched_stats"], own_outer)
        if not indices:
            return _keep_for_attach(sender, int(state["version"]), rows, env_state, own)
        workers = len({sender._fleet.worker_of(e) for e in indices})
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
        version = sender.push(env_state=env_state, wait=None)
        at = dict.fromkeys(indices, version)
        at_whole = {head(sender, index): version for index in indices}
    for index, entries in zip(indices, own or [{} for _ in indices], strict=True):
        mine = {k: v for k, v in entries.items() if not is_batched(k)}
        if mine:
            at[index] = sender.push(env_state=mine, envs=[index], wait=None)
        whole = {k: v for k, v in entries.items() if is_batched(k)}
        if whole and head(sender, index) == index:  # a batched env's own: its worker's
            at_whole[index] = sender.push(env_state=whole, workers=[sender._fleet.worker_of(index)], wait=None)
    if "stats" in state and sender._stats is not None:
        sender._stats.loaded_into_running(at, indices, before)
    if "batched_stats" in state and sender._whole_stats is not None:
        heads = sorted({head(sender, index) for index in indices})
        sender._whole_stats.loaded_into_running(at_whole, heads, before_whole)
    if len(rows) == 1:
        return sender.push(config=rows[0], wait=None)
    return sender._push_rows(dict(zip(indices, rows, strict=True)), by_env=True, wait=None, timeout=30.0)


def _baselines(
    sender: Sender, book: gather.StatsBook | None, indices: list[int], *, whole: bool = False
) -> dict[int, dict[str, Any]]:
    """What each running env (``whole``: each worker's batched env, by its first env) counts
    its statistics from by ``book`` (none without a book)."""
    if book is None or not indices:
        return {}
    targets = sorted({head(sender, index) for index in indices}) if whole else indices
    return book.baselines(applied_versions(sender, targets, whole=whole))


def _keep_for_attach(sender: Sender, version: int, rows: list[dict[str, Leaf]], env_state: Any, own: Any) -> int:
    """No collector yet: what the next one starts from (env state is checked at attach,
    when the env's keys are known)."""
    # a restore with workers' own env state is a version of its own (stamps > 0)
    sender._version = max(sender.version, version) + (own is not None)
    sender._set_default(desired.leaves(rows[0], {}, sender.version))
    per_worker = len(rows) > 1 or own is not None
    sender._rows = [desired.leaves(r, {}, sender.version) for r in rows] if per_worker else None
    sender._unchecked_env_state = env_state
    sender._unchecked_rows = own
    return sender.version
