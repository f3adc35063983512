"""``gather`` and ``sync_stats``: which env-state entries a request names, asking the workers
through their links, waiting for their typed answers (a failure to answer raises
:class:`~envsync.errors.GatherError`, never a failed apply), and the one loop that reads
statistics while each env's applied version is known (:func:`read_settled`, used by
``sync_stats`` and checkpoints). Functions of a :class:`~envsync.sender.core.Core`; the bytes move
through the links, the books are :mod:`envsync.sender.books`."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from tensordict import TensorDict

from envsync import stats
from envsync.errors import AckTimeout, EnvSyncError, GatherError, ValidationError, WorkerApplyError
from envsync.indexing import Indices, take_rows
from envsync.levels import PREFIX, is_batched, selector_level
from envsync.protocol import ApplyAt, Kind, Request
from envsync.reinit import STATS, Selector
from envsync.sender.books import StatsBook
from envsync.sender.core import Core
from envsync.state import EnvStateTemplate, nest, state_name

_ANSWER_SLICE = 0.05
"""Longest blocking wait for an answer before the workers' liveness is checked again."""
_MAX_GATHERS = 5
"""Reads before giving up on envs that keep applying merges as they answer (an env applies
a pending merge at most once, so a second read is normally clear)."""


class Push(Protocol):
    """The sender's push, as ``sync_stats`` uses it."""

    def __call__(self, *, env_state: dict[str, torch.Tensor], wait: str, timeout: float) -> int: ...


def select(known: Sequence[str], requested: Sequence[str | tuple[str, ...]] | None) -> list[str]:
    """The entries of ``known`` that ``requested`` names: whole keys or dotted prefixes
    (``"transforms.0"``, ``"_extra_state"``), a tuple key as its parts joined; ``None``
    names every entry.

    Examples:
        >>> select(["transforms.0.loc", "transforms.0.scale", "transforms.1.loc"], ["transforms.0"])
        ['transforms.0.loc', 'transforms.0.scale']
        >>> select(["initialized", "_extra_state.loc.-|-.obs"], [("_extra_state", "loc.-|-.obs")])
        ['_extra_state.loc.-|-.obs']
    """
    if requested is None:
        return list(known)
    if isinstance(requested, str):
        requested = [requested]
    chosen: list[str] = []
    for entry in requested:
        want = state_name(entry) if isinstance(entry, tuple) else entry
        hits = [k for k in known if k == want or k.startswith(f"{want}.")]
        if not hits:
            raise ValidationError(f"env_state {want!r} names no entry of the env; known: {list(known)}")
        chosen += [k for k in hits if k not in chosen]
    return chosen


def gather(
    core: Core,
    template: EnvStateTemplate,
    env_state: Sequence[str | tuple[str, ...]] | None,
    workers: Sequence[int] | None,
    timeout: float,
    envs: Indices | None = None,
) -> TensorDict:
    """Read env-state entries back (see :meth:`Sender.gather`): one env's own entries from
    each targeted env, then a batched env's own (``batched.*``) once per worker, from its
    first env's slot (its group answers there), into the row of every targeted env of that
    worker. Columns all the way: the rows of a natively batched env answer in one reply.

    Raises:
        ValidationError: an entry the env does not have, or no collector attached.
        GatherError: a worker failed while answering (its traceback attached).
        AckTimeout: some workers did not answer in time, or died.
    """
    names = select(template.keys, env_state)
    own = [n for n in names if not is_batched(n)]
    whole = [n for n in names if is_batched(n)]
    targets = _targets(core, "gather", workers, envs)
    with core.lock:
        heads = core.fleet.heads(targets)
    read: Columns = {}
    if own:
        read.update(_entries(core, targets, Kind.ENV_STATE, own, timeout))
    if whole:
        distinct, inverse = np.unique(heads, return_inverse=True)
        replies = _entries(core, distinct, Kind.BATCHED_STATE, whole, timeout)
        read.update({name: take_rows(column, inverse.reshape(-1)) for name, column in replies.items()})
    return template.nest(read, len(targets)) if len(targets) else TensorDict()


def read_attributes(
    core: Core, paths: list[str], workers: Sequence[int] | None, envs: Indices | None, timeout: float
) -> TensorDict:
    """What each targeted env holds at attribute ``paths`` (see :meth:`Sender.read_attributes`):
    one row per env, a path's parts as nested keys."""
    targets = _targets(core, "read_attributes", workers, envs)
    columns = ask(core, targets, Kind.ATTRIBUTES, {"paths": paths}, timeout)
    if not len(targets):
        return TensorDict()
    return nest({p: columns[p] for p in paths}, batch_size=[len(targets)])


