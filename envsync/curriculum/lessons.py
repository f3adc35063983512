"""Lessons: a sequence of configs, each left when its completion criteria are met (ML-Agents).

The rule is ML-Agents' ``CompletionCriteriaSettings.need_increment``, with its names. After
each batch that brought whole episodes of the current lesson, with ``buffer`` the measures of
the latest episodes run under the current lesson (at most the largest ``min_lesson_length``
of all lessons, as ML-Agents sizes its reward buffer; episodes of an earlier lesson still
arriving are not counted):

- fewer than ``min_lesson_length`` episodes in the buffer: stay;
- ``measure="progress"``: move on when ``frames / max_steps > threshold``;
- ``measure="reward"`` (the episode return) or the name of a ledger measure: ``m = mean(buffer)``;
  with ``signal_smoothing``, ``m = 0.25 * smoothed + 0.75 * m`` and ``smoothed = m`` (one
  smoothed value carried over the lessons, as ML-Agents keeps one per parameter); move on
  when ``m > threshold``.

Moving on pushes the next lesson's config to every env and empties the buffer. With
``require_reset`` (ML-Agents resets the env at once), the sender must use
``apply_at="truncate"``, which ends every running episode for the new lesson; otherwise each
env starts the new lesson at its next reset (``"reset"``) or at once (``"step"``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from envsync.curriculum.base import Strategy
from envsync.curriculum.ledger import Episode, Measure, NestedKey
from envsync.errors import ValidationError
from envsync.protocol import ApplyAt
from envsync.sender.sender import Sender


@dataclass(frozen=True)
class Lesson:
    """One lesson: its config and the completion criteria that end it (ignored on the last).

    Args:
        config: the template names this lesson sets, to their values.
        name: a label for the history.
        measure: ``"reward"``, ``"progress"`` or the name of one of the ledger's measures.
        threshold: the value the measure must exceed.
        min_lesson_length: how many episodes of this lesson, at least, before it may end.
        signal_smoothing: smooth the measure over checks (see the module docstring).
        require_reset: end the running episodes when the lesson ends (``"truncate"`` mode).
    """

    config: Mapping[str, Any]
    name: str = ""
    measure: str = "reward"
    threshold: float = 0.0
    min_lesson_length: int = 0
    signal_smoothing: bool = True
    require_reset: bool = False


class Lessons(Strategy):
    """ML-Agents' lessons over the whole fleet.

    Args:
        sender: the sender.
        lessons: the lessons, in order (at least one).
        max_steps: frames for ``measure="progress"`` (``progress = frames / max_steps``).
        measures: as for :class:`~envsync.curriculum.Strategy`.
        logger: as for :class:`~envsync.curriculum.Strategy`.
        wait: as for :class:`~envsync.curriculum.Strategy`.

    Attributes:
        lesson: the index of the current lesson.
        since: the version that started it (episodes of older versions are not counted).
        buffer: the measures of its latest episodes.
        smoothed: the smoothed measure.

    Examples:
        >>> from envsync import EnvStateSender
        >>> sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
        >>> lessons = Lessons(sender, [Lesson({"difficulty": 0.0}, threshold=30.0, min_lesson_length=2),
        ...                            Lesson({"difficulty": 1.0})])
        >>> lessons.lesson, lessons.history()[0]["lesson"]
        (0, 0)
        >>> sender.close()
    """

    def __init__(
        self,
        sender: Sender,
        lessons: Sequence[Lesson],
        *,
        max_steps: int | None = None,
        measures: Mapping[str, NestedKey | Measure] | None = None,
        logger: Any = None,
        wait: str | None = "received",
    ) -> None:
        super().__init__(sender, measures=measures, logger=logger, wait=wait)
        if not lessons:
            raise ValidationError("Lessons needs at least one lesson")
        for i, lesson in enumerate(lessons[:-1]):
            self._check(i, lesson, max_steps)
        self.lessons = list(lessons)
        self.max_steps = max_steps
        self.lesson = 0
        self.smoothed = 0.0
        self.buffer: deque[float] = deque(maxlen=max(1, *(ls.min_lesson_length for ls in lessons)))
        self.since = self.push(self.lessons[0].config)
        self.record(lesson=0, name=self.lessons[0].name, version=self.since)

    def _check(self, index: int, lesson: Lesson, max_steps: int | None) -> None:
        known = {"reward", "progress", *self.ledger.measures}
        if lesson.measure not in known:
            raise ValidationError(f"lesson {index}: measure={lesson.measure!r}; expected one of {sorted(known)}")
        if lesson.measure == "progress" and not max_steps:
            raise ValidationError(f"lesson {index}: measure='progress' needs max_steps")
        if lesson.require_reset and self.sender.spec.apply_at is not ApplyAt.TRUNCATE:
            raise ValidationError(
                f"lesson {index}: require_reset ends the running episodes: build the sender with apply_at='truncate'"
            )

    def update(self, episodes: list[Episode]) -> None:
        """Count this lesson's whole episodes; move on if the criteria are met."""
        lesson = self.lessons[self.lesson]
        counted = 0
        for episode in episodes:
            if episode.whole and episode.version >= self.since:
                named = lesson.measure not in ("reward", "progress")
                self.buffer.append(episode.measures[lesson.measure] if named else episode.episode_return)
                counted += 1
        if not counted or self.lesson + 1 == len(self.lessons):
            return
        measure = self._measure(lesson)
        self.record(lesson=self.lesson, measure=measure, episodes=len(self.buffer))
        if measure is not None and measure > lesson.threshold:
            self.lesson += 1
            self.buffer.clear()
            self.since = self.push(self.lessons[self.lesson].config)
            self.record(lesson=self.lesson, name=self.lessons[self.lesson].name, version=self.since)

    def _measure(self, lesson: Lesson) -> float | None:
        """The value compared with the threshold, or ``None`` before ``min_lesson_length``."""
        if len(self.buffer) < lesson.min_lesson_length:
            return None
        if lesson.measure == "progress":
            return self.ledger.frames / (self.max_steps or 1)
        measure = sum(self.buffer) / len(self.buffer)
        if lesson.signal_smoothing:
            measure = 0.25 * self.smoothed + 0.75 * measure
            self.smoothed = measure
        return measure

    def state_dict(self) -> dict[str, Any]:
        """The lesson, its buffer, the smoothed measure and the history."""
        return {**super().state_dict(), "lesson": self.lesson, "buffer": list(self.buffer), "smoothed": self.smoothed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume the lesson and its progress; pushes the lesson's config (a new version)."""
        super().load_state_dict(state)
        self.lesson = int(state["lesson"])
        self.smoothed = float(state["smoothed"])
        self.buffer.clear()
        self.buffer.extend(state["buffer"])
        self.since = self.push(self.lessons[self.lesson].config)
