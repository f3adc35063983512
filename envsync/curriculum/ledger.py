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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from tensordict import TensorDictBase

from envsync.curriculum.columns import OpenPieces, VersionColumn
from envsync.curriculum.heap import collections_deferred
from envsync.errors import ValidationError
from envsync.sender.history import Entry
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


class Episode:
    """One finished episode (or, in ``"step"`` mode, one piece of it under one config).

    Args:
        env: the fleet index of the env that ran it.
        version: the version it ran under.
        config: the exact config it ran under (a ``TensorDict`` shaped like the template:
            read it, do not write into it). The ledger gives where the config history holds
            it (an :class:`~envsync.sender.history.Entry`), made into that ``TensorDict`` when
            first read: most strategies never read it, and at 25,000 episodes a batch making
            each one cost more than the batch.
        episode_return: the sum of its rewards.
        length: its number of steps.
        measures: the user's measures, by name.
        whole: ``False`` for a piece of an episode whose config changed mid-way (``"step"``
            mode), or one the ledger did not see start.
    """

    __slots__ = ("env", "version", "_config", "episode_return", "length", "measures", "whole")

    def __init__(
        self,
        env: int,
        version: int,
        config: TensorDictBase | Entry,
        episode_return: float,
        length: int,
        measures: dict[str, float] | None = None,
        whole: bool = True,
    ) -> None:
        self.env, self.version, self._config = env, version, config
        self.episode_return, self.length = episode_return, length
        self.measures = {} if measures is None else measures
        self.whole = whole

    @property
    def config(self) -> TensorDictBase:
        """The exact config it ran under (a ``TensorDict`` shaped like the template)."""
        if isinstance(self._config, Entry):
            self._config = self._config.config()
        return self._config

    def __repr__(self) -> str:
        return (
            f"Episode(env={self.env}, version={self.version}, episode_return={self.episode_return}, "
            f"length={self.length}, measures={self.measures}, whole={self.whole})"
        )


