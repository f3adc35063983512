"""``gather`` and ``sync_stats``: which env-state entries a request names, asking the workers
through their links and waiting for the answers, and, per worker, the statistics each was
last given (so a sync counts each observation once). The bytes move through the links."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

from envsync import stats
from envsync.errors import AckTimeout, ValidationError, WorkerApplyError
from envsync.levels import PREFIX, is_batched, selector_level
from envsync.protocol import ApplyAt
from envsync.reinit import STATS, Selector
from envsync.state import state_name

if TYPE_CHECKING:
    from envsync.sender import Sender

_ACK_SLICE = 0.05
_MAX_GATHERS = 3  # a worker applies a pending merge at most once: a second read is clear


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


@dataclass
class Pending:
    """The latest merge pushed: its version, the statistics, and what each worker held when
    it was gathered (a worker's baseline until it applies the merge). A checkpoint loaded
    into running workers gives each its baseline (``after``, default ``merged``) at a version
    of its own (``at``, default ``version``)."""

    version: int
    merged: dict[str, torch.Tensor]
    gathered: dict[int, dict[str, torch.Tensor]]
    after: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    at: dict[int, int] = field(default_factory=dict)

    def brings(self, worker: int) -> int:
        """The version whose apply makes ``worker``'s baseline :meth:`baseline_after`."""
        return self.at.get(worker, self.version)

    def baseline_after(self, worker: int) -> dict[str, torch.Tensor]:
        return self.after.get(worker, self.merged)


class StatsBook:
    """Per fleet index, the statistics a worker's own are counted up to (its *baseline*); the
    latest merge; and the merge pushed last, until every worker's status tells whether it
    applied it (a push may time out, fail, or wait for each env's reset).

    Args:
        start: the statistics a worker starts with before any sync (the template's).
    """

    def __init__(self, start: Mapping[str, torch.Tensor]) -> None:
        self.merged = {k: torch.zeros_like(v) for k, v in start.items()}  # nothing seen yet
        self._given: dict[int, dict[str, torch.Tensor]] = {}
        self.pending: Pending | None = None
        self._published = False  # whether a merge was ever pushed (a rollback republishes it)

    def unclear(self, before: Mapping[int, int], after: Mapping[int, int]) -> list[int]:
        """The workers that may have applied the pending merge while they answered a gather
        (their applied version crossed it between the two reads): gather them again."""
        p = self.pending
        return [] if p is None else [w for w in p.gathered if before.get(w, 0) < p.brings(w) <= after.get(w, 0)]

    def baselines(self, applied: Mapping[int, int]) -> dict[int, dict[str, torch.Tensor]]:
        """What each worker's statistics are counted up to, given its ``applied`` version: a
        worker that applied the pending merge holds it plus what it saw since; one that did
        not (yet: in "reset" mode it may still, until a newer merge supersedes it) still
        holds its own, as gathered for that merge."""
        given = dict(self._given)
        p = self.pending
        if p is not None:
            for worker, own in p.gathered.items():
                if worker in applied:
                    given[worker] = p.baseline_after(worker) if applied[worker] >= p.brings(worker) else own
        return given

    def round(
        self,
        current: Mapping[int, Mapping[str, torch.Tensor]],
        applied: Mapping[int, int],
        decay: Mapping[str, float],
    ) -> dict[str, torch.Tensor]:
        """Merge the workers' ``current`` statistics of the names in ``current`` (``decay``
        per moments prefix), each counted from its baseline (see :meth:`baselines`)."""
        names = sorted(next(iter(current.values())))
        base = {k: self.merged[k] for k in names}
        baselines = self.baselines(applied)
        given = {w: {k: baselines[w][k] for k in names} for w in current if w in baselines}
        return stats.sync_round(base, given, current, decay)

    def pushed(self, version: int, merged: Mapping[str, torch.Tensor], current: Mapping[int, dict]) -> None:
        """``merged`` went out as ``version`` (applied or not yet; a worker joining later
        starts from it, and it supersedes the merge pending before); ``current`` is what
        each worker held when gathered."""
        self.merged.update(merged)
        self.pending = Pending(version, dict(self.merged), {w: dict(v) for w, v in current.items()})
        self._published = True

    def failed(self, rollback: int, current: Mapping[int, dict]) -> None:
        """A merge failed on some worker and was rolled back by version ``rollback``: it
        gives every worker the previous merge again, or, with none pushed before, each
        worker keeps (or gets back) its own statistics."""
        if self._published:
            self.pending = Pending(rollback, dict(self.merged), {w: dict(v) for w, v in current.items()})
        else:
            self._given.update({w: dict(v) for w, v in current.items()})

    def state_dict(self, workers: Sequence[int], applied: Mapping[int, int], *, held: bool) -> dict[str, Any]:
        """The last merge, and each of ``workers``' baseline (fleet order): with ``held``, of
        what it holds at its ``applied`` version (its statistics were gathered then); else of
        its desired state, what it holds once it applies what it was pushed (a resumed worker
        starts from the checkpointed state)."""
        given = self.baselines(applied)
        p = self.pending
        if not held and p is not None:
            given.update({w: p.baseline_after(w) for w in p.gathered if w in applied})
        return {"merged": dict(self.merged), "given": [dict(given.get(w, self.merged)) for w in workers]}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], own: Sequence[bool] | None = None) -> StatsBook:
        """Restore a book; rows of ``"given"`` become fleet indices 0, 1, ... (resume order).

        ``own[w]``: whether worker ``w`` resumes from its own checkpointed statistics (a
        ``state_dict(gather=True)`` row), which its checkpointed baseline describes; a worker
        that resumes without them starts from the last merge, its baseline from now on."""
        book = cls(state["merged"])
        book.merged = dict(state["merged"])
        book._given = {
            w: dict(given) if own is not None and w < len(own) and own[w] else dict(book.merged)
            for w, given in enumerate(state["given"])
        }
        return book

    def loaded_into_running(
        self, at: Mapping[int, int], order: Sequence[int], before: Mapping[int, Mapping[str, torch.Tensor]]
    ) -> None:
        """The book was restored into workers already running (the collector was built
        before the checkpoint was loaded): the checkpoint's row ``i`` is fleet index
        ``order[i]``, which holds that row's baseline once it applies version ``at[index]``;
        until then it holds what it saw since ``before[index]`` (the book the load replaced;
        the template's empty statistics without one). An index missing from ``at`` got nothing."""
        empty = {k: torch.zeros_like(v) for k, v in self.merged.items()}

        def prior(index: int) -> dict[str, torch.Tensor]:
            held = before.get(index)
            return dict(held) if held is not None and held.keys() == empty.keys() else dict(empty)

        rows = dict(zip(order, self._given.values(), strict=False))
        self._given = {}
        self.pending = Pending(
            max(at.values(), default=0),
            dict(self.merged),
            {index: prior(index) for index in order},
            after={index: rows[index] for index in at if index in rows},
            at={index: at.get(index, 1 << 62) for index in order},
        )


