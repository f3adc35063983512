"""The model-based test of ``test_model.py`` over Ray: the same operations, reference model
and per-frame checks, on a ``RayCollector(sync=True)`` of two remote collectors (one worker
each; one per node of the local two-node cluster, or both on one node for the ``ray-sync``
cells, so that both ways a large share travels run: see ``model_machine.TWO_ON_ONE_NODE``)
of every collector kind, env kind and apply mode.

A Ray history is slow (every collector it builds, at its start and at each resume, starts
two actors: ~8 s here), so ``make test`` runs one history of the cheapest cell of each
collector kind; ``make soak`` runs every cell (``test_model_ray_soak``, for
``ENVSYNC_MODEL_RAY_SECONDS`` seconds). Its own module: the cluster must be down before
another module forks workers.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from model_envs import ENV_KINDS
from model_machine import Cell
from test_model import MODES, STEPS, run, soak

pytest.importorskip("ray")

RAY_KINDS = ("ray-single", "ray-sync", "ray-async")
RAY_CELLS = [Cell(kind, env_kind, mode) for kind in RAY_KINDS for env_kind in ENV_KINDS for mode in MODES]
CHEAPEST = [
    Cell("ray-single", "plain", "step"),
    Cell("ray-sync", "serial", "reset"),
    Cell("ray-async", "native", "truncate"),
]
"""One cell per collector kind in ``make test``, each env kind but ``parallel`` and each mode once."""
AT_SCALE = [Cell("ray-sync", "native", "reset", rows=4096), Cell("ray-async", "native", "step", rows=4096)]
"""Two workers of a natively batched env of 4,096 rows over Ray (``make wide``; ``make soak``
draws them with the others): the rows travel as columns, each node's relay answers gathers
and reads of its worker's 4,096 rows in one reply, every frame of 8,192 worlds checked
against the reference model."""
RAY_CELLS += AT_SCALE
SEED = int(os.environ.get("ENVSYNC_MODEL_SEED", "18"))
SOAK_SECONDS = float(os.environ.get("ENVSYNC_MODEL_RAY_SECONDS", "0"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cell", CHEAPEST, ids=str)
def test_model_over_ray(cluster: Any, cell: Cell) -> None:
    run(cell, seed_value=SEED * 1000 + 500 + RAY_CELLS.index(cell), examples=1, steps=STEPS)


@pytest.mark.wide
@pytest.mark.timeout(300)
@pytest.mark.parametrize("cell", AT_SCALE, ids=str)
def test_model_over_ray_at_scale(cluster: Any, cell: Cell) -> None:
    run(cell, seed_value=SEED * 1000 + 500 + RAY_CELLS.index(cell), examples=1, steps=STEPS)


@pytest.mark.skipif(not SOAK_SECONDS, reason="the soak run: make soak (ENVSYNC_MODEL_RAY_SECONDS)")
@pytest.mark.timeout(SOAK_SECONDS + 900)
def test_model_ray_soak(cluster: Any) -> None:
    soak(RAY_CELLS, SOAK_SECONDS, examples=2, steps=20, what="model soak over Ray")