class _Ended(NamedTuple):
    """The pieces that ended in one batch, env by env, in order, as one list per column
    (``"mean"`` measures still as sums): no object per piece until its record is made."""

    env: list[int]
    version: list[int]
    returns: list[float]
    lengths: list[int]
    whole: list[bool]
    values: dict[str, list[float]]


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
        self._latest = VersionColumn()
        """Per env: the version of the newest frame seen (versions never go back)."""
        self.frames = 0
        self._open = OpenPieces()

    def observe(self, batch: TensorDictBase) -> list[Episode]:
        """Take one batch; return the episodes (pieces) that ended in it, env by env, in order.

        Raises:
            ValidationError: the batch lacks envsync's tags or a measure's key, or a measure
                has more than one number per frame.
        """
        with collections_deferred():  # an episode is a few objects, thousands a batch (see .heap)
            return self._observe(batch)

    def _observe(self, batch: TensorDictBase) -> list[Episode]:
        cuts = _Cuts.of(batch, self.measures)
        self.frames += batch.batch_size.numel()
        if cuts is None:
            return []
        ended = cuts.pieces(self._open)
        entry = self.sender.config_history.entry  # where each (env, version) config is kept
        values = {  # the running sums of the "mean" measures become means
            k: [x / n for x, n in zip(v, ended.lengths, strict=True)] if k in self._means else v
            for k, v in ended.values.items()
        }
        names = list(values)
        if names:
            measured = [dict(zip(names, m, strict=True)) for m in zip(*values.values(), strict=True)]
        else:
            measured = [{} for _ in ended.env]
        columns = zip(ended.env, ended.version, ended.returns, ended.lengths, ended.whole, measured, strict=True)
        episodes = [Episode(e, v, entry(e, v), r, n, d, w) for e, v, r, n, w, d in columns]
        self._latest.raise_to(cuts.env, cuts.version)
        return episodes

    @property
    def latest(self) -> dict[int, int]:
        """Per env seen: the version of its newest frame (an env's versions never go back)."""
        return self._latest.as_dict()

    def latest_of(self, envs: np.ndarray) -> np.ndarray:
        """The version of each of ``envs``' newest frame seen, -1 for an env not seen yet."""
        return self._latest.of(envs)


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
        self.env = env[self.starts]  # per piece, as columns
        self.version = version[self.starts]
        self.ended = done[self.lasts]
        self.returns = self._sums(reward)
        self.lengths = bounds[1:] - self.starts
        self.values: dict[str, np.ndarray] = {}
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
        self.values[name] = out.astype(np.float64)
        self.reductions[name] = how

    def pieces(self, running: OpenPieces) -> _Ended:
        """The pieces that ended in this batch, env by env, in order; ``running`` (per env, the
        piece it left running) is merged into each env's first piece and replaced by its last
        one. By vector ops over the pieces, handed back as lists."""
        env, version, ended = self.env, self.version, self.ended
        returns, lengths = self.returns.copy(), self.lengths.copy()
        values = {name: v.copy() for name, v in self.values.items()}
        count = self.count
        first = np.ones(count, dtype=bool)
        first[1:] = env[1:] != env[:-1]
        last = np.ones(count, dtype=bool)
        last[:-1] = first[1:]
        # a piece after another of its env starts after a done or a version change (mid-episode)
        whole = np.zeros(count, dtype=bool)
        whole[1:] = ended[:-1]
        heads = np.flatnonzero(first)
        kept = running.take(env[heads])  # each env's running piece, taken out (None: none ran)
        if kept is None:  # a new episode (an env first seen is taken to start one)
            whole[heads] = True
            broken = np.zeros(0, dtype=np.int64)
        else:
            has, before_version, before_return, before_length, before_whole, before_values = kept
            same = has & (before_version == version[heads])
            broken = np.flatnonzero(has & ~same)  # ran under another version: it ends here, cut
            whole[heads] = np.where(has, same & before_whole, True)
            at = heads[same]
            returns[at] += before_return[same]
            lengths[at] += before_length[same]
            for name, how in self.reductions.items():
                a, b = before_values[name][same], values[name][at]
                merged = {"first": a, "last": b, "max": np.maximum(a, b), "min": np.minimum(a, b)}.get(how)
                values[name][at] = a + b if merged is None else merged
        stays = np.flatnonzero(last & ~ended)  # each env's last piece, if its episode runs on
        running.put(env[stays], version[stays], returns[stays], lengths[stays], whole[stays], values, stays)
        # what ended: the cut running pieces (each before its env's first piece), then the pieces
        # that ended or were cut by a version change mid-episode ("step" mode)
        out_pieces = np.flatnonzero(ended | ~last)
        order = np.argsort(np.r_[2 * heads[broken], 2 * out_pieces + 1], kind="stable")
        whole_out = whole[out_pieces] & ended[out_pieces]  # a piece cut mid-episode is not whole
        columns = [env[out_pieces], version[out_pieces], returns[out_pieces], lengths[out_pieces], whole_out]
        measured = {name: v[out_pieces] for name, v in values.items()}
        if len(broken):
            assert kept is not None
            cut = [env[heads[broken]], kept[1][broken], kept[2][broken], kept[3][broken], np.zeros(len(broken), bool)]
            columns = [np.r_[a, b] for a, b in zip(cut, columns, strict=True)]
            measured = {name: np.r_[kept[5][name][broken], v] for name, v in measured.items()}
        env_out, version_out, returns_out, lengths_out, whole_list = (c[order].tolist() for c in columns)
        return _Ended(
            env_out,
            version_out,
            returns_out,
            lengths_out,
            whole_list,
            {k: v[order].tolist() for k, v in measured.items()},
        )


def _columns(value: torch.Tensor, n: int) -> np.ndarray:
    """A batch entry as ``n`` rows of numbers: a view of a CPU tensor's memory (a copy of
    another device's, and of a dtype numpy lacks as float64)."""
    try:
        rows = value.numpy(force=True)
    except TypeError:  # bfloat16 and the like
        rows = value.detach().to("cpu", torch.float64).numpy()
    return rows.reshape(n, -1)
