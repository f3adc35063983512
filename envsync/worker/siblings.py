"""The envs under one batched env, as the process that drives it sees them on the link.

A batched env's sub-envs (or a natively batched env's rows) each have a receiver and an end
of their own; the batched env's group (:mod:`envsync.integrations.torchrl.group`) needs a
view over all of them at once: what each was published, reached, failed, and ran its last
step and observation under (for the tags and the fast path), which of them wait for a version
or a reply, and a way to acknowledge receipt for them, wake their own loops and fail what
they wait for. :class:`Siblings` is that view, so the integration never holds a link end; it
also makes the batched level's end, the gate over the same ends (:mod:`envsync.worker.gate`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from envsync.links.base import End, LinkHandle
from envsync.worker import loop
from envsync.worker.gate import GateEnd
from envsync.worker.loop import Member

VERSIONS = ("target", "reached", "failed", "ran", "obs")
"""Per env: its latest target; the version it reached (applied; its batched level, if any,
acknowledges it *applied*); its latest failure; the version its latest step ran under; the
one its observation comes from."""


class Ends(Sequence[End]):
    """The ends of ``count`` envs from link slot ``first`` on, each opened when first asked
    for (a natively batched env of thousands of worlds opens the few it touches)."""

    def __init__(self, handle: LinkHandle, first: int, count: int) -> None:
        self._handle = handle
        self._first = first
        self._count = count
        self._opened: dict[int, End] = {}

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> End:  # type: ignore[override]
        if not -self._count <= index < self._count:
            raise IndexError(index)
        index %= self._count
        end = self._opened.get(index)
        if end is None:
            end = self._opened[index] = self._handle.open(self._first + index, claim=False)
        return end


class Siblings:
    """The ends of the ``count`` envs of one batched env, from link slot ``first_slot`` on.

    Args:
        handle: the link.
        first_slot: the link slot of env 0 (the others follow).
        count: how many envs.

    Examples:
        >>> from envsync.links.local import LocalLink
        >>> import torch
        >>> link = LocalLink({("config", "level"): torch.tensor(0)}, 2)
        >>> envs = Siblings(link.handle(), 0, 2)
        >>> link.write(1, 1, {("config", "level"): torch.tensor(3)})
        >>> envs.pending().tolist()
        [1]
        >>> link.close()
    """

    def __init__(self, handle: LinkHandle, first_slot: int, count: int, *, rows: bool = False) -> None:
        self._ends = Ends(handle, first_slot, count)
        self._first = self._ends[0]
        self.count = count
        # the rows of a native env: acknowledged as columns, and they share one wake-up
        self._rows = handle.open_rows(first_slot, count, claim=False) if rows else None
        self._noticed = np.zeros(count, dtype=np.int64)  # the targets acknowledged as received
        self.gate = GateEnd(self._ends, self._rows)
        """The batched level's end over these envs (its receiver's, if it has one)."""

    def targets(self) -> np.ndarray:
        """Every env's latest target, a read-only view to compare at once (to tell whether a
        push came)."""
        (targets,) = self._first.read_counters(("target",), self.count, copy=False)
        return targets

    def pushed(self) -> int:
        """The latest version written to any slot of the link (one integer read)."""
        return self._first.pushed()

    def versions(self) -> tuple[np.ndarray, ...]:
        """Copies of :data:`VERSIONS`, per env, read one after the other."""
        return self._first.read_counters(VERSIONS, self.count)

    def pending(self) -> np.ndarray:
        """The envs with a version published that they neither reached nor failed (int64,
        ascending: a natively batched env's rows stay an array all the way to their apply)."""
        t, a, f = self._first.read_counters(("target", "reached", "failed"), self.count, copy=False)
        return np.flatnonzero((t != a) & (t != f))

    def notice(self) -> None:
        """Acknowledge receipt of every target that changed since the last notice."""
        (live,) = self._first.read_counters(("target",), self.count, copy=False)
        changed = np.flatnonzero(live != self._noticed)
        targets = live[changed]  # read once: what is acknowledged is what is noted
        if self._rows is not None:
            self._rows.ack_received(changed, targets)
        else:
            for i, target in zip(changed.tolist(), targets.tolist(), strict=True):
                self._ends[i].ack_received(target)
        self._noticed[changed] = targets

    def asked(self) -> np.ndarray:
        """The envs with a request not answered yet, as an int64 array (one vector read,
        whatever their number; the rows of a native env: one integer read while no request
        came since they last had none)."""
        if self._rows is not None:
            return self._rows.asked()[0]
        ask, answered = self._first.read_counters(("ask", "answered"), self.count, copy=False)
        return np.flatnonzero((ask != 0) & (ask != answered))

    def unsettled(self, *, pending: bool) -> np.ndarray:
        """A mask of the envs whose safe point has something to do: a target not yet
        acknowledged as received, a version reached that its step or observation was not
        noted under yet, and (``pending``) a version neither reached nor failed. The others'
        safe points would change nothing: a batched env walks only these (one vector read)."""
        t, received, reached, failed, ran, obs = self._first.read_counters(
            ("target", "received", "reached", "failed", "ran", "obs"), self.count, copy=False
        )
        mask = (t != received) | (ran != reached) | (obs != reached)
        if pending:
            mask |= (t != reached) & (t != failed)
        return mask

    def poke(self, indices: Sequence[int]) -> None:
        """Wake the loops that serve these envs (in their own processes)."""
        for i in indices:
            self._ends[i].poke()

    def fail_pending(self, text: str) -> None:
        """Every env with a version pending fails it, with ``text``."""
        pending = self.pending()
        if self._rows is not None:
            self._rows.report_failure(pending, self._rows.targets()[pending], text)
            return
        for i in pending.tolist():
            end = self._ends[i]
            end.report_failure(end.target(), text)

    def join(self, member: Member, *, relayed: bool) -> None:
        """Serve ``member`` in this process's worker loop, woken by every env's notices (or,
        ``relayed``, by its slot's relay: the envs' own receivers serve them elsewhere)."""
        if self._rows is not None and self._rows.one_wake:  # the first row's end waits for every row
            loop.serve(member, [self._first])
            return
        loop.serve(member, [end.relayed() if relayed else end for end in self._ends])
