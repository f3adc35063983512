"""Closed-loop curricula on exact per-frame attribution.

One call in the collection loop, ``curriculum.observe(batch)``, attributes every finished
episode to the exact config it ran under (:class:`Ledger`), lets a decision rule decide and
pushes its decision (never waiting longer than a push with ``wait="received"``). The rules:
:class:`Lessons` (ML-Agents), :class:`ADR` (DeXtreme), :class:`PLR` (prioritized level
replay) and :class:`Bandit` (UCB1, EXP3); a user's own subclasses :class:`Strategy` or
implements :class:`Curriculum`. The core ``envsync`` never imports this package.

Examples:
    >>> from envsync import EnvStateSender, curriculum
    >>> sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    >>> adr = curriculum.ADR(sender, ranges={"difficulty": (0.0, 0.25)}, bounds={"difficulty": (0.0, 5.0)},
    ...                      delta=0.25, boundary_fraction=0.4, queue=20, thresholds=(30.0, 42.0))
    >>> adr.history()[0]
    {'frames': 0, 'difficulty.low': 0.0, 'difficulty.high': 0.25}
    >>> sender.close()
"""

from envsync.curriculum.adr import ADR
from envsync.curriculum.bandit import Bandit
from envsync.curriculum.base import Curriculum, Strategy
from envsync.curriculum.ledger import Episode, Ledger, Measure
from envsync.curriculum.lessons import Lesson, Lessons
from envsync.curriculum.plot import plot
from envsync.curriculum.plr import PLR

__all__ = [
    "ADR",
    "Bandit",
    "Curriculum",
    "Episode",
    "Ledger",
    "Lesson",
    "Lessons",
    "Measure",
    "PLR",
    "Strategy",
    "plot",
]
