"""The link interface: what the sender and a receiver need from the bytes underneath.

A link carries, per worker, the worker's whole desired state as flat leaves (see
:data:`Key`), a target version, the acknowledgements (received, applied, failed), a failure
text and an *undo* mark. It carries tensors and integers only: nothing read from the data
plane is ever unpickled.

Call order, sender side, per push: ``write_rows`` of the targeted workers (leaves and
targets together, under their slot locks) -> ``notify``; then ``flush`` once per link; then
``wait_acks`` until :func:`~envsync.protocol.is_done` holds.
Receiver side: ``target`` (one integer read, on every safe point) -> ``ack_received`` ->
``read_header`` -> apply config -> ``load_entries`` (straight from the slot into the env) ->
``ack_applied`` or ``report_failure``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from envsync.protocol import Counts, Reply, Request, WorkerStatus
from envsync.state import Leaf

Key = tuple[str, str]
"""A leaf of a worker's desired state: ``(section, dotted name)``. Sections: ``"config"``
(config names, e.g. ``"task.id"``), ``"env_state"`` (state_dict keys, e.g.
``"transforms.0.loc"``) and ``"stamp"`` (per env-state key, the version that last pushed it;
0 means never pushed)."""

Flat = dict[Key, Leaf]


@dataclass(frozen=True)
class Header:
    """What a receiver reads first: the version, the config leaves (copies), the stamps of
    the env-state entries and the undo mark.

    Args:
        version: the target version.
        config: the config leaves, copied out of the slot (numpy arrays, except for dtypes
            numpy lacks, such as bfloat16).
        stamps: per env-state key, the version that last pushed it.
        undo: a version whose env-state changes this worker must undo (0: none).
    """

    version: int
    config: dict[str, Leaf]
    stamps: dict[str, int]
    undo: int


@dataclass(frozen=True)
class RowsHeader:
    """What a read of rows returns (``k`` rows, in the order asked).

    Args:
        versions: each row's target version.
        config: per config name, the rows' values (a tensor of ``k`` rows).
        stamps: per env-state name, the version that last pushed it to each row.
        undo: each row's undo mark (a version whose env-state changes it must undo; 0: none).
        entries: per env-state name a row must load, the values of those rows (the rows
            ``masks`` selects).
        masks: per name of ``entries``, which of the ``k`` rows load it.
    """

    versions: np.ndarray
    config: dict[str, torch.Tensor]
    stamps: dict[str, np.ndarray]
    undo: np.ndarray
    entries: dict[str, torch.Tensor]
    masks: dict[str, np.ndarray]


BROADCAST = ("config", "env_state")
"""The sections whose leaves a link can write once for all its workers (a broadcast)."""


class Outbox(Protocol):
    """The main process's side of a link, as a push and a request use it: write rows, wake,
    flush, ask, read the replies."""

    num_workers: int

    def write(self, worker: int, version: int, entries: Mapping[Key, Leaf], *, undo: int = 0) -> None:
        """Publish ``entries`` as the desired state of ``worker`` at ``version``, atomically
        (``write_rows`` of one slot)."""

    def write_rows(
        self,
        slots: np.ndarray,
        version: int,
        shared: Mapping[Key, Leaf],
        rows: Mapping[Key, torch.Tensor],
        *,
        undo: int = 0,
    ) -> None:
        """Publish ``version`` to each of ``slots`` (distinct, int64), atomically per slot:
        ``shared`` values for all of them (written once for all where the link can), one row
        each of ``rows``; ``undo``: a version whose env-state changes they must undo."""

    def notify(self, workers: Sequence[int] | np.ndarray, *, here: bool = False) -> None:
        """Wake the worker loops that serve these workers, each loop once (the rows of a
        natively batched env share one): an idle worker applies at once (per
        the apply mode), a busy one acknowledges receipt at once (its next safe point applies). Waking busy
        workers too halves "received" with 10-20 workers on 2 cores: a woken thread is
        scheduled sooner than a busy main thread's next step. ``here``: the caller waits for
        them, so an in-process link may run the loop's turn in the caller's thread
        (:mod:`envsync.links.inline`); a push that does not wait returns at once."""

    def flush(self, version: int) -> None:
        """Every write of ``version`` to this link is done (a link that batches, e.g. one
        object-store put per push, sends now; the shared-memory and local links do nothing)."""

    def send_request(self, workers: Sequence[int] | np.ndarray, request: Request) -> None:
        """Send ``request`` to each of ``workers`` (its kind is the worker's to read, never the link's)."""

    def replies(self, workers: np.ndarray, request: int) -> list[tuple[np.ndarray, Reply]]:
        """The replies to ``request`` that came from ``workers``, each with the workers it
        answers and its values with one row per worker, in that order (the rows of a natively
        batched env answer with one reply; a failure, with its traceback, answers every
        worker listed with it)."""

    def handle(self) -> LinkHandle:
        """What a worker needs to open its end (picklable for the shared-memory link)."""

    def close(self) -> None:
        """Release every resource; idempotent."""


class Acknowledgements(Protocol):
    """The main process's side of a link, as waiting uses it (:mod:`envsync.sender.acks`): what
    each worker acknowledged or failed, whether it lives, a wait for the next acknowledgement."""

    def status(self, worker: int) -> WorkerStatus:
        """Read the worker's acknowledgements."""

    def failed(self) -> np.ndarray:
        """Every worker's latest failed version (:data:`~envsync.protocol.NO_FAILURE`: none),
        as one int64 column read at once (checked before every push): possibly a read-only
        view of the live column, to compare at once, not to keep."""

    def error_text(self, worker: int) -> str:
        """The traceback text of the worker's latest failure."""

    def alive_slots(self, slots: np.ndarray) -> np.ndarray:
        """Per slot of ``slots`` (int64), whether its worker can still answer (a bool column:
        asked once per process or remote collector, not once per slot)."""

    def counts(self, slots: Sequence[int] | np.ndarray, *, applied: bool) -> Counts:
        """Per slot of ``slots``: its target, its latest acknowledgement (``applied``: of an
        apply; else of receipt) and its latest failure, read at once; the rules of what they
        mean are :mod:`envsync.protocol`'s."""

    def wait_acks(self, timeout: float, *, applied: bool, done: Callable[[], bool] | None = None) -> bool:
        """Block until some worker acknowledges (``applied``: an apply or a failure; else
        anything), or ``timeout`` passes; return whether an acknowledgement came, or at once
        ``True`` when the waiter's rule ``done`` holds."""


