"""envsync: change environments inside running torchrl collectors, without a restart.

Examples:
    >>> import envsync
    >>> sender = envsync.EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    >>> sender.version
    0
    >>> sender.close()
"""

from envsync import apply as apply  # the module: envsync.apply.attributes(), .rebuild()
from envsync.errors import AckTimeout, EnvSyncError, ValidationError, WorkerApplyError
from envsync.integrations.torchrl import EnvStateSender
from envsync.receiver import EnvStateReceiver

__all__ = [
    "AckTimeout",
    "EnvStateReceiver",
    "EnvStateSender",
    "EnvSyncError",
    "ValidationError",
    "WorkerApplyError",
]
__version__ = "0.1.0"