def gather(
    sender: Sender,
    env_state: Sequence[str | tuple[str, ...]] | None,
    workers: Sequence[int] | None,
    timeout: float,
    envs: Sequence[int] | None = None,
) -> TensorDict:
    """Implementation of :meth:`Sender.gather`: one env's own entries from each targeted env,
    then a batched env's own (``batched.*``) once per worker, from its first env's slot (its
    group answers there), into the row of every targeted env of that worker."""
    template = sender.env_state_template()
    names = select(template.keys, env_state)
    own = [n for n in names if not is_batched(n)]
    whole = [n for n in names if is_batched(n)]
    with sender._lock:
        sender._check_open()
        sender._prune()
        if not sender._fleet.attachments:
            raise ValidationError("gather needs an attached collector; none is attached")
        targets = sender._fleet.targets(workers, envs)
        heads = {index: head(sender, index) for index in targets}
    read: dict[int, dict[str, torch.Tensor]] = {index: {} for index in targets}
    if own:
        for index, reply in _ask(sender, targets, own, timeout).items():
            read[index].update(reply)
    if whole:
        replies = _ask(sender, sorted(set(heads.values())), whole, timeout)
        for index in targets:
            read[index].update(replies[heads[index]])
    rows = [template.nest(read[index]) for index in targets]
    return TensorDict.stack(rows) if rows else TensorDict()


def head(sender: Sender, index: int) -> int:
    """The first env of the worker that drives env ``index`` (where a batched env's own
    entries are asked for, and kept in the books)."""
    return sender._fleet.envs_of(sender._fleet.worker_of(index))[0]


