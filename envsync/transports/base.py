"""The transport interface: what the sender and a receiver need from the bytes underneath.

A transport carries one *payload* per worker (the worker's whole desired state: config, env
state and the version each env-state entry was last pushed at) plus four counters per
worker (target, received, applied, failed) and an error text. It carries tensors only:
nothing read from the data plane is ever unpickled.

Call order, sender side: ``write`` (payload and target together) -> ``notify`` ->
poll ``status`` until done. Receiver side: ``target`` (cheap, on every safe point) ->
``ack_received`` -> ``read`` -> apply -> ``ack_applied`` or ``report_failure``.
"""

from __future__ import annotations

from typing import Protocol

from tensordict import TensorDictBase

from envsync.protocol import WorkerStatus


class SenderEnd(Protocol):
    """The main process's side of a transport."""

    num_workers: int

    def write(self, worker: int, version: int, payload: TensorDictBase) -> None:
        """Publish ``payload`` as the desired state of ``worker`` at ``version``, atomically."""

    def notify(self, worker: int) -> None:
        """Wake the worker's idle listener (a busy worker needs no wake-up)."""

    def status(self, worker: int) -> WorkerStatus:
        """Read the worker's acknowledgements."""

    def error_text(self, worker: int) -> str:
        """The traceback text of the worker's latest failure."""

    def close(self) -> None:
        """Release every resource; idempotent."""


class ReceiverEnd(Protocol):
    """One worker's side of a transport."""

    worker: int

    def target(self) -> int:
        """The latest version published to this worker (cheap: read on every step)."""

    def read(self, since: int = -1) -> tuple[int, TensorDictBase]:
        """A consistent snapshot of (version, payload); env-state entries last pushed at or
        before ``since`` are left out."""

    def ack_received(self, version: int) -> None:
        """Tell the sender this version is seen and armed."""

    def ack_applied(self, version: int) -> None:
        """Tell the sender the env runs this version."""

    def report_failure(self, version: int, text: str) -> None:
        """Tell the sender this version failed, with the traceback text."""

    def set_busy(self, busy: bool) -> None:
        """Tell the sender whether the collector drives the env (then it needs no wake-up)."""

    def wait_notice(self, timeout: float) -> bool:
        """Block until the sender notifies this worker or ``timeout`` passes."""
