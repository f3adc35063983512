"""Waiting for acknowledgements, and raising what the workers report: the sender's
``wait``, and the failures a push or a wait must raise (rolling the latest push back).

A wait blocks on the link first (which returns at once when no slot owes the version) and
reads the workers' counters each time the link wakes it. A blocking wait takes at most a
slice, after which the liveness of the workers still pending is checked (a syscall per
worker, so only when no acknowledgement came).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from envsync.errors import AckTimeout, EnvSyncError, WorkerApplyError
from envsync.fleet import Attachment
from envsync.links.base import SenderLink
from envsync.protocol import NO_FAILURE, Until, WorkerStatus, failure_to_raise, is_done

if TYPE_CHECKING:
    from envsync.sender import Sender

_ACK_SLICE = 0.05
"""Longest blocking wait for an acknowledgement before liveness is checked again."""


def wait(
    sender: Sender, version: int, mode: Until, targets: list[int], timeout: float, *, pruned: bool = False
) -> None:
    """Implementation of :meth:`Sender.wait` (``targets``: env indices, validated;
    ``pruned``: a push that has just pruned the fleet waits)."""
    with sender._lock:
        if not pruned:
            sender._prune()
        pending = list(targets)
        located = {w: sender._fleet.locate(w) for w in pending}
    deadline = time.monotonic() + timeout
    try:
        # first block (a link returns at once when nothing is owed), then read the counters
        link = located[pending[0]][0].link if pending else None
        while link is not None:
            slots = [located[e][1] for e in pending if located[e][0].link is link]
            woken = _block(link, slots, version, mode, deadline - time.monotonic())
            if woken and len(slots) == len(pending):
                settled = _settled(sender, link, slots, version, mode)
                if settled:
                    return
                if settled is False and time.monotonic() < deadline:
                    continue  # nothing failed, nobody left: block again
            # liveness (a syscall per worker) only when no acknowledgement came in a slice
            link = _progress(sender, pending, located, version, mode, check_liveness=not woken)
            if link is not None and time.monotonic() >= deadline:
                raise _timeout(sender, version, pending, [], mode)
    except RuntimeError as err:  # a link closed under us
        if sender._closed:
            raise _closed(version) from err
        raise


def _closed(version: int) -> EnvSyncError:
    return EnvSyncError(f"the sender was closed while waiting for version {version}")


def _block(link: SenderLink, slots: list[int], version: int, mode: Until, remaining: float) -> bool:
    """Block on ``link`` until ``slots`` acknowledged ``version`` (at most a slice); return
    whether an acknowledgement came. A link closed meanwhile counts as one: the counters
    read next tell what happened."""
    try:
        timeout = max(min(_ACK_SLICE, remaining), 0.0)
        return link.wait_acks(timeout, applied=mode is Until.APPLIED, version=version, slots=slots)
    except RuntimeError:
        return True


def _settled(sender: Sender, link: SenderLink, slots: list[int], version: int, mode: Until) -> bool | None:
    """The common ends of a wake-up, in one or two reads of the link: ``True`` when every
    slot waited for has acknowledged ``version`` and none ever failed; ``False`` when some
    still owe it but no slot of the link ever failed (nothing to raise: block again);
    ``None`` when :func:`_progress` must look (a failure somewhere, or the link's collector
    left the fleet)."""
    with sender._lock:
        if not any(a.link is link for a in sender._fleet.attachments):
            return None
        if link.settled(slots, version, applied=mode is Until.APPLIED):
            return True
        return False if all(failed == NO_FAILURE for failed in link.failed()) else None


def _progress(
    sender: Sender,
    pending: list[int],
    located: Mapping[int, tuple[Attachment, int]],
    version: int,
    mode: Until,
    check_liveness: bool,
) -> SenderLink | None:
    """Drop the envs that are done from ``pending``; raise failures and (when asked to
    check) deaths; return a link to block on (``None`` when nothing is pending)."""
    try:
        with sender._lock:
            if check_liveness:
                sender._prune()
            # a collector that left the fleet (pruned here or by anyone) has no link left
            gone = [w for w in pending if located[w][0] not in sender._fleet.attachments]
            if gone and sender._closed:
                raise _closed(version)
            still = []
            for index in pending:
                if index in gone:
                    continue
                attachment, slot = located[index]
                status = attachment.link.status(slot)
                failed = _to_raise(sender, index, status, version)
                if failed is not None:
                    _raise_failure(sender, index, attachment, slot, failed)
                if not is_done(status, version, mode):
                    still.append(index)
            pending[:] = still
            dead = gone + [w for w in still if check_liveness and not located[w][0].link.alive(located[w][1])]
            if dead:
                raise _timeout(sender, version, sorted(set(still) | set(gone)), dead, mode)
            return located[still[0]][0].link if still else None
    except WorkerApplyError as err:
        _confirm_rollback(sender, err, mode, time.monotonic() + 5.0)
        raise


def _timeout(sender: Sender, version: int, late: list[int], dead: list[int], mode: Until) -> AckTimeout:
    """The timeout for late (and dead) envs, named by worker, with the envs alongside."""

    def worker(env: int) -> int:
        try:
            return sender._fleet.worker_of(env)
        except KeyError:  # its collector left the fleet
            return env

    workers = sorted({worker(e) for e in late})
    return AckTimeout(version, workers, dead=sorted({worker(e) for e in dead}), until=mode.value, envs=late)


def _confirm_rollback(sender: Sender, err: WorkerApplyError, until: Until, deadline: float) -> None:
    """Wait (without holding the sender's lock) until the rollback is in place too."""
    if err.rollback is None:
        return
    try:
        sender.wait(err.rollback, until=until.value, timeout=max(0.05, deadline - time.monotonic()))
    except EnvSyncError as late:
        err.add_note(f"rollback version {err.rollback} not confirmed: {late}")


def raise_failures(sender: Sender) -> None:
    """Raise the first failure of any env not raised yet; if it is of the latest push, roll
    that push back."""
    for attachment in sender._fleet.attachments:
        for slot, latest in enumerate(attachment.link.failed()):
            if latest == NO_FAILURE:
                continue
            index = attachment.offset + slot
            failed = _to_raise(sender, index, attachment.link.status(slot))
            if failed is not None:
                _raise_failure(sender, index, attachment, slot, failed)


def _to_raise(sender: Sender, index: int, status: WorkerStatus, waited: int | None = None) -> int | None:
    """The failed version to raise for env ``index``: one version is raised once, whichever
    of the envs that failed it reports first (the others are marked raised with it; a waiter
    of that very version still learns of it)."""
    failed = failure_to_raise(status, sender._raised.get(index, NO_FAILURE), waited)
    if failed is not None and failed != waited and failed in sender._raised_versions:
        sender._raised[index] = max(failed, sender._raised.get(index, NO_FAILURE))
        return None
    return failed


def _raise_failure(sender: Sender, index: int, attachment: Attachment, slot: int, failed: int) -> None:
    sender._raised[index] = max(failed, sender._raised.get(index, NO_FAILURE))
    sender._raised_versions.add(failed)
    worker = sender._fleet.worker_of(index)
    rollback = sender._roll_back(failed)
    text = attachment.link.error_text(slot)
    raise WorkerApplyError(worker, failed, text, rollback=rollback, env=index)
