"""A picture of a curriculum's history: ADR's ranges, the lesson, PLR's scores, the arm counts.

Drawn with matplotlib when it is installed; :func:`plot` returns ``False`` (and draws
nothing) when it is not, so a training script can always call it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from envsync.curriculum.adr import ADR
from envsync.curriculum.bandit import Bandit
from envsync.curriculum.base import Curriculum
from envsync.curriculum.lessons import Lessons
from envsync.curriculum.plr import PLR


def plot(curriculum: Curriculum, path: str | Path, *, title: str | None = None) -> bool:
    """Draw ``curriculum.history()`` into an image file; return whether matplotlib drew it.

    Examples:
        >>> from envsync import EnvStateSender
        >>> from envsync.curriculum import ADR
        >>> sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
        >>> adr = ADR(sender, ranges={"difficulty": (0.0, 0.25)}, queue=1, thresholds=(0.0, 0.5))
        >>> adr.credit(("difficulty", 1), 1.0)
        >>> import tempfile, os
        >>> with tempfile.TemporaryDirectory() as d:
        ...     drawn = plot(adr, os.path.join(d, "adr.png"))
        ...     drawn == os.path.exists(os.path.join(d, "adr.png"))
        True
        >>> sender.close()
    """
    if importlib.util.find_spec("matplotlib") is None:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = curriculum.history()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if isinstance(curriculum, ADR):
        _ranges(ax, curriculum, records)
    elif isinstance(curriculum, Lessons):
        _steps(ax, records, "lesson")
    elif isinstance(curriculum, PLR):
        scores = records[-1]["scores"] if records else []
        ax.bar(range(len(scores)), scores)
        ax.set_xlabel("level")
        ax.set_ylabel("score")
    elif isinstance(curriculum, Bandit):
        counts = records[-1]["counts"] if records else []
        ax.bar(range(len(counts)), counts)
        ax.set_xlabel("arm")
        ax.set_ylabel("rewarded episodes")
    else:
        for name in sorted({k for r in records for k, v in r.items() if _number(v) and k != "frames"}):
            _steps(ax, records, name)
        ax.legend()
    ax.set_title(title or type(curriculum).__name__)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _ranges(ax: Any, adr: ADR, records: list[dict[str, Any]]) -> None:
    for name in adr.names:
        frames = [r["frames"] for r in records if f"{name}.low" in r]
        low = [r[f"{name}.low"] for r in records if f"{name}.low" in r]
        high = [r[f"{name}.high"] for r in records if f"{name}.high" in r]
        frames.append(adr.ledger.frames)
        low.append(low[-1])
        high.append(high[-1])
        ax.fill_between(frames, low, high, step="post", alpha=0.3, label=name)
    ax.set_xlabel("frames")
    ax.set_ylabel("range")
    ax.legend()


def _steps(ax: Any, records: list[dict[str, Any]], name: str) -> None:
    points = [(r["frames"], r[name]) for r in records if _number(r.get(name))]
    if points:
        ax.step(*zip(*points, strict=True), where="post", label=name)
    ax.set_xlabel("frames")
    ax.set_ylabel(name)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
