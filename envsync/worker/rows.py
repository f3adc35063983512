"""RowsReceiver: the rows of one natively batched env, as columns.

A natively batched env (``batch_size=[n]``: mjlab's or Isaac Lab's worlds) holds ``n`` envs
of the fleet in one object. Its rows get one receiver, not one each: every row's applied
and failed version, the version it last saw, and the env-state stamps it holds are int64
columns of ``n`` rows, and its end on the link reads and acknowledges rows as columns
(:class:`~envsync.links.rows_reader.RowsReader`). A safe point with nothing pending costs
one vector compare whatever ``n``; with ``k`` rows pending it reads them under one lock, calls
the env's apply **once** with all ``k`` rows (their indices as ``env_ids``), writes their
env-state rows, and acknowledges them in one vector write, after the apply and its finish
returned ("applied" means the simulator holds it).

One apply, in order (as :class:`~envsync.worker.receiver.EnvStateReceiver`'s): config (the one
call) -> the rows' env state (their row of every per-row ``state_dict()`` entry). If any part
raises, every row of the call gets its previous config and env state back and fails its
version, with the traceback; the rows keep running their previous versions. A row whose
entry's stamp went back to 0 (a rollback of the push that first pushed it) gets back the value
it had before that push. The rows share the env's transforms: those are the batched env's own
level (``batched.*``), which its group serves; the rows hand nothing over.
"""

from __future__ import annotations

import traceback
from typing import Any, Protocol

import numpy as np
import torch

from envsync.indexing import Rows, put_rows, span_of, take_rows
from envsync.levels import is_batched
from envsync.links.base import RowsHeader, RowsLink
from envsync.links.locks import ascending
from envsync.protocol import NO_FAILURE, ApplyAt, Kind, Reply
from envsync.spec import ApplySpec
from envsync.worker.owner import Owner


