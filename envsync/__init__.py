"""envsync: change environments inside running torchrl collectors, without a restart.

The public names are imported on first use, so that a process importing one light module
(the Ray mailbox actor, :mod:`envsync.links.mailbox`) does not import torch and torchrl.

Examples:
    >>> import envsync
    >>> sender = envsync.EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    >>> sender.version
    0
    >>> sender.close()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from envsync import apply as apply  # the module: envsync.apply.attributes(), .rebuild()
    from envsync.errors import AckTimeout, EnvSyncError, GatherError, ValidationError, WireError, WorkerApplyError
    from envsync.integrations.torchrl import EnvStateSender
    from envsync.worker.receiver import EnvStateReceiver

__all__ = [
    "AckTimeout",
    "EnvStateReceiver",
    "EnvStateSender",
    "EnvSyncError",
    "GatherError",
    "ValidationError",
    "WireError",
    "WorkerApplyError",
]
__version__ = "0.1.0"

_HOMES = {
    "AckTimeout": "envsync.errors",
    "EnvSyncError": "envsync.errors",
    "GatherError": "envsync.errors",
    "ValidationError": "envsync.errors",
    "WireError": "envsync.errors",
    "WorkerApplyError": "envsync.errors",
    "EnvStateSender": "envsync.integrations.torchrl",
    "EnvStateReceiver": "envsync.worker.receiver",
}


def __getattr__(name: str) -> Any:
    if name == "apply":
        return importlib.import_module("envsync.apply")
    if name not in _HOMES:
        raise AttributeError(f"module 'envsync' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*__all__, "apply", "__version__"])
