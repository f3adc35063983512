"""A scripted in-process link: the workers are a function, for tests of the sender's rules.

As httpx's ``MockTransport`` tests a client without a network, :class:`ScriptedLink` tests
acknowledgements, rollback, gather and checkpoints without processes or envs: every time the
sender notifies a worker, the link calls ``script(end)`` on that worker's receiver end
(:class:`~envsync.links.slot_reader.SlotReader`), synchronously, and the script answers as a
worker would (``end.ack_applied(end.target())``, ``end.report_failure(...)``,
``end.reply(Reply(...))``) or stays silent. The slot table underneath is the
in-process link's, so what the sender reads is exactly what a real worker would have written.

Examples:
    >>> import torch
    >>> from envsync.sender.sender import Sender
    >>> sender = Sender(config={"x": 0.0})
    >>> _ = sender.port.attach(2, lambda leaves: ScriptedLink(leaves, 2, applies), detached=lambda: False)
    >>> sender.push(config={"x": 1.0}, wait="applied"), sender.versions()
    (1, [1, 1])
    >>> sender.close()
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from envsync.links.base import Key
from envsync.links.local import LocalLink
from envsync.links.slot_reader import SlotReader
from envsync.protocol import Kind, Reply
from envsync.state import Leaf

Script = Callable[[SlotReader], None]
"""What a worker does when the sender notifies it, given its receiver end."""


def applies(end: SlotReader) -> None:
    """A worker that applies every version at once and answers every gather with the
    current values of its slot (the desired env state)."""
    target = end.target()
    if target > int(end.table.counters["applied"][end.worker]):
        end.ack_applied(target)
    answers(end)


def answers(end: SlotReader) -> None:
    """Answer a pending request for env-state entries with the desired values of the names
    asked for (what a worker that applied its target holds); a scripted worker holds no env,
    so a request of any other kind is answered with a failure that says so."""
    request = end.request()
    if request is None:
        return
    if request.kind not in (Kind.ENV_STATE, Kind.BATCHED_STATE):
        end.reply(Reply(request.id, {}, f"a scripted worker holds no env to answer {request.kind.name}"))
        return
    values: dict[str, torch.Tensor] = {}
    end.load_entries(end.target(), request.payload["names"], lambda name, view: values.update({name: view.clone()}))
    end.reply(Reply(request.id, values))


def refuses(error: Exception) -> Script:
    """A worker that applies every version but fails to answer requests with ``error``."""

    def script(end: SlotReader) -> None:
        target = end.target()
        if target > int(end.table.counters["applied"][end.worker]):
            end.ack_applied(target)
        request = end.request()
        if request is not None:
            end.reply(Reply(request.id, {}, "".join(traceback.format_exception(error))))

    return script


class ScriptedLink(LocalLink):
    """The in-process link, with a script in place of each worker.

    Args:
        leaves: one worker's starting leaves (they fix the layout).
        num_workers: how many scripted workers.
        script: called with a worker's end each time the sender notifies that worker.
        alive: tells whether a worker can still answer.
    """

    def __init__(
        self,
        leaves: Mapping[Key, Leaf],
        num_workers: int,
        script: Script = applies,
        *,
        alive: Callable[[int], bool] = lambda w: True,
    ) -> None:
        super().__init__(leaves, num_workers, alive=alive)
        self.script = script
        self.ends = [self.handle().open(w) for w in range(num_workers)]

    def notify(self, workers: Sequence[int] | np.ndarray, *, here: bool = False) -> None:
        for worker in np.asarray(workers).tolist():
            self.script(self.ends[worker])
