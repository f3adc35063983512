"""Closed-loop curricula on exact per-frame attribution (the core ``envsync`` never imports this)."""

from envsync.curriculum.ledger import Episode, Ledger, Measure

__all__ = ["Episode", "Ledger", "Measure"]
