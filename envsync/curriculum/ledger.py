"""Attribution: collected batches in, finished episodes out, each with the exact config it ran.

A frame names its env (``("next", "env_index")``) and the version its step ran under
(``("next", "env_version")``); the sender names the config of each ``(env, version)``
(:meth:`~envsync.sender.sender.Sender.config_at`). The :class:`Ledger` cuts each env's frames into
pieces at episode ends (``("next", "done")``) and at version changes, sums rewards and
reduces the user's measures over each piece with array operations (no Python loop over
frames), and carries the piece still running at the end of a batch into the next batch of
that env. Each env's frames come from one worker, whose batches arrive in order, so batches
of different workers may interleave in any order.

In ``"reset"`` mode (and ``"truncate"``, which ends the episode) a version changes only at an
episode's start, so every piece is a whole episode. In ``"step"`` mode a config may change
mid-episode: each piece is then credited to its own config and marked ``whole=False``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from envsync.errors import ValidationError
from envsync.sender.sender import Sender

NestedKey = str | tuple[str, ...]
REDUCTIONS = ("last", "first", "sum", "mean", "max", "min")
TAGS = (("next", "env_index"), ("next", "env_version"), ("next", "done"), ("next", "reward"))


@dataclass(frozen=True)
class Measure:
    """A per-episode measure: a key of the batch (one number per frame) and how its frames
    reduce to one number (``"last"``, ``"first"``, ``"sum"``, ``"mean"``, ``"max"``, ``"min"``).

    Examples:
        >>> Measure(("next", "success"), "max")
        Measure(key=('next', 'success'), reduce='max')
    """

    key: NestedKey
    reduce: str = "last"

    def __post_init__(self) -> None:
        if self.reduce not in REDUCTIONS:
            raise ValidationError(f"Measure reduce={self.reduce!r}; expected one of {list(REDUCTIONS)}")


@dataclass(frozen=True)
class Episode:
    """One finished episode (or, in ``"step"`` mode, one piece of it under one config).

    Args:
        env: the fleet index of the env that ran it.
        version: the version it ran under.
        config: the exact config it ran under (a ``TensorDict`` shaped like the template,
            one for all the records of that env and version: read it, do not write into it).
        episode_return: the sum of its rewards.
        length: its number of steps.
        measures: the user's measures, by name.
        whole: ``False`` for a piece of an episode whose config changed mid-way (``"step"``
            mode), or one the ledger did not see start.
    """

    env: int
    version: int
    config: TensorDict
    episode_return: float
    length: int
    measures: dict[str, float] = field(default_factory=dict)
    whole: bool = True


class _Piece(NamedTuple):
    """A run of one env's frames under one version, within one episode (``"mean"`` measures
    still as sums)."""

    env: int
    version: int
    episode_return: float
    length: int
    values: dict[str, float]
    whole: bool

    def then(self, later: _Piece, reductions: Mapping[str, str]) -> _Piece:
        """This piece followed by ``later`` (same env, same version, same episode)."""
        merged = {}
        for name, how in reductions.items():
            a, b = self.values[name], later.values[name]
            merged[name] = {"first": a, "last": b, "max": max(a, b), "min": min(a, b)}.get(how, a + b)
        total = self.episode_return + later.episode_return
        return _Piece(self.env, self.version, total, self.length + later.length, merged, self.whole)

    def finished(self, config: TensorDict, means: Sequence[str]) -> Episode:
        """The record of this piece (the running sums of the ``means`` become means)."""
        values = self.values
        if means:
            values = {n: v / self.length if n in means else v for n, v in values.items()}
        return Episode(self.env, self.version, config, self.episode_return, self.length, values, self.whole)


class Ledger:
    """Turns collected batches into finished-episode records with their exact configs.

    Give it every batch of the collector(s) attached to ``sender`` from the first, in the
    order they come (batches of different workers may interleave): the first frame it sees
    of an env is taken as the start of an episode.

    Args:
        sender: the sender whose collectors produce the batches.
        measures: per-episode measures by name: a key of the batch (its value at the
            episode's last frame) or a :class:`Measure`.

    Examples:
        >>> from torchrl.collectors import Collector
        >>> from envsync import EnvStateSender
        >>> from envsync.envs import make_drift_env
        >>> sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
        >>> collector = Collector(sender.env_fn(make_drift_env), None, frames_per_batch=100, total_frames=-1,
        ...                       weight_sync_schemes=sender.schemes())
        >>> ledger = Ledger(sender, measures={"fell": Measure(("next", "terminated"), "max")})
        >>> episodes = ledger.observe(next(iter(collector)))
        >>> len(episodes) >= 2, episodes[0].env, episodes[0].version, episodes[0].length <= 50
        (True, 0, 0, True)
        >>> episodes[0].config["difficulty"].item(), episodes[0].measures["fell"] in (0.0, 1.0)
        (0.0, True)
        >>> collector.shutdown(); sender.close()
    """

    def __init__(self, sender: Sender, *, measures: Mapping[str, NestedKey | Measure] | None = None) -> None:
        self.sender = sender
        self.measures = {name: m if isinstance(m, Measure) else Measure(m) for name, m in (measures or {}).items()}
        self._means = [name for name, m in self.measures.items() if m.reduce == "mean"]
        self.latest: dict[int, int] = {}
        """Per env: the version of the newest frame seen (an env's versions never go back)."""
        self.frames = 0
        self._open: dict[int, _Piece] = {}
        self._configs: dict[int, tuple[int, TensorDict]] = {}

    def observe(self, batch: TensorDictBase) -> list[Episode]:
        """Take one batch; return the episodes (pieces) that ended in it, env by env, in order.

        Raises:
            ValidationError: the batch lacks envsync's tags or a measure's key, or a measure
                has more than one number per frame.
        """
        cuts = _Cuts.of(batch, self.measures)
        self.frames += batch.batch_size.numel()
        if cuts is None:
            return []
        episodes = [p.finished(self._config(p.env, p.version), self._means) for p in cuts.pieces(self._open)]
        self.latest.update(zip(cuts.envs, cuts.versions, strict=True))  # an env's last piece comes last
        return episodes

    def _config(self, env: int, version: int) -> TensorDict:
        """The config of ``(env, version)``, looked up once: an env's newest version seen is
        kept, as its episodes under that version often end in the next batch."""
        kept = self._configs.get(env)
        if kept is not None and kept[0] == version:
            return kept[1]
        config = self.sender.config_at(env, version)
        if kept is None or kept[0] < version:
            self._configs[env] = (version, config)
        return config


class _Cuts:
    """One batch's frames, sorted by env (stable: each env's frames stay in time order),
    cut into pieces at episode ends and version changes, each reduced over the batch's
    columns as numpy arrays; each piece's env, version, return, length and measures then as
    Python lists.

    numpy, not torch: the columns are views of the batch's CPU tensors, and each of the
    dozen small operations here costs a numpy call's microsecond, where a torch call costs
    several (more under intra-op threads on a loaded machine). Sums go through
    ``np.bincount``, which adds each piece's frames one by one in time order.
    """

    def __init__(self, env: np.ndarray, version: np.ndarray, done: np.ndarray, reward: np.ndarray) -> None:
        n = env.size
        start = np.empty(n + 1, dtype=bool)  # and one past the end, so that every piece has its bounds
        start[0] = start[n] = True
        np.not_equal(env[1:], env[:-1], out=start[1:n])
        start[1:n] |= version[1:] != version[:-1]
        start[1:n] |= done[:-1]
        bounds = np.flatnonzero(start)
        self.starts, self.lasts = bounds[:-1], bounds[1:] - 1
        self.count = self.starts.size
        self.segment = np.cumsum(start[:n]) - 1
        lengths = bounds[1:] - self.starts
        self.envs: list[int] = env[self.starts].tolist()
        self.versions: list[int] = version[self.starts].tolist()
        self.ended: list[bool] = done[self.lasts].tolist()
        self.returns: list[float] = self._sums(reward).tolist()
        self.lengths: list[int] = lengths.tolist()
        self.values: dict[str, list[float]] = {}
        self.reductions: dict[str, str] = {}

    @classmethod
    def of(cls, batch: TensorDictBase, measures: Mapping[str, Measure]) -> _Cuts | None:
        n = batch.batch_size.numel()
        if n == 0:
            return None
        keys = [*TAGS, *(m.key for m in measures.values())]
        found = [batch.get(key, None) for key in keys]
        for key, value in zip(keys, found, strict=True):
            if value is None:
                raise ValidationError(
                    f"the batch has no {key!r}: build the collector with sender.env_fn(...) and "
                    f"weight_sync_schemes=sender.schemes(), and name measures by keys of the batch"
                )
        env, version, done, reward = (_columns(value, n) for value in found[: len(TAGS)])
        env = env[:, 0]
        # a collector gives each env's frames in a row: the frames are most often sorted already
        order = None if bool((env[1:] >= env[:-1]).all()) else np.argsort(env, kind="stable")

        def sort(frames: np.ndarray) -> np.ndarray:
            return frames if order is None else frames[order]

        cuts = cls(
            sort(env),
            sort(version[:, 0]),
            sort(np.logical_or.reduce(done, axis=1)),
            sort(reward[:, 0] if reward.shape[1] == 1 else reward.sum(1)),
        )
        for (name, measure), value in zip(measures.items(), found[len(TAGS) :], strict=True):
            values = _columns(value, n)
            if values.shape[1] != 1:
                count = values.shape[1]
                raise ValidationError(f"measure {name!r}: {measure.key!r} has {count} numbers per frame, not 1")
            cuts.reduce(name, measure.reduce, sort(values[:, 0]))
        return cuts

    def _sums(self, values: np.ndarray) -> np.ndarray:
        return np.bincount(self.segment, weights=values, minlength=self.count)

    def reduce(self, name: str, how: str, values: np.ndarray) -> None:
        """Reduce ``values`` over each piece; ``"mean"`` is kept as a sum until the piece ends."""
        if how == "first":
            out = values[self.starts]
        elif how == "last":
            out = values[self.lasts]
        elif how in ("sum", "mean"):
            out = self._sums(values)
        else:
            out = (np.maximum if how == "max" else np.minimum).reduceat(values, self.starts)
        self.values[name] = out.astype(np.float64, copy=False).tolist()
        self.reductions[name] = how

    def pieces(self, running: dict[int, _Piece]) -> list[_Piece]:
        """The pieces that ended in this batch; ``running`` (per env, the piece still running)
        is merged into each env's first piece and replaced by its last one."""
        envs, ended, reductions = self.envs, self.ended, self.reductions
        out: list[_Piece] = []
        for i, env in enumerate(envs):
            values = {name: v[i] for name, v in self.values.items()}
            # a piece after another of its env starts after a done or a version change (mid-episode)
            piece = _Piece(env, self.versions[i], self.returns[i], self.lengths[i], values, i > 0 and ended[i - 1])
            if i == 0 or envs[i - 1] != env:
                piece = _continued(running.pop(env, None), piece, reductions, out)
            if ended[i]:
                out.append(piece)
            elif i + 1 == len(envs) or envs[i + 1] != env:
                running[env] = piece
            else:  # cut by a version change mid-episode ("step" mode)
                out.append(piece._replace(whole=False))
        return out


def _columns(value: torch.Tensor, n: int) -> np.ndarray:
    """A batch entry as ``n`` rows of numbers: a view of a CPU tensor's memory (a copy of
    another device's, and of a dtype numpy lacks as float64)."""
    try:
        rows = value.numpy(force=True)
    except TypeError:  # bfloat16 and the like
        rows = value.detach().to("cpu", torch.float64).numpy()
    return rows.reshape(n, -1)


def _continued(before: _Piece | None, piece: _Piece, reductions: Mapping[str, str], out: list[_Piece]) -> _Piece:
    """An env's first piece in a batch: it continues the piece the env left running, if any."""
    if before is None:  # a new episode (an env first seen is taken to start one)
        return piece._replace(whole=True)
    if before.version != piece.version:
        out.append(before._replace(whole=False))
        return piece._replace(whole=False)
    return before.then(piece, reductions)
