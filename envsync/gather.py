"""``gather`` and ``sync_stats``: which env-state entries a request names, asking the workers
through their links and waiting for the answers, and, per worker, the statistics each was
last given (so a sync counts each observation once). The bytes move through the links."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

from envsync import stats
from envsync.errors import AckTimeout, ValidationError
from envsync.reinit import STATS, Selector
from envsync.state import state_name

if TYPE_CHECKING:
    from envsync.sender import Sender

_ACK_SLICE = 0.05


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


class StatsBook:
    """Per fleet index, the statistics each worker was last loaded with; and the latest merge.

    Args:
        start: the statistics a worker starts with before any sync (the template's).
    """

    def __init__(self, start: Mapping[str, torch.Tensor]) -> None:
        self.merged = {k: torch.zeros_like(v) for k, v in start.items()}  # nothing seen yet
        self._given: dict[int, dict[str, torch.Tensor]] = {}

    def round(
        self, current: Mapping[int, Mapping[str, torch.Tensor]], decay: Mapping[str, float]
    ) -> dict[str, torch.Tensor]:
        """Merge the workers' ``current`` statistics of the names in ``current`` (``decay``
        per moments prefix)."""
        names = sorted(next(iter(current.values())))
        base = {k: self.merged[k] for k in names}
        given = {w: {k: self._given[w][k] for k in names} for w in current if w in self._given}
        return stats.sync_round(base, given, current, decay)

    def record(self, merged: Mapping[str, torch.Tensor], workers: Sequence[int]) -> None:
        """``workers`` now hold ``merged`` (and so will workers that join later)."""
        self.merged.update(merged)
        for worker in workers:
            self._given.setdefault(worker, dict(self.merged)).update(merged)

    def state_dict(self, workers: Sequence[int]) -> dict[str, Any]:
        """The last merge, and what each of ``workers`` (fleet order) was given."""
        return {"merged": dict(self.merged), "given": [dict(self._given.get(w, self.merged)) for w in workers]}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> StatsBook:
        """Restore a book; rows of ``"given"`` become fleet indices 0, 1, ... (resume order)."""
        book = cls(state["merged"])
        book.merged = dict(state["merged"])
        book._given = {w: dict(given) for w, given in enumerate(state["given"])}
        return book


def gather(
    sender: Sender, env_state: Sequence[str | tuple[str, ...]] | None, workers: Sequence[int] | None, timeout: float
) -> TensorDict:
    """Implementation of :meth:`Sender.gather`."""
    if any(a.envs_per_worker > 1 for a in sender._fleet.attachments):
        raise ValidationError("gather and sync_stats do not reach the sub-envs of batched envs yet")
    template = sender.env_state_template()
    names = select(template.keys, env_state)
    with sender._lock:
        sender._check_open()
        sender._prune()
        if not sender._fleet.attachments:
            raise ValidationError("gather needs an attached collector; none is attached")
        targets = sender._fleet.targets(workers)
        sender._request += 1
        request = sender._request
        for index in targets:
            attachment, worker = sender._fleet.locate(index)
            attachment.link.ask(worker, request, names)
            attachment.link.notify(worker)
    _await_answers(sender, targets, request, timeout)
    rows = []
    for index in targets:
        attachment, worker = sender._fleet.locate(index)
        reply = attachment.link.read_reply(worker, names)
        rows.append(template.nest(reply))
    return TensorDict.stack(rows) if rows else TensorDict()


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


def sync_stats(sender: Sender, selector: Selector, timeout: float) -> int:
    """Implementation of :meth:`Sender.sync_stats`."""
    template = sender.env_state_template()
    decays = sender._probe_or_fail().stats_indices(sender.spec, selector)
    names = [k for k in template.keys if k.startswith(f"{STATS}.") and int(k.split(".")[1]) in decays]
    if not names:
        raise ValidationError(f"sync_stats({selector!r}): no selected transform keeps statistics envsync can merge")
    for index, decay in decays.items():
        counted = any(k.startswith(f"{STATS}.{index}.") and k.endswith(f".{stats.UPDATES}") for k in names)
        if decay != 1.0 and not counted:
            raise ValidationError(
                f"sync_stats: transform {index} has decay={decay} but does not count its updates, so its "
                "statistics cannot be aged: use decay=1.0 or VecNormV2 (see docs/statistics.md)"
            )
    prefixes = {k.rsplit(".", 1)[0] for k in names}
    by_prefix = {p: decays[int(p.split(".")[1])] for p in prefixes}
    gathered = gather(sender, names, None, timeout)
    targets = sender._fleet.targets(None)
    current = {w: {k: gathered[i].get(tuple(k.split("."))) for k in names} for i, w in enumerate(targets)}
    if sender._stats is None:
        sender._stats = StatsBook({k: template.flat[k] for k in names})
    merged = sender._stats.round(current, by_prefix)
    version = sender.push(env_state=merged, wait="applied", timeout=timeout)
    sender._stats.record(merged, targets)
    return version
