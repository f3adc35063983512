"""Adapters to collector frameworks; ``torchrl`` is the only one that knows torchrl internals."""
