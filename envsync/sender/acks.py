"""Waiting for acknowledgements, and raising what the workers report: the sender's
``wait``, and the failures a push or a wait must raise (rolling the latest push back).

A wait blocks on the link first (which returns at once when no slot owes the version) and
reads the workers' counters each time the link wakes it. A blocking wait takes at most a
slice, after which the liveness of the workers still pending is checked (a syscall per
worker, so only when no acknowledgement came).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np

from envsync.errors import AckTimeout, EnvSyncError, WorkerApplyError
from envsync.links.base import Acknowledgements
from envsync.protocol import NO_FAILURE, Until, all_settled, any_owing, is_done
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
    pending: list[int] | None = None  # the envs still owing, made when an env is looked at alone
    located: dict[int, tuple[Attachment, int]] | None = None
    deadline = time.monotonic() + timeout
    try:
        # first block (a link returns at once when nothing is owed), then read the counters
        link: Acknowledgements | None = parts[0].attachment.link if parts else None
        slots: np.ndarray | None = parts[0].slots if len(parts) == 1 else None
        while link is not None:
            if slots is None:
                located = located if located is not None else _located(parts)
                pending = pending if pending is not None else chosen.tolist()
                slots = np.array([located[e][1] for e in pending if located[e][0].link is link], dtype=np.int64)
            woken = _block(link, slots, version, mode, deadline - time.monotonic())
            # (``pending`` not made yet: one collector's slots, every env waited for)
            if woken and (pending is None or len(slots) == len(pending)):
                settled = _settled(core, link, slots, version, mode)
                if settled:
                    return
                if settled is False and time.monotonic() < deadline:
                    continue  # nothing failed, nobody left: block again
            # liveness (a syscall per worker) only when no acknowledgement came in a slice
            located = located if located is not None else _located(parts)
            pending = pending if pending is not None else chosen.tolist()
            link = _progress(core, pending, located, version, mode, check_liveness=not woken)
            slots = None
            if link is not None and time.monotonic() >= deadline:
                raise _timeout(core, version, pending, [], mode)
    except RuntimeError as err:  # a link closed under us
        if core.closed:
            raise _closed(version) from err
        raise


def _located(parts: list[Part]) -> dict[int, tuple[Attachment, int]]:
    """Each env's attachment and slot (envs looked at one by one: failures, deaths)."""
    out = {}
    for part in parts:
        for slot in part.slots.tolist():
            out[part.attachment.offset + slot] = (part.attachment, slot)
    return out


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
    core: Core,
    pending: list[int],
    located: Mapping[int, tuple[Attachment, int]],
    version: int,
    mode: Until,
    check_liveness: bool,
) -> Acknowledgements | None:
    """Drop the envs that are done from ``pending``; raise failures and (when asked to
    check) deaths; return a link to block on (``None`` when nothing is pending)."""
    try:
        with core.lock:
            if check_liveness:
                core.prune()
            # a collector that left the fleet (pruned here or by anyone) has no link left
            gone = [w for w in pending if located[w][0] not in core.fleet.attachments]
            if gone and core.closed:
                raise _closed(version)
            still = []
            for index in pending:
                if index in gone:
                    continue
                attachment, slot = located[index]
                status = attachment.link.status(slot)
                failed = core.failures.to_raise(index, status, version)
                if failed is not None:
                    _raise_failure(core, index, attachment, slot, failed)
                if not is_done(status, version, mode):
                    still.append(index)
            pending[:] = still
            dead = gone + [w for w in still if check_liveness and not located[w][0].link.alive(located[w][1])]
            if dead:
                raise _timeout(core, version, sorted(set(still) | set(gone)), dead, mode)
            return located[still[0]][0].link if still else None
    except WorkerApplyError as err:
        _confirm_rollback(core, err, mode, time.monotonic() + 5.0)
        raise


def _timeout(core: Core, version: int, late: list[int], dead: list[int], mode: Until) -> AckTimeout:
    """The timeout for late (and dead) envs, named by worker, with the envs alongside."""

    def worker(env: int) -> int:
        try:
            return core.fleet.worker_of(env)
        except KeyError:  # its collector left the fleet
            return env

    workers = sorted({worker(e) for e in late})
    hint = _reset_trap(core, version, [e for e in late if e not in dead]) if mode is Until.APPLIED else ""
    return AckTimeout(version, workers, dead=sorted({worker(e) for e in dead}), until=mode.value, envs=late, hint=hint)


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
        for env in late:
            try:
                attachment, slot = core.fleet.locate(env)
            except KeyError:
                return ""
            if attachment.link.status(slot).received < version:
                return ""
    return RESET_TRAP


def _confirm_rollback(core: Core, err: WorkerApplyError, until: Until, deadline: float) -> None:
    """Wait (without holding the core's lock) until the rollback is in place too."""
    if err.rollback is None:
        return
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
