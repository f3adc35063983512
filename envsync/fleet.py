"""The fleet: every worker of every collector attached to one sender, numbered in attach
order (collector 0's workers first). Indices never shift while the sender lives: a
collector that shuts down leaves holes, and only when no collector is left does numbering
start again at 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from envsync.errors import ValidationError
from envsync.links.base import Flat, SenderLink


@dataclass(eq=False)
class Attachment:
    """One collector attached to a sender, made by an integration.

    Args:
        link: the link to the collector's workers.
        detached: tells whether the collector has been shut down.
        on_close: run when the attachment ends (e.g. stop an in-process receiver).
        envs_per_worker: how many envs each worker drives.
        collectors: how many workers each collector behind the link has, in order (a
            ``RayCollector`` is one attachment over several remote collectors); ``None``:
            one collector with every worker of the link.
    """

    link: SenderLink
    detached: Callable[[], bool]
    on_close: Callable[[], None] = lambda: None
    envs_per_worker: int = 1
    collectors: Sequence[int] | None = None
    offset: int = 0
    index: int = 0
    mirrors: list[Flat] = field(default_factory=list)


@dataclass(frozen=True)
class Member:
    """One worker of the fleet, as :meth:`~envsync.EnvStateSender.fleet` describes it.

    Args:
        index: the fleet index.
        collector: the collector's number, in attach order.
        worker: the worker's index within its collector.
        envs: how many envs the worker drives.
    """

    index: int
    collector: int
    worker: int
    envs: int


class Fleet:
    """The live attachments of a sender, and the map from fleet index to link and worker."""

    def __init__(self) -> None:
        self.attachments: list[Attachment] = []
        self._next_offset = 0
        self._next_collector = 0

    def add(self, attachment: Attachment, start: Flat) -> None:
        """Number the attachment's workers after every earlier one; mirror ``start``."""
        if not self.attachments:
            self._next_offset = 0
            self._next_collector = 0
        attachment.offset = self._next_offset
        attachment.index = self._next_collector
        attachment.mirrors = [dict(start) for _ in range(attachment.link.num_workers)]
        self._next_offset += attachment.link.num_workers
        self._next_collector += len(attachment.collectors or [attachment.link.num_workers])
        self.attachments.append(attachment)

    def prune(self) -> list[Attachment]:
        """Drop the attachments whose collector shut down; return them."""
        gone = [a for a in self.attachments if a.detached()]
        for attachment in gone:
            self.attachments.remove(attachment)
        return gone

    def indices(self) -> list[int]:
        """The fleet indices of every live worker, in order."""
        return [a.offset + w for a in self.attachments for w in range(a.link.num_workers)]

    def locate(self, index: int) -> tuple[Attachment, int]:
        """The attachment and local worker of fleet index ``index``."""
        for attachment in self.attachments:
            if attachment.offset <= index < attachment.offset + attachment.link.num_workers:
                return attachment, index - attachment.offset
        raise KeyError(index)

    def members(self) -> list[Member]:
        out = []
        for a in self.attachments:
            index = a.offset
            for collector, count in enumerate(a.collectors or [a.link.num_workers]):
                for worker in range(count):
                    member = Member(index=index, collector=a.index + collector, worker=worker, envs=a.envs_per_worker)
                    out.append(member)
                    index += 1
        return out

    def targets(self, workers: Sequence[int] | None) -> list[int]:
        """Validate ``workers`` against the live fleet (default: every live worker)."""
        live = self.indices()
        if workers is None:
            return live
        if not self.attachments:
            raise ValidationError("workers= needs an attached collector; none is attached")
        chosen: list[int] = []
        for worker in workers:
            if not isinstance(worker, int) or isinstance(worker, bool) or worker not in live:
                raise ValidationError(f"worker {worker!r} does not exist; workers are {_ranges(live)}")
            if worker not in chosen:
                chosen.append(worker)
        return chosen


def _ranges(indices: list[int]) -> str:
    if indices and indices == list(range(indices[0], indices[-1] + 1)):
        return f"{indices[0]}..{indices[-1]}"
    return str(indices)
