"""The interpreter's shutdown, as envsync's own threads see it.

envsync's long-lived threads (the worker loops, the Ray link's reading
thread in the main process) are not daemon threads. A daemon thread still running when the
interpreter finalises is stopped where it stands, and one stopped while it frees a tensor
aborts the whole process ("terminate called without an active exception": libtorch cannot
unwind through that). Instead, each such thread watches :data:`EXITING` and ends once it is
set; the interpreter sets it when it starts to shut down (``threading``'s own exit hook, the
one ``concurrent.futures`` uses), before it waits for its non-daemon threads, so every one of
them has ended before finalisation.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

EXITING = threading.Event()
"""Set when the interpreter starts to shut down."""
threading._register_atexit(EXITING.set)  # type: ignore[attr-defined]


def on_shutdown(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the interpreter starts to shut down, :data:`EXITING` already set
    (to wake threads that would otherwise wait a while before they look at it).

    Examples:
        >>> on_shutdown(lambda: None)
    """

    def run() -> None:
        EXITING.set()
        callback()

    threading._register_atexit(run)  # type: ignore[attr-defined]
