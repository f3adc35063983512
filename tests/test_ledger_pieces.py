"""The ledger's pieces, by vector ops over thousands of envs, against a reference written piece
by piece (the ledger's own algorithm before it ran on columns): random batches of a few envs,
some envs missing from a batch, versions changing mid-episode, every reduction."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import pytest

from envsync.curriculum.columns import OpenPieces
from envsync.curriculum.ledger import _Cuts, _Ended


class _Piece(NamedTuple):
    """A run of one env's frames under one version, within one episode: what the ledger made
    piece by piece before it ran on columns."""

    env: int
    version: int
    episode_return: float
    length: int
    values: dict[str, float]
    whole: bool


def _as_pieces(ended: _Ended) -> list[_Piece]:
    names = list(ended.values)
    columns = zip(
        ended.env, ended.version, ended.returns, ended.lengths, ended.whole, *ended.values.values(), strict=True
    )
    return [_Piece(e, v, r, n, dict(zip(names, m, strict=True)), w) for e, v, r, n, w, *m in columns]


REDUCTIONS = ("first", "last", "max", "min", "sum", "mean")


def _then(before: _Piece, later: _Piece, reductions: Mapping[str, str]) -> _Piece:
    merged = {}
    for name, how in reductions.items():
        a, b = before.values[name], later.values[name]
        merged[name] = {"first": a, "last": b, "max": max(a, b), "min": min(a, b)}.get(how, a + b)
    total = before.episode_return + later.episode_return
    return _Piece(before.env, before.version, total, before.length + later.length, merged, before.whole)


def reference(cuts: _Cuts, running: dict[int, _Piece]) -> list[_Piece]:
    """One piece at a time: an env's first piece continues its running one (same version),
    or cuts it (another version: both not whole); a piece that ends is out, one cut by a
    version change mid-episode is out not whole, an env's last piece runs on."""
    envs, ended = cuts.env.tolist(), cuts.ended.tolist()
    out: list[_Piece] = []
    for i, env in enumerate(envs):
        values = {name: float(v[i]) for name, v in cuts.values.items()}
        piece = _Piece(
            env, int(cuts.version[i]), float(cuts.returns[i]), int(cuts.lengths[i]), values, i > 0 and ended[i - 1]
        )
        if i == 0 or envs[i - 1] != env:
            before = running.pop(env, None)
            if before is None:
                piece = piece._replace(whole=True)
            elif before.version != piece.version:
                out.append(before._replace(whole=False))
                piece = piece._replace(whole=False)
            else:
                piece = _then(before, piece, cuts.reductions)
        if ended[i]:
            out.append(piece)
        elif i + 1 == len(envs) or envs[i + 1] != env:
            running[env] = piece
        else:
            out.append(piece._replace(whole=False))
    return out


def _batches(rng: np.random.Generator, envs: int, reductions: dict[str, str]) -> list[tuple[Any, ...]]:
    versions = np.zeros(envs, dtype=np.int64)
    out = []
    for _ in range(int(rng.integers(1, 6))):
        chosen = rng.permutation(envs)[: int(rng.integers(1, envs + 1))] if rng.random() < 0.3 else np.arange(envs)
        env, version = [], []
        for e in sorted(chosen.tolist()):
            for _ in range(int(rng.integers(1, 8))):
                versions[e] += rng.random() < 0.15
                env.append(e)
                version.append(int(versions[e]))
        n = len(env)
        measures = {name: rng.normal(size=n) for name in reductions}
        out.append((np.array(env), np.array(version), rng.random(n) < 0.25, rng.normal(size=n), measures))
    return out


def _rounded(pieces: list[_Piece]) -> list[tuple[Any, ...]]:
    return [
        (p.env, p.version, round(p.episode_return, 9), p.length, {k: round(v, 9) for k, v in p.values.items()}, p.whole)
        for p in pieces
    ]


@pytest.mark.parametrize("seed", range(4))
def test_pieces_by_columns_are_the_reference_pieces(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(60):
        reductions = {f"m{i}": REDUCTIONS[int(rng.integers(len(REDUCTIONS)))] for i in range(int(rng.integers(3)))}
        running: dict[int, _Piece] = {}
        columns = OpenPieces()
        for env, version, done, reward, measures in _batches(rng, int(rng.integers(1, 6)), reductions):
            expected, got = _Cuts(env, version, done, reward), _Cuts(env, version, done, reward)
            for name, how in reductions.items():
                expected.reduce(name, how, measures[name])
                got.reduce(name, how, measures[name])
            assert _rounded(_as_pieces(got.pieces(columns))) == _rounded(reference(expected, running))