def _targets(core: Core, what: str, workers: Sequence[int] | None, envs: Indices | None) -> np.ndarray:
    with core.lock:
        core.check_open()
        core.prune()
        if not core.fleet.attachments:
            raise ValidationError(f"{what} needs an attached collector; none is attached")
        return core.fleet.target_array(workers, envs)


Columns = dict[str, torch.Tensor]
"""Per name, one row per env asked (in the order asked)."""


def _entries(core: Core, targets: np.ndarray, kind: Kind, names: list[str], timeout: float) -> Columns:
    """Each env's current values of env-state entries ``names``."""
    return ask(core, targets, kind, {"names": names}, timeout, expect=names)


def ask(
    core: Core,
    targets: np.ndarray,
    kind: Kind,
    payload: dict[str, Any],
    timeout: float,
    expect: Sequence[str] = (),
) -> Columns:
    """Send one request of ``kind`` to each of ``targets`` (env indices), wait for every
    reply, and return the results as columns (``expect``: names every reply must hold);
    the one wait loop of every request kind.

    Raises:
        GatherError: an env's worker failed to handle it (its traceback attached).
        AckTimeout: some envs did not reply in time, or died.
    """
    with core.lock:
        core.check_open()
        core.prune()
        request = Request(core.next_request(), kind, payload)
        parts = core.fleet.split(targets)
        for part in parts:
            part.attachment.link.send_request(part.slots, request)
            core.to_wake(part.attachment.link, part.slots)
    core.wake(here=True)  # each loop once, every request in, the lock let go (an in-process turn answers here)
    return _await_replies(core, targets, request.id, timeout, expect)


def _await_replies(core: Core, targets: np.ndarray, request: int, timeout: float, expect: Sequence[str]) -> Columns:
    """Wait until every env of ``targets`` replied to ``request``; raise the first failure.

    Each wake-up reads, link by link, the replies that came (one vector read of the
    counters, one read of a rows reply for all its rows); a pass after a slice that brought
    nothing checks the liveness of every pending env (a syscall per env, so not at every
    pass: 65,536 worlds answer one gather): a failure or a death is seen within two slices."""
    deadline = time.monotonic() + timeout
    got = np.zeros(len(targets), dtype=bool)
    position = _positions(targets)
    chunks: list[tuple[np.ndarray, Columns]] = []
    check_liveness = False
    attached: list[Any] = []
    while not got.all():
        with core.lock:
            core.prune()
            pending = targets[~got]
            dead = []
            if check_liveness or core.fleet.attachments != attached:  # a collector left: its envs are gone
                attached = list(core.fleet.attachments)
                live = np.isin(pending, core.fleet.index_array())
                dead = pending[~live].tolist()
                if check_liveness:  # once per process (or remote collector) of the pending envs
                    for part in core.fleet.split(pending[live]):
                        alive = part.attachment.link.alive_slots(part.slots)
                        dead += (part.slots[~alive] + part.attachment.offset).tolist()
            if dead:
                raise AckTimeout(request, pending.tolist(), dead=sorted(dead), until="gathered")
            came = 0
            link = None
            for part in core.fleet.split(pending):
                link = part.attachment.link
                for slots, reply in link.replies(part.slots, request):
                    envs = slots + part.attachment.offset
                    if reply.failed:
                        env = int(envs[0])
                        raise GatherError(core.fleet.worker_of(env), request, reply.error or "", env=env)
                    at = position(envs)
                    fresh = (targets[at] == envs) & ~got[at]
                    missing = [n for n in expect if n not in reply.result]
                    if missing:
                        raise EnvSyncError(f"env {int(envs[0])}'s reply lacks the entries {missing}")
                    chosen = np.flatnonzero(fresh)
                    values = reply.result if fresh.all() else {k: take_rows(v, chosen) for k, v in reply.result.items()}
                    chunks.append((at[fresh], values))
                    got[at[fresh]] = True
                    came += int(fresh.sum())
        if got.all():
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AckTimeout(request, targets[~got].tolist(), dead=[], until="gathered")
        assert link is not None
        check_liveness = not came and not link.wait_acks(min(_ANSWER_SLICE, remaining), applied=True)
    return _columns(chunks, len(targets))