class RowsEnv(Protocol):
    """What a rows receiver needs of its env (the integration's natively batched env)."""

    def config_of(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copies of the config these rows hold now (flat names, one row per index)."""

    def apply(self, rows: torch.Tensor, config: dict[str, torch.Tensor]) -> None:
        """Give these rows this config (one row per index) in one call, its finish included;
        raise if it fails."""

    def state_rows(self) -> dict[str, torch.Tensor]:
        """The env's per-row state entries (live tensors, leading dim: the rows)."""

    def read_attributes(self, paths: list[str], rows: np.ndarray) -> dict[str, torch.Tensor]:
        """What ``rows`` hold at attribute paths (per path, one row per index of ``rows``)."""


class RowsReceiver:
    """The worker side of envsync for the rows of one natively batched env.

    Args:
        link: the rows' end.
        spec: how versions are applied.
        env: the env, as rows.
        owner: the env's owner (shared with its hooks and its group).

    Examples:
        >>> RowsReceiver.__name__
        'RowsReceiver'
    """

    def __init__(self, *, link: RowsLink, spec: ApplySpec, env: RowsEnv, owner: Owner) -> None:
        n = link.count
        self.link = link
        self.spec = spec
        self.env = env
        self.owner = owner
        self.version = np.zeros(n, dtype=np.int64)
        """Per row, the version it runs."""
        self.failed = np.full(n, NO_FAILURE, dtype=np.int64)
        """Per row, its latest failed version (not applied again until a newer one)."""
        self._seen = np.zeros(n, dtype=np.int64)  # per row, the target acknowledged as received
        self._stamps: dict[str, np.ndarray] = {}  # per env-state name, the version whose push each row holds
        self._before_first: dict[str, torch.Tensor] = {}  # per name, each row's value before its first push
        self._first_held: dict[str, np.ndarray] = {}  # per name, the rows whose value before_first keeps
        self._at_step = spec.apply_at is ApplyAt.STEP and not spec.truncates

    @property
    def count(self) -> int:
        """The rows."""
        return self.link.count

    def pending(self) -> np.ndarray:
        """A mask of the rows with a version published that they neither hold nor failed."""
        targets = self.link.targets()
        return (targets != self.version) & (targets != self.failed)

    def start(self) -> bool:
        """Catch every row up with its latest desired state; return whether any had one."""
        rows = np.flatnonzero(self.pending())
        self.apply(rows)
        return bool(rows.size)

    def before_step(self, rows: np.ndarray) -> None:
        """Safe point of ``rows`` before a step: note the versions they see; ``"step"`` mode
        applies the pending ones. Their part of the step runs under the version held then."""
        if self.owner.is_applying or not rows.size:
            return
        targets = self.link.targets()[rows]
        self._notice(rows, span_of(rows, ascending=True), targets)
        if self._at_step:
            self.apply(rows[(targets != self.version[rows]) & (targets != self.failed[rows])])
        held = self.version[rows]
        self.link.note_versions(rows, held, held)

    def before_reset(self, rows: np.ndarray) -> None:
        """Safe point of ``rows`` before their reset: every mode applies a pending version;
        their reset's observation comes from the version held then."""
        if not rows.size:
            return
        if not self.owner.is_applying:
            self.apply(rows[self.pending()[rows]])
        self.link.note_versions(rows, None, self.version[rows])

    def truncating(self) -> np.ndarray:
        """The rows whose step just taken must end their episode (``"truncate"`` mode, pending)."""
        if not self.spec.truncates or self.owner.is_applying:
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(self.pending())

    def apply_if_idle(self, rows: np.ndarray) -> None:
        """With the collector idle: a ``"step"`` version of these rows (int64) applies at once
        (a truncating one waits for the group's reset of those rows)."""
        if self.spec.apply_at is ApplyAt.RESET or self.spec.idle_resets:
            return
        pending = self.pending()[span_of(rows, ascending=True)]
        index = rows if pending.all() else rows[pending]
        if not index.size:
            return
        # first make the env's next step take the slow path, then look at "busy": a step
        # that saw the fast path was sent after the group marked the env busy
        self.owner.unsettle()
        if not self.link.is_busy():
            self.apply(index)

    def _notice(self, rows: np.ndarray, at: Rows, targets: np.ndarray) -> None:
        changed = targets != self._seen[at]
        if changed.all():  # a push to every row (or a run of them): no subsets made
            self._seen[at] = targets
            self.link.ack_received(rows, targets)
        elif changed.any():
            self._seen[rows[changed]] = targets[changed]
            self.link.ack_received(rows[changed], targets[changed])

    def apply(self, rows: np.ndarray) -> None:
        """Apply the latest desired state of ``rows`` (indices) in one call; on failure give
        them their previous state back and report it (rows of several versions: each
        version's rows again in a call of their own, so that a failing push fails only its
        own rows, not the rows of another push that reset with them)."""
        if not rows.size:
            return
        with self.owner.lock, self.owner.applying():
            names = [name for name in self.link.state_names if not is_batched(name)]
            at = span_of(rows, ascending=True)  # every row, or a run of them: slices
            header = self.link.read(rows, self.version[at], names)
            self._notice(rows, at, header.versions)
            self._apply(rows, at, header)

    def _apply(self, rows: np.ndarray, at: Rows, header: RowsHeader) -> None:
        index = torch.from_numpy(rows)
        versions = header.versions
        live = self.env.state_rows() if header.entries or any(s.any() for s in self._stamps.values()) else {}
        if any(name not in live for name in header.entries):
            return  # an entry the env does not hold yet (a lazy transform's): the next safe point
        previous = self.env.config_of(index)
        replaced: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        try:
            self.env.apply(index, header.config)
            self._undo(rows, header.stamps, live)
            for name, values in header.entries.items():
                replaced[name] = self._load(name, rows[header.masks[name]], values, live[name])
        except Exception:
            restored = self._restore(index, previous, replaced, live)
            if not restored and len(distinct := np.unique(versions)) > 1:
                # rows of several versions in one call (each pending since its own push, at one
                # reset): each version applies alone, so that only the one that fails fails
                for version in distinct.tolist():
                    self.apply(rows[versions == version])
                return
            text = traceback.format_exc() + restored
            self.failed[rows] = versions
            self.link.report_failure(rows, versions, text)
            return
        for name, mask in header.masks.items():
            loaded = rows[mask]
            stamps = self._stamps.setdefault(name, np.zeros(self.count, dtype=np.int64))
            held = self._first_held.get(name)
            if held is not None:  # pushed again: its first push can no longer be rolled back
                held[loaded[stamps[loaded] != 0]] = False
            stamps[loaded] = header.stamps[name][mask]
        self.version[at] = versions
        self.link.ack_applied(rows, versions)

    def _load(
        self, name: str, rows: np.ndarray, values: torch.Tensor, target: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``values`` into ``rows`` of the live entry ``target``; return what they
        replaced (for a restore). What a row's first push of the entry replaces is kept until
        the entry is pushed again or rolled back (see :meth:`_undo`)."""
        index = torch.from_numpy(rows)
        old = target.detach().index_select(0, index)
        stamps = self._stamps.get(name)
        first = rows if stamps is None else rows[stamps[rows] == 0]
        if first.size:
            kept = self._before_first.get(name)
            if kept is None:
                kept = self._before_first[name] = torch.zeros_like(target.detach())
                self._first_held[name] = np.zeros(self.count, dtype=bool)
            put_rows(kept, first, take_rows(target.detach(), first))
            self._first_held[name][first] = True
        put_rows(target.data, index, values)
        return index, old

    def _undo(self, rows: np.ndarray, stamps: dict[str, np.ndarray], live: dict[str, torch.Tensor]) -> None:
        """Rows whose stamp of an entry they loaded is 0 again (its first push rolled back):
        put back what that push replaced. A row that got the entry again keeps its value."""
        for name, own in self._stamps.items():
            undone = rows[(own[rows] != 0) & (stamps.get(name, np.zeros(rows.size, dtype=np.int64)) == 0)]
            if not undone.size:
                continue
            held = self._first_held.get(name)
            back = undone if held is None else undone[held[undone]]
            if back.size and name in live:
                put_rows(live[name].data, back, take_rows(self._before_first[name], back))
                assert held is not None
                held[back] = False
            own[undone] = 0

    def _restore(
        self,
        index: torch.Tensor,
        previous: dict[str, torch.Tensor],
        replaced: dict[str, tuple[torch.Tensor, torch.Tensor]],
        live: dict[str, torch.Tensor],
    ) -> str:
        """Put the rows' previous config and env state back; return what failed doing so."""
        try:
            self.env.apply(index, previous)
            for name, (rows, old) in replaced.items():
                put_rows(live[name].data, rows, old)
        except Exception:
            return "\nwhile restoring the previous state:\n" + traceback.format_exc()
        return ""

    def serve(self) -> None:
        """Answer every pending gather of the rows (their env state, what they hold at
        attribute paths): the rows asked one request are read together and answered with one
        reply; a request for the batched env's own entries is its level's (the group's)."""
        asked, ids = self.link.asked()
        distinct = ascending(ids)
        for id_ in distinct:
            which = asked if len(distinct) == 1 else asked[ids == id_]
            request = self.link.request(int(which[0]))
            if request is None or request.kind is Kind.BATCHED_STATE:
                continue
            try:
                reply = Reply(request.id, self._answer(which, request.kind, request.payload))
            except Exception:
                reply = Reply(request.id, {}, traceback.format_exc())
            self.link.reply(which, reply)

    def _answer(self, rows: np.ndarray, kind: Kind, payload: dict[str, Any]) -> dict[str, torch.Tensor]:
        if kind is Kind.ATTRIBUTES:
            return self.env.read_attributes(list(payload["paths"]), rows)
        names = payload["names"]
        live = self.env.state_rows() if names else {}
        index = torch.from_numpy(rows)
        return {name: live[name].index_select(0, index) for name in names}
