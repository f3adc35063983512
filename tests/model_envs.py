"""The envs of the model-based test (``test_model.py``) and the factories that give every env
of a fleet its label (its fleet index: worker by worker, then sub-env order).

Every env observes ``[difficulty, label, step]``, so each frame shows the config it ran under
and which env produced it. ``set_difficulty(difficulty, delay)`` sleeps ``delay`` seconds
first (a slow config method) and raises, after changing the env, for a negative difficulty
(the marked value of a failing apply: envsync must put the previous config back).
Unbatched envs carry two stateful transforms: a counting ``VecNormV2`` (for ``sync_stats``)
and an ``ObservationNorm`` whose ``loc`` is the env state the test pushes; its output
``observation_shifted = observation + loc`` shows that env state in every frame too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from helpers import CounterEnv, NativeCounterEnv

ENV_KINDS = ("plain", "serial", "parallel", "native")
SUB_ENVS = 2
"""Envs per worker of the batched env kinds."""
LOC_KEY = "transforms.1.loc"
"""The pushed env-state entry: the same key in ``env.state_dict()`` and in envsync."""


def _configure(env: Any, difficulty: float, delay: float) -> None:
    if delay > 0:
        time.sleep(delay)
    env.difficulty = float(difficulty)
    if difficulty < 0:
        raise ValueError(f"difficulty {difficulty} is marked to fail")


class LabelEnv(CounterEnv):
    """A :class:`~helpers.CounterEnv` with a slow, sometimes failing config method; episodes
    of ``horizon`` steps."""

    def set_difficulty(self, difficulty: float, delay: float = 0.0) -> None:  # type: ignore[override]
        _configure(self, difficulty, delay)


class NativeLabelEnv(NativeCounterEnv):
    """A natively batched env (``batch_size=[2]``) taking per-row config through ``env_ids``."""

    def set_difficulty(  # type: ignore[override]
        self, difficulty: torch.Tensor, delay: torch.Tensor, env_ids: torch.Tensor
    ) -> None:
        if float(delay.max()) > 0:
            time.sleep(float(delay.max()))
        self.difficulty[env_ids] = difficulty.to(torch.float32)
        if bool((difficulty < 0).any()):
            raise ValueError(f"difficulty {difficulty.tolist()} is marked to fail")


def horizon_of(label: int) -> int:
    """Episode length of env ``label``: short (reset mode applies at resets), and different
    per env so envs reset at different times."""
    return 3 + label % 3


def make_label_env(label: int) -> Any:
    """A :class:`LabelEnv` under ``Compose(VecNormV2(decay=1), ObservationNorm)``, both writing
    new keys so the raw observation stays readable."""
    from torchrl.envs import Compose, ObservationNorm, TransformedEnv, VecNormV2

    norm = VecNormV2(in_keys=["observation"], out_keys=["observation_norm"], decay=1.0)
    shift = ObservationNorm(
        loc=torch.zeros(3), scale=torch.ones(3), in_keys=["observation"], out_keys=["observation_shifted"]
    )
    return TransformedEnv(LabelEnv(label=label, max_steps=horizon_of(label)), Compose(norm, shift))


def make_batched(kind: str, first_label: int) -> Any:
    """A ``SerialEnv``/``ParallelEnv`` (fork) of :data:`SUB_ENVS` labelled envs."""
    from torchrl.envs import ParallelEnv, SerialEnv

    fns = [partial(make_label_env, first_label + i) for i in range(SUB_ENVS)]
    if kind == "serial":
        return SerialEnv(SUB_ENVS, fns)
    return ParallelEnv(SUB_ENVS, fns, mp_start_method="fork")


def make_native(first_label: int) -> NativeLabelEnv:
    env = NativeLabelEnv(SUB_ENVS, horizon=3, first_label=first_label)
    env.horizons = torch.tensor([horizon_of(first_label + i) for i in range(SUB_ENVS)])
    return env


def factories(env_kind: str, workers: int) -> list[Callable[[], Any]]:
    """One factory per worker; the envs they build are labelled with their fleet indices."""
    if env_kind == "plain":
        return [partial(make_label_env, w) for w in range(workers)]
    if env_kind == "native":
        return [partial(make_native, SUB_ENVS * w) for w in range(workers)]
    return [partial(make_batched, env_kind, SUB_ENVS * w) for w in range(workers)]


def envs_per_worker(env_kind: str) -> int:
    return 1 if env_kind == "plain" else SUB_ENVS


def has_env_state(env_kind: str) -> bool:
    """Whether the env carries the transforms (a natively batched env takes config only)."""
    return env_kind != "native"
