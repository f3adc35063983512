"""Python's cyclic garbage collector held off while one batch's episodes are made and decided.

A batch of thousands of worlds ends thousands of episodes, and each is a few Python objects
(its :class:`~envsync.curriculum.Episode`, its measures, its place in the config history, a
strategy's note of what it gave the env). Every 700 such allocations start a collection of
the young objects, every tenth of those a collection of the older ones, and the episodes
alive at each are promoted until a full collection walks every object of the process
(torch's and torchrl's, hundreds of thousands): with 50-step episodes that doubled the mean
cost of ``Strategy.observe`` at 4,096 and at 65,536 worlds.

Held off for one batch (:meth:`~envsync.curriculum.Ledger.observe`, and a strategy's
``observe``: the ledger, its rule and the rule's push, whose wait is bounded by its timeout),
the young objects are collected once afterwards, when the episodes of the batch before are
already freed by their reference counts. Nothing is left uncollected: the collector runs at
the next allocation after the batch. If another thread turns the collector off meanwhile, it
is back on after the batch (``gc.isenabled()`` is one flag for the whole process).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collections_deferred() -> Iterator[None]:
    """Hold off the cyclic collector inside the block (left as found if it was off).

    Examples:
        >>> import gc
        >>> with collections_deferred():
        ...     gc.isenabled()
        False
        >>> gc.isenabled()
        True
    """
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
