"""Attribution: collected batches in, finished episodes out, each with the exact config it ran.

A frame names its env (``("next", "env_index")``) and the version its step ran under
(``("next", "env_version")``); the sender names the config of each ``(env, version)``
(:meth:`~envsync.sender.Sender.config_at`). The :class:`Ledger` cuts each env's frames into
pieces at episode ends (``("next", "done")``) and at version changes, sums rewards and
reduces the user's measures over each piece with tensor operations (no Python loop over
frames), and carries the piece still running at the end of a batch into the next batch of
that env. Each env's frames come from one worker, whose batches arrive in order, so batches
of different workers may interleave in any order.

In ``"reset"`` mode (and ``"truncate"``, which ends the episode) a version changes only at an
episode's start, so every piece is a whole episode. In ``"step"`` mode a config may change
mid-episode: each piece is then credited to its own config and marked ``whole=False``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch
from tensordict import TensorDict, TensorDictBase

from envsync.errors import ValidationError
from envsync.sender import Sender

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
        config: the exact config it ran under (a ``TensorDict`` shaped like the template).
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


@dataclass
class _Piece:
    """A run of one env's frames under one version, within one episode."""

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

    def finished(self, reductions: Mapping[str, str]) -> Episode:
        """The record of this piece (running sums of ``"mean"`` measures become means)."""
        values = {n: v / self.length if reductions[n] == "mean" else v for n, v in self.values.items()}
        return Episode(self.env, self.version, TensorDict(), self.episode_return, self.length, values, self.whole)


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
        self.latest: dict[int, int] = {}
        """Per env: the version of the newest frame seen (an env's versions never go back)."""
        self.frames = 0
        self._open: dict[int, _Piece] = {}

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
        episodes = cuts.episodes(self._open)
        configs: dict[tuple[int, int], TensorDict] = {}
        for i, episode in enumerate(episodes):
            key = (episode.env, episode.version)
            if key not in configs:
                configs[key] = self.sender.config_at(*key)
            episodes[i] = replace(episode, config=configs[key])
        self.latest.update(cuts.latest())
        return episodes


class _Cuts:
    """One batch's frames, sorted by env (stable: each env's frames stay in time order),
    cut into pieces at episode ends and version changes, each reduced by tensor ops."""

    def __init__(self, env: torch.Tensor, version: torch.Tensor, done: torch.Tensor, reward: torch.Tensor) -> None:
        self.env, self.version, self.done = env, version, done
        n = env.numel()
        self.first = torch.ones(n, dtype=torch.bool)
        self.first[1:] = env[1:] != env[:-1]
        self.start = self.first.clone()
        self.start[1:] |= done[:-1] | (version[1:] != version[:-1])
        self.last = torch.ones(n, dtype=torch.bool)
        self.last[:-1] = self.start[1:]
        self.segment = self.start.cumsum(0) - 1
        self.count = int(self.segment[-1]) + 1
        self.returns = torch.zeros(self.count, dtype=torch.float64).index_add_(0, self.segment, reward)
        self.lengths = torch.bincount(self.segment, minlength=self.count)
        self.values: dict[str, tuple[str, torch.Tensor]] = {}

    @classmethod
    def of(cls, batch: TensorDictBase, measures: Mapping[str, Measure]) -> _Cuts | None:
        n = batch.batch_size.numel()
        if n == 0:
            return None
        keys = batch.keys(include_nested=True)
        for key in [*TAGS, *(m.key for m in measures.values())]:
            if key not in keys:
                raise ValidationError(
                    f"the batch has no {key!r}: build the collector with sender.env_fn(...) and "
                    f"weight_sync_schemes=sender.schemes(), and name measures by keys of the batch"
                )
        env = batch.get(TAGS[0]).reshape(n)
        order = torch.sort(env, stable=True).indices
        cuts = cls(
            env[order],
            batch.get(TAGS[1]).reshape(n)[order],
            batch.get(TAGS[2]).reshape(n, -1).any(-1)[order],
            batch.get(TAGS[3]).reshape(n, -1).sum(-1).to(torch.float64)[order],
        )
        for name, measure in measures.items():
            values = batch.get(measure.key).reshape(n, -1)
            if values.shape[1] != 1:
                count = values.shape[1]
                raise ValidationError(f"measure {name!r}: {measure.key!r} has {count} numbers per frame, not 1")
            cuts.reduce(name, measure.reduce, values[:, 0].to(torch.float64)[order])
        return cuts

    def reduce(self, name: str, how: str, values: torch.Tensor) -> None:
        """Reduce ``values`` over each piece; ``"mean"`` is kept as a sum until the piece ends."""
        if how == "first":
            out = values[self.start]
        elif how == "last":
            out = values[self.last]
        elif how in ("sum", "mean"):
            out = torch.zeros(self.count, dtype=torch.float64).index_add_(0, self.segment, values)
        else:
            out = torch.zeros(self.count, dtype=torch.float64)
            out.scatter_reduce_(0, self.segment, values, "amax" if how == "max" else "amin", include_self=False)
        self.values[name] = (how, out)

    def latest(self) -> dict[int, int]:
        ends = torch.ones_like(self.first)
        ends[:-1] = self.first[1:]
        return dict(zip(self.env[ends].tolist(), self.version[ends].tolist(), strict=True))

    def episodes(self, running: dict[int, _Piece]) -> list[Episode]:
        """The episodes (pieces) that ended in this batch, without their configs; ``running``
        (per env, the piece still running) is merged into each env's first piece and
        replaced by its last one."""
        envs = self.env[self.start].tolist()
        versions = self.version[self.start].tolist()
        firsts = self.first[self.start].tolist() + [True]
        ended = self.done[self.last].tolist()
        after_done = torch.cat([torch.ones(1, dtype=torch.bool), self.done[:-1]])[self.start].tolist()
        returns, lengths = self.returns.tolist(), self.lengths.tolist()
        values = {name: out.tolist() for name, (_, out) in self.values.items()}
        reductions = {name: how for name, (how, _) in self.values.items()}
        out: list[Episode] = []
        for i, (env, version) in enumerate(zip(envs, versions, strict=True)):
            piece = _Piece(env, version, returns[i], lengths[i], {n: v[i] for n, v in values.items()}, after_done[i])
            if firsts[i]:
                piece = _continued(running.pop(env, None), piece, reductions, out)
            if ended[i]:
                out.append(piece.finished(reductions))
            elif firsts[i + 1]:
                running[env] = piece
            else:  # cut by a version change mid-episode ("step" mode)
                out.append(replace(piece, whole=False).finished(reductions))
        return out


def _continued(before: _Piece | None, piece: _Piece, reductions: Mapping[str, str], out: list[Episode]) -> _Piece:
    """An env's first piece in a batch: it continues the piece the env left running, if any."""
    if before is None:  # a new episode (an env first seen is taken to start one)
        return replace(piece, whole=True)
    if before.version != piece.version:
        out.append(replace(before, whole=False).finished(reductions))
        return replace(piece, whole=False)
    return before.then(piece, reductions)
