"""Idle listeners: one thread per link end that waits for the sender's wake-up (or half a
second) and calls its owner (a receiver, or a batched env's group), so that a worker whose
collector is idle still applies ``"step"`` and ``"truncate"`` versions and answers gathers.

A listener holds its owner by weakref and ends with it, when the owner is ``closed``, or
when the interpreter shuts down (:mod:`envsync.shutdown`). It is the only place that
notices a dead sender: torchrl's workers never notice a killed main process, so a listener
whose sender is gone ends the worker.
"""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
import weakref
from collections.abc import Callable
from typing import Any

from envsync.links.base import ReceiverLink
from envsync.shutdown import EXITING, on_shutdown

_LISTEN_PERIOD = 0.5
"""Longest wait for a wake-up before the sender's liveness is checked."""

_LISTENERS: dict[threading.Thread, ReceiverLink] = {}
"""This process's running idle listeners, each with the link end it waits on."""
os.register_at_fork(after_in_child=_LISTENERS.clear)  # a forked worker has none of its parent's


def start_listener(owner: Any, link: ReceiverLink, wake: Callable[[Any], None], *, name: str) -> None:
    """Start an idle listener for ``owner`` (a receiver, or a batched env's group) on one
    link end: a thread that waits for a wake-up (or half a second) and calls
    ``wake(owner)``. It holds ``owner`` by weakref and ends with it (or when it is ``closed``,
    or when the interpreter shuts down: :mod:`envsync.shutdown`). An error that escapes
    ``wake`` (applies and gather answers report their own) is reported as a failure of the
    target version (and passed to the owner's ``note_failed``); the listener never dies of one."""
    thread = threading.Thread(target=_listen, args=(weakref.ref(owner), link, wake), name=name)
    _LISTENERS[thread] = link
    thread.start()


def _listen(ref: weakref.ReferenceType[Any], link: ReceiverLink, wake: Callable[[Any], None]) -> None:
    try:
        _serve(ref, link, wake)
    finally:
        _LISTENERS.pop(threading.current_thread(), None)


def _serve(ref: weakref.ReferenceType[Any], link: ReceiverLink, wake: Callable[[Any], None]) -> None:
    while True:
        owner = ref()
        if owner is None or owner.closed or EXITING.is_set():
            return
        del owner
        # a wake-up proves the sender alive: its liveness (a syscall and a /proc read) is
        # checked only after a quiet period
        if not link.wait_notice(_LISTEN_PERIOD) and not link.owner_alive():
            # torchrl's workers never notice a killed main process (they hold its pipe
            # ends themselves and wait forever): without a sender, end the worker
            os._exit(1)
        owner = ref()
        if owner is None or owner.closed or EXITING.is_set():
            return
        try:
            wake(owner)
        except Exception:
            target = link.target()
            owner.note_failed(target)
            link.report_failure(target, traceback.format_exc())
        del owner


def _wake_listeners() -> None:
    """Wake this process's listeners when the interpreter shuts down, so that each ends at
    once (or after its current apply) instead of after a listen period."""
    for link in list(_LISTENERS.values()):
        with contextlib.suppress(Exception):
            link.poke()


on_shutdown(_wake_listeners)
