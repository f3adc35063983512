"""The sender's mechanisms share one :class:`Core`: the records (:class:`~envsync.records.DesiredState`,
:class:`~envsync.records.Failures`), the statistics books, the fleet, the config history and
the lock that guards them all. Publishing a version (and rolling the latest push back) is
decided here, in one place; :mod:`envsync.acks`, :mod:`envsync.gather` and
:mod:`envsync.checkpoint` are functions of a ``Core`` and never see the
:class:`~envsync.sender.Sender`, which owns one and is the public front.

Lock order: take :attr:`Core.lock` before any link's slot lock; never block on an
acknowledgement while holding it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import torch

from envsync import desired
from envsync.books import StatsBooks
from envsync.desired import Undo
from envsync.errors import ValidationError
from envsync.fleet import Attachment, Fleet
from envsync.history import ConfigHistory
from envsync.links.base import BROADCAST, Flat, SenderLink
from envsync.protocol import broadcast_part
from envsync.records import DesiredState, Failures
from envsync.state import Leaf


class Core:
    """The records, books and fleet of one sender, and the lock that guards them.

    Args:
        config: the template's config leaves (version 0).

    Examples:
        >>> import torch
        >>> core = Core({"x": torch.tensor(0.0)})
        >>> core.desired.version, core.fleet.indices(), core.next_request()
        (0, [], 1)
    """

    def __init__(self, config: Mapping[str, Leaf], *, resets: bool = False) -> None:
        self.resets = resets  # versions apply at an env's next reset (apply_at="reset")
        self.desired = DesiredState(config)
        self.failures = Failures()
        self.books = StatsBooks()
        self.fleet = Fleet()
        self.history = ConfigHistory()
        self.lock = threading.RLock()
        self.closed = False
        self._requests = 0

    # ---- the fleet, kept current -------------------------------------------------------------

    def check_open(self) -> None:
        """Raise if the sender was closed."""
        if self.closed:
            raise ValidationError("this sender is closed")

    def prune(self) -> None:
        """Drop (and release) the attachments whose collector shut down."""
        for attachment in self.fleet.prune():
            release(attachment)

    def detach(self, attachment: Attachment) -> None:
        """Take an attachment out of the fleet and release it; idempotent."""
        if attachment in self.fleet.attachments:
            self.fleet.attachments.remove(attachment)
        release(attachment)

    def close(self) -> None:
        """Release every attachment; later calls that need the fleet raise."""
        self.closed = True
        attachments, self.fleet.attachments = self.fleet.attachments, []
        for attachment in attachments:
            release(attachment)

    def next_request(self) -> int:
        """A new gather request number."""
        self._requests += 1
        return self._requests

    def mirror(self, index: int) -> Flat:
        """The desired state last published to env ``index``."""
        attachment, slot = self.fleet.locate(index)
        return attachment.mirrors[slot]

    def applied(self, index: int) -> int:
        """The version env ``index`` runs now."""
        attachment, slot = self.fleet.locate(index)
        return attachment.link.status(slot).applied

    def head(self, index: int) -> int:
        """The first env of the worker that drives env ``index`` (where a batched env's own
        entries are asked for, and kept in the books)."""
        return self.fleet.envs_of(self.fleet.worker_of(index))[0]

    def applied_versions(self, targets: Sequence[int], *, whole: bool = False) -> dict[int, int]:
        """The version whose entries each of ``targets`` holds: its own level's (``reached``:
        an env under a batched level holds its own entries before, or without, that level);
        ``whole``: the oldest any env of its worker has applied (what a batched env's own
        state follows)."""
        out = {}
        for index in targets:
            if whole:
                out[index] = min(self.applied(env) for env in self.fleet.envs_of(self.fleet.worker_of(index)))
            else:
                attachment, slot = self.fleet.locate(index)
                out[index] = attachment.link.status(slot).reached
        return out

    # ---- publishing ----------------------------------------------------------------------------

    def publish(self, updates: Mapping[int, Flat], *, default: Flat | None, undo_mark: int = 0) -> int:
        """Write each env's update under a new version, then notify each (a link's slots
        first: rows of one env share a slot lock); ``default`` also changes what workers
        joining later start from. Then record what it replaced (the undo of this push), the
        mirrors and the config history."""
        state = self.desired
        version = state.version + 1
        located = {index: self.fleet.locate(index) for index in updates}
        groups: dict[int, tuple[Attachment, dict[int, Flat]]] = {}
        for index, (attachment, slot) in located.items():
            groups.setdefault(id(attachment), (attachment, {}))[1][slot] = updates[index]
        for attachment, group in groups.values():
            _write_group(attachment.link, version, group, undo_mark)
            attachment.link.flush(version)
        undo = Undo(version)
        if default is not None:
            undo.default = {k: state.default.get(k) for k in default}  # type: ignore[misc]
            state.set_default(default)
        # a mirror is never changed in place: envs that held one mirror and get one update
        # (a fleet-wide push) share the new mirror, its undo and its history entry
        made: dict[tuple[int, int], tuple[Flat, Flat, Flat]] = {}
        for index, (attachment, slot) in located.items():
            old, update = attachment.mirrors[slot], updates[index]
            pair = made.get((id(old), id(update)))
            if pair is None:  # the old mirror is kept in the pair: its id stays its own
                pair = made[id(old), id(update)] = ({**old, **update}, desired.replaced(old, update), old)
            attachment.mirrors[slot], undo.workers[index] = pair[0], pair[1]
        self.history.record(version, {i: a.mirrors[s] for i, (a, s) in located.items()}, self.applied)
        state.version = version
        state.undo = undo
        return version

    def roll_back(self, failed: int) -> int | None:
        """Publish, as a new version, what the failed latest push replaced; return it (``None``
        when ``failed`` is not the latest push). Envs that applied it put their own env state
        back (the undo mark). A rollback is not rolled back in turn."""
        state = self.desired
        undo = state.undo
        if undo is None or undo.version != failed or failed != state.version:
            return None
        live = set(self.fleet.indices())
        reload = torch.tensor(state.version + 1, dtype=torch.int64)
        updates = {w: desired.restamped(u, reload) for w, u in undo.workers.items() if w in live}
        version = self.publish(updates, default=undo.default, undo_mark=failed)
        state.undo = None
        return version


def release(attachment: Attachment) -> None:
    """End an attachment: its integration's clean-up, then its link."""
    attachment.on_close()
    attachment.link.close()


def _write_group(link: SenderLink, version: int, group: dict[int, Flat], undo_mark: int) -> None:
    """Write one link's slots (``group``: slot -> update) under ``version``, then notify
    each; what :func:`~envsync.protocol.broadcast_part` says all share is
    written once, to the broadcast region."""
    shared = broadcast_part(group, BROADCAST, link.num_workers, undo_mark)
    if shared:
        own = {w: {k: v for k, v in u.items() if k not in shared} for w, u in group.items()}
        link.broadcast(version, shared, own)
        link.notify(list(group))
        return
    for worker, update in group.items():
        link.write(worker, version, update, undo=undo_mark)
    link.notify(list(group))  # after every write: a worker woken early would wait on the slot lock its rows share