def _positions(targets: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """Where each of some env indices sits among ``targets`` (distinct; an index not among
    them maps to a position whose target differs): arithmetic for a run of consecutive
    indices (a gather of every world), a binary search otherwise."""
    if not len(targets):
        return lambda envs: np.zeros(len(envs), dtype=np.int64)
    first, count = int(targets[0]), len(targets)
    if int(targets[-1]) - first + 1 == count and bool((np.diff(targets) == 1).all()):
        return lambda envs: (envs - first).clip(0, count - 1)
    sorter = np.argsort(targets, kind="stable")
    return lambda envs: sorter[np.searchsorted(targets, envs, sorter=sorter).clip(max=count - 1)]


def _columns(chunks: list[tuple[np.ndarray, Columns]], count: int) -> Columns:
    """The chunks' values as columns in the targets' order (``chunks``: the positions each
    chunk's rows belong to, and its values)."""
    if not chunks:
        return {}
    order = np.concatenate([at for at, _ in chunks])
    back = np.argsort(order, kind="stable")
    names = chunks[0][1].keys()
    if len(chunks) == 1 and np.array_equal(order, np.arange(count)):
        return dict(chunks[0][1])
    return {name: take_rows(torch.cat([values[name] for _, values in chunks]), back) for name in names}


def read_settled(
    core: Core,
    template: EnvStateTemplate,
    names: list[str] | None,
    envs: list[int],
    books: dict[bool, StatsBook | None],
    timeout: float,
) -> tuple[TensorDict, dict[bool, dict[int, int]]]:
    """Gather ``names`` from ``envs`` until each env was read while its applied version was
    known: an env may apply a book's pending merge while it answers, and its baseline would
    then be unknown, so it is read again. Returns the last read (rows in ``envs``' order)
    and, per level of ``books`` (``True``: the batched envs' own, keyed by each worker's
    first env), the applied versions it was read at."""
    levels = {whole: sorted({core.head(e) for e in envs}) if whole else list(envs) for whole in books}
    unclear: list[int] = []
    for _ in range(_MAX_GATHERS):
        before = {whole: core.applied_versions(keys, whole=whole) for whole, keys in levels.items()}
        gathered = gather(core, template, names, None, timeout, envs)
        after = {whole: core.applied_versions(keys, whole=whole) for whole, keys in levels.items()}
        unclear = [
            i for whole, book in books.items() if book is not None for i in book.unclear(before[whole], after[whole])
        ]
        if not unclear:
            return gathered, after
    raise AckTimeout(core.desired.version, unclear, dead=[], until="gathered")


def sync_stats(
    core: Core,
    template: EnvStateTemplate,
    selector: Selector,
    decays: dict[int, float],
    push: Push,
    apply_at: ApplyAt,
    timeout: float,
) -> int:
    """Merge the selected transforms' statistics across the fleet and push the merge (see
    :meth:`Sender.sync_stats`): for one sub-env's transforms, every env of the fleet takes
    part; for a batched env's own (``"batched.*"``), every worker, once. ``decays``: per
    selected transform index, its decay."""
    whole, _ = selector_level(selector)
    prefix = f"{PREFIX}{STATS}." if whole else f"{STATS}."

    def index_of(key: str) -> int:
        return int(key[len(prefix) :].split(".")[0])

    names = [k for k in template.keys if k.startswith(prefix) and index_of(k) in decays]
    if not names:
        raise ValidationError(f"sync_stats({selector!r}): no selected transform keeps statistics envsync can merge")
    aging = (f".{stats.UPDATES}", f".{stats.LIMIT}")  # what tells a forgetting transform's updates
    for index, decay in decays.items():
        counted = any(index_of(k) == index and k.endswith(aging) for k in names)
        if decay != 1.0 and not counted:
            raise ValidationError(
                f"sync_stats: transform {index} has decay={decay} but its handler tells neither its updates "
                f"nor its count's limit, so its statistics cannot be aged: export '{stats.UPDATES}' or "
                f"'{stats.LIMIT}' (see docs/statistics.md)"
            )
    by_prefix = {p: decays[index_of(p)] for p in {k.rsplit(".", 1)[0] for k in names}}
    with core.lock:
        book = core.books.book(whole, {k: template.flat[k] for k in names})
        targets = core.fleet.collected()  # envs outside any collector only receive merges
    if not targets:
        raise ValidationError("sync_stats merges what collectors' envs saw, and no collector is attached")
    if whole:
        targets = sorted({core.head(index) for index in targets})
    gathered, applied = read_settled(core, template, names, targets, {whole: book}, timeout)
    current = {w: {k: gathered[i].get(tuple(k.split("."))) for k in names} for i, w in enumerate(targets)}
    merged = book.round(current, applied[whole], by_prefix)
    # statistics are not an episode's config: in "reset" mode they wait for each env's next
    # reset like any version (a push waits until received); elsewhere they apply at once
    until = "received" if apply_at is ApplyAt.RESET else "applied"
    try:
        version = push(env_state=merged, wait=until, timeout=timeout)
    except WorkerApplyError:
        book.failed(core.desired.version, current)
        raise
    except AckTimeout:
        book.pushed(core.desired.version, merged, current)
        raise
    book.pushed(version, merged, current)
    return version
