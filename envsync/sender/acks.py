"""Waiting for acknowledgements, and raising what the workers report: the sender's
``wait``, and the failures a push or a wait must raise (rolling the latest push back).

A wait blocks on the link first (which returns at once when no slot owes the version) and
reads the workers' counters each time the link wakes it, as columns (one read per link
whatever the number of envs: a wait for 65,536 worlds never walks them). A blocking wait takes
at most a slice, after which the liveness of the slots still owing is checked (once per
process that serves them, so only when no acknowledgement came).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from envsync.errors import AckTimeout, EnvSyncError, WorkerApplyError
from envsync.links.base import Acknowledgements
from envsync.protocol import NO_FAILURE, Until, all_settled, any_owing
from envsync.sender.core import Core
from envsync.sender.fleet import Attachment, Part

_ACK_SLICE = 0.05
"""Longest blocking wait for an acknowledgement before liveness is checked again."""


def wait(
    core: Core, version: int, mode: Until, targets: Sequence[int] | np.ndarray, timeout: float, *, pruned: bool = False
) -> None:
    """Block until every env of ``targets`` (validated fleet indices) is done with
    ``version`` (see :func:`~envsync.protocol.is_done`); raise what the workers report
    (``pruned``: a push that has just pruned the fleet waits)."""
    chosen = np.asarray(targets, dtype=np.int64)
    with core.lock:
        if not pruned:
            core.prune()
        parts = core.fleet.split(chosen)
    owing = [part.slots for part in parts]  # per part, the slots that still owe (by vector ops)
    deadline = time.monotonic() + timeout
    try:
        while True:
            # first block (a link returns at once when nothing is owed), then read the counters
            live = [(part, slots) for part, slots in zip(parts, owing, strict=True) if len(slots)]
            if not live:
                return
            link = live[0][0].attachment.link
            woken = _block(link, live[0][1], version, mode, deadline - time.monotonic())
            if woken and len(live) == 1:  # one link's slots owe: its counters tell, in one or two reads
                settled = _settled(core, link, live[0][1], version, mode)
                if settled:
                    return
                if settled is False and time.monotonic() < deadline:
                    continue  # nothing failed, nobody left: block again
            # liveness (once per process) only when no acknowledgement came in a slice
            owing = _progress(core, parts, owing, version, mode, check_liveness=not woken)
            if any(len(slots) for slots in owing) and time.monotonic() >= deadline:
                raise _timeout(core, version, _envs(parts, owing), [], mode)
    except RuntimeError as err:  # a link closed under us
        if core.closed:
            raise _closed(version) from err
        raise


def _envs(parts: list[Part], slots: list[np.ndarray]) -> list[int]:
    """The fleet indices of ``slots`` (per part), ascending."""
    return sorted(i for part, s in zip(parts, slots, strict=True) for i in (s + part.attachment.offset).tolist())


def _closed(version: int) -> EnvSyncError:
    return EnvSyncError(f"the sender was closed while waiting for version {version}")


def _block(link: Acknowledgements, slots: np.ndarray, version: int, mode: Until, remaining: float) -> bool:
    """Block on ``link`` until ``slots`` acknowledged ``version`` (at most a slice); return
    whether an acknowledgement came. A link closed meanwhile counts as one: the counters
    read next tell what happened."""
    try:
        timeout = max(min(_ACK_SLICE, remaining), 0.0)
        applied = mode is Until.APPLIED

        def done() -> bool:
            return not any_owing(link.counts(slots, applied=applied), version)

        return link.wait_acks(timeout, applied=applied, done=done)
    except RuntimeError:
        return True


def _settled(core: Core, link: Acknowledgements, slots: np.ndarray, version: int, mode: Until) -> bool | None:
    """The common ends of a wake-up, in one or two reads of the link: ``True`` when every
    slot waited for has acknowledged ``version`` and none ever failed; ``False`` when some
    still owe it but no slot of the link ever failed (nothing to raise: block again);
    ``None`` when :func:`_progress` must look (a failure somewhere, or the link's collector
    left the fleet)."""
    with core.lock:
        if not any(a.link is link for a in core.fleet.attachments):
            return None
        if all_settled(link.counts(slots, applied=mode is Until.APPLIED), version):
            return True
        return False if (link.failed() == NO_FAILURE).all() else None


def _progress(
    core: Core, parts: list[Part], owing: list[np.ndarray], version: int, mode: Until, check_liveness: bool
) -> list[np.ndarray]:
    """Drop the slots that are done from ``owing`` (per part); raise failures and (when asked
    to check) deaths; return what still owes. By vector ops on each link's counters: a wait
    for 65,536 worlds costs a few column reads a slice, not a walk over the worlds."""
    applied = mode is Until.APPLIED
    try:
        with core.lock:
            if check_liveness:
                core.prune()
            still: list[np.ndarray] = []
            gone: list[int] = []
            dead: list[int] = []
            for part, slots in zip(parts, owing, strict=True):
                attachment = part.attachment
                if not len(slots) or attachment not in core.fleet.attachments:
                    # a collector that left the fleet (pruned here or by anyone) has no link left
                    gone += (slots + attachment.offset).tolist()
                    still.append(slots[:0])
                    continue
                link = attachment.link
                target, acked, failed = link.counts(slots, applied=applied)
                reported = core.failures.reported(slots + attachment.offset)
                for at in np.flatnonzero((failed != NO_FAILURE) & ((failed > reported) | (failed == version))).tolist():
                    index = attachment.offset + int(slots[at])
                    raising = core.failures.to_raise(index, link.status(int(slots[at])), version)
                    if raising is not None:
                        _raise_failure(core, index, attachment, int(slots[at]), raising)
                left = slots[acked < np.minimum(target, version)]  # not done (protocol.is_done)
                still.append(left)
                if check_liveness and len(left):
                    dead += (left[~link.alive_slots(left)] + attachment.offset).tolist()
            if gone and core.closed:
                raise _closed(version)
            if dead or gone:
                late = sorted(set(_envs(parts, still)) | set(gone))
                raise _timeout(core, version, late, sorted(set(dead) | set(gone)), mode)
            return still
    except WorkerApplyError as err:
        _confirm_rollback(core, err, mode, time.monotonic() + 5.0)
        raise


def _timeout(core: Core, version: int, late: list[int], dead: list[int], mode: Until) -> AckTimeout:
    """The timeout for late (and dead) envs, named by worker, with the envs alongside."""
    gone = set(dead)
    alive = [e for e in late if e not in gone]
    hint = _reset_trap(core, version, alive) if mode is Until.APPLIED else ""
    workers = _workers(core, late)
    return AckTimeout(version, workers, dead=_workers(core, dead), until=mode.value, envs=late, hint=hint)


def _workers(core: Core, envs: list[int]) -> list[int]:
    """The fleet workers that drive ``envs``, ascending (by vector ops: 65,536 late worlds are
    a few workers); an env whose collector left the fleet stands for itself."""
    chosen = np.array(envs, dtype=np.int64)
    out = chosen.copy()
    for a in core.fleet.attachments:
        inside = (chosen >= a.offset) & (chosen < a.offset + a.link.num_workers)
        out[inside] = a.worker_offset + (chosen[inside] - a.offset) // a.envs_per_worker
    return np.unique(out).tolist()


RESET_TRAP = (
    ": they received it and hold it for their next reset (apply_at='reset'), which an idle env never reaches: "
    "a Collector or MultiSyncCollector is idle between next() calls, an env outside any collector between "
    "rollouts. Wait for 'received' there, or wait while collecting (see docs/concepts.md, apply modes)"
)


def _reset_trap(core: Core, version: int, late: list[int]) -> str:
    """The documented reset-mode trap, when it explains the timeout: every late env (alive)
    received ``version`` and applies only at its next reset."""
    if not core.resets or not late:
        return ""
    with core.lock:
        try:
            parts = core.fleet.split(np.array(late, dtype=np.int64))
        except KeyError:
            return ""
        for part in parts:
            target, received, _ = part.attachment.link.counts(part.slots, applied=False)
            if (received < version).any():
                return ""
    return RESET_TRAP


def _confirm_rollback(core: Core, err: WorkerApplyError, until: Until, deadline: float) -> None:
    """Wait (without holding the core's lock) until the rollback is in place too: as far as
    the wait asked (``until``), and in ``"reset"`` mode received, since there it is armed
    for each env's next reset, which an idle env never reaches."""
    if err.rollback is None:
        return
    until = Until.RECEIVED if core.resets else until
    try:
        with core.lock:
            targets = core.fleet.indices()
        wait(core, err.rollback, until, targets, max(0.05, deadline - time.monotonic()))
    except EnvSyncError as late:
        err.add_note(f"rollback version {err.rollback} not confirmed: {late}")


def raise_failures(core: Core) -> None:
    """Raise the first failure of any env not raised yet; if it is of the latest push, roll
    that push back."""
    for attachment in core.fleet.attachments:
        failed = attachment.link.failed() != NO_FAILURE
        if not failed.any():  # the common case, on every push: one vector read
            continue
        for slot in np.flatnonzero(failed).tolist():
            index = attachment.offset + slot
            failed = core.failures.to_raise(index, attachment.link.status(slot))
            if failed is not None:
                _raise_failure(core, index, attachment, slot, failed)


def _raise_failure(core: Core, index: int, attachment: Attachment, slot: int, failed: int) -> None:
    core.failures.raised(index, failed)
    worker = core.fleet.worker_of(index)
    rollback = core.roll_back(failed)
    text = attachment.link.error_text(slot)
    raise WorkerApplyError(worker, failed, text, rollback=rollback, env=index)
