"""The sender's mechanisms share one :class:`Core`: the records (:class:`~envsync.sender.records.DesiredState`,
:class:`~envsync.sender.records.Failures`), the statistics books, the fleet, the config history and
the lock that guards them all. Publishing a version (and rolling the latest push back) is
decided here, in one place; :mod:`envsync.sender.acks`, :mod:`envsync.sender.gather` and
:mod:`envsync.sender.checkpoint` are functions of a ``Core`` and never see the
:class:`~envsync.sender.sender.Sender`, which owns one and is the public front.

Lock order: take :attr:`Core.lock` before any link's slot lock; never block on an
acknowledgement while holding it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from envsync.errors import ValidationError
from envsync.links.base import Flat, Key, SenderLink
from envsync.sender import desired
from envsync.sender.books import StatsBooks
from envsync.sender.desired import Undo, Update
from envsync.sender.fleet import Attachment, Fleet
from envsync.sender.history import ConfigHistory
from envsync.sender.records import DesiredState, Failures
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
        self._unwoken: list[tuple[SenderLink, np.ndarray]] = []  # published, their loops not woken yet

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
        return attachment.mirror.row(slot)

    def applied(self, index: int) -> int:
        """The version env ``index`` runs now."""
        attachment, slot = self.fleet.locate(index)
        return attachment.link.status(slot).applied

    def applied_array(self, envs: np.ndarray) -> np.ndarray:
        """The version each of ``envs`` runs now, in one read per link (an index no live
        collector holds reads as the newest version there can be)."""
        out = np.full(len(envs), np.iinfo(np.int64).max, dtype=np.int64)
        for attachment in self.fleet.attachments:
            inside = (envs >= attachment.offset) & (envs < attachment.offset + attachment.link.num_workers)
            if inside.any():
                out[inside] = attachment.link.counts(envs[inside] - attachment.offset, applied=True)[1]
        return out

    def head(self, index: int) -> int:
        """The first env of the worker that drives env ``index`` (where a batched env's own
        entries are asked for, and kept in the books)."""
        attachment, slot = self.fleet.locate(index)
        per = attachment.envs_per_worker
        return attachment.offset + slot // per * per

    def applied_versions(self, targets: Sequence[int], *, whole: bool = False) -> dict[int, int]:
        """The version whose entries each of ``targets`` holds: its own level's (``reached``:
        an env under a batched level holds its own entries before, or without, that level);
        ``whole``: the oldest any env of its worker has applied (what a batched env's own
        state follows)."""
        out = {}
        for index in targets:
            attachment, slot = self.fleet.locate(index)
            if whole:  # its worker's envs, in one read of their counters
                per = attachment.envs_per_worker
                first = slot // per * per
                out[index] = int(attachment.link.counts(np.arange(first, first + per), applied=True)[1].min())
            else:
                out[index] = attachment.link.status(slot).reached
        return out

    # ---- publishing ----------------------------------------------------------------------------

    def record_history(
        self,
        version: int,
        attachment: Attachment,
        slots: np.ndarray,
        *,
        pruning: bool,
        pushed: Mapping[Key, torch.Tensor] | None = None,
    ) -> None:
        """Note in the config history that the envs ``slots`` of ``attachment`` run, from
        ``version`` on, the config its mirror holds for them now (``pruning``: the history may
        prune, reading what every env applied). ``pushed``: rows just written to the mirror
        at ``slots`` (the push's own copies, never written again), recorded as they are
        rather than copied out of the mirror a second time."""
        mirror = attachment.mirror
        keys = mirror.config_keys()
        fresh = {} if pushed is None else {k: pushed[k] for k in keys if k in pushed}
        shared, gathered = mirror.gather(slots, [k for k in keys if k not in fresh])
        columns = {k: fresh[k] if k in fresh else gathered[k] for k in keys if k not in shared}
        self.history.record_rows(
            version,
            slots + attachment.offset,
            {k[1]: v for k, v in shared.items()},
            {k[1]: v for k, v in columns.items()},
            self.applied_array if pruning else None,
        )

    def publish(self, updates: Sequence[Update], *, default: Flat | None, undo_mark: int = 0) -> int:
        """Write each update under a new version, to each attachment's slots at once;
        ``default`` also changes what workers joining later start from. What each replaced is
        kept (the undo of this push), the mirrors and the config history follow. The workers'
        loops are woken by :meth:`wake`, once the caller let go of the sender's lock."""
        state = self.desired
        version = state.version + 1
        undo = Undo(version)
        links: dict[int, SenderLink] = {}
        for update in updates:
            for part in self.fleet.split(update.targets):
                rows = update if part.positions is None else update.take(part.positions)
                attachment, slots = part.attachment, part.slots
                mirror = attachment.mirror
                undo.parts.append(Update(rows.targets, *mirror.gather(slots, rows.keys())))
                attachment.link.write_rows(slots, version, rows.shared, rows.rows, undo=undo_mark)
                mirror.set(slots, rows.shared, rows.rows)
                links[id(attachment.link)] = attachment.link
                self.record_history(version, attachment, slots, pruning=True, pushed=rows.rows)
                self.to_wake(attachment.link, slots)  # woken by wake(), once the push is whole
        for link in links.values():
            link.flush(version)
        if default is not None:
            undo.default = {k: state.default.get(k) for k in default}  # type: ignore[misc]
            state.set_default(default)
        state.version = version
        state.undo = undo
        return version

    def to_wake(self, link: SenderLink, slots: np.ndarray) -> None:
        """Have :meth:`wake` wake the loops of ``slots`` of ``link`` (a version or a request
        written to them: woken once the push is whole, since an apply run there may push)."""
        self._unwoken.append((link, slots))

    def wake(self, *, here: bool) -> None:
        """Wake the loops of what was published (or asked) and not woken yet, each loop once a
        link. Called with the sender's lock free: an in-process link runs the loop's turn in
        this thread when ``here`` (the caller waits for the workers, :meth:`SenderLink.notify`),
        and an apply run there holds only its env, never the sender. A link closed meanwhile
        (its collector shut down, the sender closed) has no loop left to wake."""
        with self.lock:
            notices, self._unwoken = self._unwoken, []
        for link, slots in notices:
            try:
                link.notify(slots, here=here)
            except RuntimeError:
                with self.lock:
                    if not self.closed and any(a.link is link for a in self.fleet.attachments):
                        raise

    def roll_back(self, failed: int) -> int | None:
        """Publish, as a new version, what the failed latest push replaced; return it (``None``
        when ``failed`` is not the latest push). Envs that applied it put their own env state
        back (the undo mark). A rollback is not rolled back in turn."""
        state = self.desired
        undo = state.undo
        if undo is None or undo.version != failed or failed != state.version:
            return None
        live = self.fleet.index_array()
        reload = torch.tensor(state.version + 1, dtype=torch.int64)
        updates = []
        for part in undo.parts:
            kept = np.isin(part.targets, live)
            if kept.any():
                updates.append(desired.restamped(part if kept.all() else part.take(np.flatnonzero(kept)), reload))
        version = self.publish(updates, default=undo.default, undo_mark=failed)
        state.undo = None
        self.wake(here=False)  # under the caller's lock: the loops' own threads apply it
        return version


def release(attachment: Attachment) -> None:
    """End an attachment: its integration's clean-up, then its link."""
    attachment.on_close()
    attachment.link.close()
