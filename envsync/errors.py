"""The exceptions envsync raises.

Every error derives from :class:`EnvSyncError`::

    EnvSyncError
    ├── ValidationError     bad input, raised in the main process before anything is sent
    ├── WorkerApplyError    a worker failed to apply a version (carries its traceback)
    ├── GatherError         a worker failed to answer a gather (carries its traceback)
    ├── AckTimeout          some targeted workers did not answer in time (or died)
    └── WireError           a Ray link's connection carried something that may not travel
"""

from __future__ import annotations

from collections.abc import Sequence


class EnvSyncError(Exception):
    """Base class of every envsync error.

    Examples:
        >>> issubclass(ValidationError, EnvSyncError)
        True
    """


class ValidationError(EnvSyncError, ValueError):
    """The input does not fit the template or the attached collector; nothing was sent.

    Examples:
        >>> str(ValidationError("unknown config name 'x'"))
        "unknown config name 'x'"
    """


class WorkerApplyError(EnvSyncError):
    """A worker failed to apply a version.

    Args:
        worker: fleet index of the worker that failed.
        version: the version it failed to apply.
        remote_traceback: the worker's traceback text.
        rollback: the version published to bring every env that ``version`` targeted back
            to the state before it, or ``None`` when ``version`` was no longer the latest.
        env: fleet index of the env that failed (the worker's, for an unbatched worker).

    Examples:
        >>> err = WorkerApplyError(1, 3, "Traceback ... ZeroDivisionError", rollback=4)
        >>> (err.worker, err.env, err.version, err.rollback)
        (1, 1, 3, 4)
    """

    def __init__(
        self, worker: int, version: int, remote_traceback: str, *, rollback: int | None = None, env: int | None = None
    ) -> None:
        self.worker = worker
        self.env = worker if env is None else env
        self.version = version
        self.remote_traceback = remote_traceback
        self.rollback = rollback
        last = remote_traceback.strip().splitlines()[-1] if remote_traceback.strip() else ""
        who = f"worker {worker}" if self.env == worker else f"env {self.env} (worker {worker})"
        super().__init__(
            f"{who} failed to apply version {version}: {last}\n--- {who} traceback ---\n{remote_traceback}"
        )


class GatherError(EnvSyncError):
    """A worker failed while answering a ``gather`` (its env's ``state_dict()`` raised, say).

    Raised by :meth:`~envsync.EnvStateSender.gather` (and so by ``sync_stats`` and
    ``state_dict(gather=True)``); no version is marked failed and nothing is rolled back.

    Args:
        worker: fleet index of the worker that failed.
        request: the gather request it failed to answer.
        remote_traceback: the worker's traceback text.
        env: fleet index of the env that failed (the worker's, for an unbatched worker).

    Examples:
        >>> err = GatherError(1, 7, "Traceback (most recent call last):\\nOSError: disk")
        >>> (err.worker, err.env, err.request), str(err).splitlines()[0]
        ((1, 1, 7), 'worker 1 failed to answer a gather: OSError: disk')
    """

    def __init__(self, worker: int, request: int, remote_traceback: str, *, env: int | None = None) -> None:
        self.worker = worker
        self.env = worker if env is None else env
        self.request = request
        self.remote_traceback = remote_traceback
        last = remote_traceback.strip().splitlines()[-1] if remote_traceback.strip() else ""
        who = f"worker {worker}" if self.env == worker else f"env {self.env} (worker {worker})"
        super().__init__(f"{who} failed to answer a gather: {last}\n--- {who} traceback ---\n{remote_traceback}")


class AckTimeout(EnvSyncError, TimeoutError):
    """Some targeted workers did not acknowledge in time, or died.

    Args:
        version: the version that was waited for.
        workers: the late workers.
        dead: the subset of ``workers`` whose process is gone.
        until: what was waited for (``"received"`` or ``"applied"``).
        envs: the late envs (the late workers' own, for unbatched workers).
        hint: what the message adds about the likely cause (e.g. the reset-mode trap).

    Examples:
        >>> err = AckTimeout(4, [1], dead=[1], until="applied")
        >>> err.workers, err.dead, err.envs
        ([1], [1], [1])
    """

    def __init__(
        self,
        version: int,
        workers: Sequence[int],
        *,
        dead: Sequence[int] = (),
        until: str,
        envs: Sequence[int] | None = None,
        hint: str = "",
    ) -> None:
        self.version = version
        self.workers = list(workers)
        self.envs = list(workers if envs is None else envs)
        self.dead = list(dead)
        self.until = until
        detail = f"; dead: {self.dead}" if self.dead else ""
        super().__init__(f"version {version} not {until} by workers {self.workers}{detail}{hint}")


class WireError(EnvSyncError, ValueError):
    """A message on a Ray link's connection is malformed, or holds a value that may not
    travel: anything but plain values and arrays (:mod:`envsync.links.ray_codec`). The
    connection it came on is dropped.

    Examples:
        >>> issubclass(WireError, EnvSyncError)
        True
    """