class SenderLink(Outbox, Acknowledgements, Protocol):
    """The main process's side of a link: its outbox and its acknowledgements in one object."""


class LinkHandle(Protocol):
    """Opens one worker's end of a link, or the end of the rows of one natively batched env."""

    def open(self, worker: int, *, claim: bool = True) -> End:
        """Return ``worker``'s end; ``claim``: this process serves the slot (the sender
        checks its liveness), not only looks at it (a batched env's group)."""

    def open_rows(self, first: int, count: int, *, gated: bool = False, claim: bool = True) -> RowsLink:
        """Return the end of the ``count`` rows of one env from slot ``first`` on (one slot
        lock and one wake-up for all on a link made with ``group=count``)."""


class Inbox(Protocol):
    """What a receiver reads on its end: what is published, its env state, requests; and
    its answers to them."""

    worker: int

    def target(self) -> int:
        """The latest version published to this worker (one integer read)."""

    def read_header(self) -> Header:
        """A consistent copy of the version, the config, the stamps and the undo mark."""

    def load_entries(self, version: int, names: list[str], load: Callable[[str, torch.Tensor], None]) -> bool:
        """Call ``load(name, slot_view)`` for each env-state name, under the slot lock, if the
        target is still ``version``; return whether it was (else read the header again)."""

    def request(self) -> Request | None:
        """The request this end's slot has not answered yet, or ``None`` (two integer reads
        while none is pending; handled at rollout ends and while idle)."""

    def reply(self, reply: Reply) -> None:
        """Answer with ``reply`` (a result, or the worker's traceback) and wake the sender (see
        :func:`envsync.worker.receiver.answer`, through which every worker-side answer goes)."""


class Reports(Protocol):
    """What a receiver tells the sender on its end: acknowledgements, failures, the
    versions its env runs; and whether its env is driven (from another process)."""

    def ack_received(self, version: int) -> None:
        """Tell the sender this version is seen and armed."""

    def ack_applied(self, version: int) -> None:
        """Tell the sender the env runs this version."""

    def report_failure(self, version: int, text: str) -> None:
        """Tell the sender this version failed, with the traceback text."""

    def note_versions(self, ran: int | None, obs: int) -> None:
        """Record the version the env's next step runs under (``None``: unchanged) and the one
        its observation comes from (a batched env's group reads them for its tags)."""

    def is_busy(self) -> bool:
        """Whether the collector drives the env now (as its owner marked it with
        :meth:`Marks.set_busy`, possibly from another process: a batched env's group marks
        its sub-envs)."""


class ReceiverLink(Inbox, Reports, Protocol):
    """One worker's side of a link, as its receiver uses it: read what is published, load
    it, answer requests, acknowledge, report failures, note the versions its env runs, and
    read whether its env is driven (from another process)."""