def _ask(sender: Sender, targets: list[int], names: list[str], timeout: float) -> dict[int, dict[str, torch.Tensor]]:
    """Ask each of ``targets`` (env indices) for ``names``; wait; return copies of the answers."""
    with sender._lock:
        sender._check_open()
        sender._prune()
        sender._request += 1
        request = sender._request
        for index in targets:
            attachment, worker = sender._fleet.locate(index)
            attachment.link.ask(worker, request, names)
            attachment.link.notify(worker)
    _await_answers(sender, targets, request, timeout)
    out = {}
    for index in targets:
        attachment, worker = sender._fleet.locate(index)
        out[index] = attachment.link.read_reply(worker, names)
    return out


def _alive(sender: Sender, index: int) -> bool:
    attachment, slot = sender._fleet.locate(index)
    return attachment.link.alive(slot)


def _await_answers(sender: Sender, targets: list[int], request: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(targets)
    while True:
        with sender._lock:
            sender._prune()
            live = set(sender._fleet.indices())
            dead = [w for w in pending if w not in live or not _alive(sender, w)]
            if dead:
                raise AckTimeout(request, pending, dead=dead, until="gathered")
            pending = [w for w in pending if _answered(sender, w) < request]
            if not pending:
                return
            link = sender._fleet.locate(pending[0])[0].link
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AckTimeout(request, pending, dead=[], until="gathered")
        link.wait_acks(min(_ACK_SLICE, remaining), applied=True)


def _answered(sender: Sender, index: int) -> int:
    attachment, worker = sender._fleet.locate(index)
    return attachment.link.answered(worker)


def applied_versions(sender: Sender, targets: Sequence[int], *, whole: bool = False) -> dict[int, int]:
    """The version each of ``targets`` (fleet env indices) has applied; ``whole``: the
    oldest any env of its worker has applied (what a batched env's own state follows)."""
    out = {}
    for index in targets:
        envs = sender._fleet.envs_of(sender._fleet.worker_of(index)) if whole else [index]
        versions = []
        for env in envs:
            attachment, slot = sender._fleet.locate(env)
            versions.append(attachment.link.status(slot).applied)
        out[index] = min(versions)
    return out


def sync_stats(sender: Sender, selector: Selector, timeout: float) -> int:
    """Implementation of :meth:`Sender.sync_stats`: for one sub-env's transforms, every env
    of the fleet takes part; for a batched env's own (``"batched.*"``), every worker, once."""
    whole, _ = selector_level(selector)
    template = sender.env_state_template()
    decays = sender._probe_or_fail().stats_indices(sender.spec, selector)
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
    book = sender._stats_book(whole, {k: template.flat[k] for k in names})
    current, applied = _gather_settled(sender, book, names, timeout, whole)
    merged = book.round(current, applied, by_prefix)
    # statistics are not an episode's config: in "reset" mode they wait for each env's next
    # reset like any version (a push waits until received); elsewhere they apply at once
    until = "received" if sender.spec.apply_at is ApplyAt.RESET else "applied"
    try:
        version = sender.push(env_state=merged, wait=until, timeout=timeout)
    except WorkerApplyError:
        book.failed(sender.version, current)
        raise
    except AckTimeout:
        book.pushed(sender.version, merged, current)
        raise
    book.pushed(version, merged, current)
    return version


def _gather_settled(
    sender: Sender, book: StatsBook, names: list[str], timeout: float, whole: bool
) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, int]]:
    """Every env's (``whole``: every worker's, by its first env) current statistics, each
    read while its applied version was known (before and after the read agree on the
    pending merge); and those versions. Envs outside any collector (``attach_env``) only
    receive merges: they are not read."""
    targets = sender._fleet.collected()
    if not targets:
        raise ValidationError("sync_stats merges what collectors' envs saw, and no collector is attached")
    if whole:
        targets = sorted({head(sender, index) for index in targets})
    current: dict[int, dict[str, torch.Tensor]] = {}
    ask = list(targets)
    for _ in range(_MAX_GATHERS):
        before = applied_versions(sender, ask, whole=whole)
        gathered = gather(sender, names, None, timeout, envs=ask)
        after = applied_versions(sender, ask, whole=whole)
        for i, w in enumerate(ask):
            current[w] = {k: gathered[i].get(tuple(k.split("."))) for k in names}
        ask = book.unclear(before, after)
        if not ask:
            return current, applied_versions(sender, targets, whole=whole) | after
    raise AckTimeout(sender.version, ask, dead=[], until="gathered")
