"""How desired state and acknowledgements move between the main process and the workers."""

from envsync.transports.base import ReceiverEnd, SenderEnd
from envsync.transports.shared_memory import SharedMemoryChannel, SharedMemoryHandle

__all__ = ["ReceiverEnd", "SenderEnd", "SharedMemoryChannel", "SharedMemoryHandle"]