class Notices(Protocol):
    """How an end's notices reach its worker loop (:mod:`envsync.worker.loop`)."""

    worker: int

    @property
    def link_name(self) -> str:
        """The link's name, the same in every process (see :mod:`envsync.worker.loop`)."""

    def route_to(self, home: Notices) -> None:
        """Route every notice for this end to the semaphore ``home`` (an end of the same link,
        in this process) waits on: one worker loop waits for both."""

    def wait_notice(self, timeout: float) -> bool:
        """Block until a notice for this end (or one routed to it) comes or ``timeout`` passes."""

    def poke(self) -> None:
        """Wake the loop that serves this end (as the sender's notify does)."""

    def turns_here(self, turn: Callable[[], bool]) -> None:
        """Let the sender's notices run ``turn`` (the loop's turn; it returns whether it ran)
        in the sender's thread: an in-process link does (:mod:`envsync.links.inline`), a link
        between processes wakes the loop's thread."""

    def owner_alive(self) -> bool:
        """Whether the sender's process still runs (a worker whose sender died exits)."""


class Marks(Protocol):
    """What binds an env to its end and what a batched env's level reads of its envs' ends:
    the busy mark its owner sets, the counters its group reads, the gate and the relay."""

    def set_busy(self, busy: bool, count: int = 1) -> None:
        """Mark whether the collector drives the env (its owner's mark,
        :meth:`~envsync.worker.owner.Owner.marks_with`: the worker loops keep off meanwhile); with
        ``count``, the envs of ``count`` slots from this end's (a batched env's, in one write)."""

    def read_counters(self, names: Sequence[str], count: int, *, copy: bool = True) -> tuple[np.ndarray, ...]:
        """Copies of the counters ``names`` (``"target"``, ``"reached"``, ``"applied"``,
        ``"failed"``, ``"ran"``, ``"obs"``) of ``count`` slots from this end's: what a batched
        env's gate and group read of the envs under it (only the link's own methods write
        the table; nothing outside it holds its arrays). ``copy=False``: read-only views, to
        compare at once and keep nothing (a value read twice may differ between the reads)."""

    def pushed(self) -> int:
        """The latest version written to any slot of the link: it moves with every push, so
        a batched env that saw it unmoved knows no push reached its envs (one integer read)."""

    def read_stamps(self) -> tuple[int, dict[str, int]]:
        """The slot's target and the stamps of its env-state entries, read at once without
        the config (a batched level's gate: does an env's version ask anything of it?)."""

    def gated(self, *, wake_group: bool) -> End:
        """This end, for an env under a batched level: its applies are recorded as reached,
        and the batched level acknowledges them as applied once it holds them too
        (``wake_group``: wake the level's group through the slot's relay after each)."""

    def relayed(self) -> End:
        """This end, its loop waiting on the slot's relay instead of its wake-up."""

    def poke_relay(self) -> None:
        """Wake the loop that waits on the slot's relay (a batched env's group, see ``relayed``)."""


class End(ReceiverLink, Notices, Marks, Protocol):
    """An opened end: its receiver's, its loop's and its batched level's sides in one object."""


class RowsEnd(Protocol):
    """The end of the rows of one natively batched env, as its receiver
    (:class:`~envsync.worker.rows.RowsReceiver`) reads and acknowledges them: columns of rows, one
    lock and one release for all of them. Rows are given as strictly ascending int64 indices
    (found by ``flatnonzero``, or subsets of such), which a run of them turns into a slice by
    its ends alone."""

    count: int
    one_wake: bool

    @property
    def state_names(self) -> list[str]:
        """The env-state names a push may carry."""

    def targets(self) -> np.ndarray:
        """Every row's latest target version: possibly a read-only view of the live column,
        to compare or index at once, not to keep."""

    def read(self, rows: np.ndarray, since: np.ndarray, names: Sequence[str]) -> RowsHeader:
        """The header of ``rows`` (indices), with the values of the env-state ``names`` that a
        push after each row's version ``since`` stamped, read at once under the rows' lock."""

    def ack_received(self, rows: np.ndarray, versions: np.ndarray) -> None:
        """Tell the sender these rows saw these versions."""

    def ack_applied(self, rows: np.ndarray, versions: np.ndarray) -> None:
        """Tell the sender these rows run these versions (reached, under a batched level)."""

    def report_failure(self, rows: np.ndarray, versions: np.ndarray, text: str) -> None:
        """Tell the sender these rows failed these versions, with the traceback text."""

    def note_versions(self, rows: np.ndarray, ran: np.ndarray | None, obs: np.ndarray) -> None:
        """Record the version each row's next step runs under and its observation's."""

    def is_busy(self) -> bool:
        """Whether the collector drives the env now."""


class RowsRequests(Protocol):
    """The rows' gathers: which rows were asked, a row's request, one reply for many rows."""

    def asked(self) -> tuple[np.ndarray, np.ndarray]:
        """The rows with a request not answered yet, and each one's request id."""

    def request(self, row: int) -> Request | None:
        """Row ``row``'s request not answered yet, or ``None``."""

    def reply(self, rows: np.ndarray, reply: Reply) -> None:
        """Answer the request of ``rows`` (sorted) with one reply holding one row of values
        per row."""


class RowsLink(RowsEnd, RowsRequests, Protocol):
    """An opened rows end: reads and acknowledgements, and gathers."""
