"""The envs of the model-based test (``test_model.py``) and the factories that give every env
of a fleet its label (its fleet index: worker by worker, then sub-env order).

Every env observes ``[difficulty, label, step, table]``, so each frame shows the config it ran
under and which env produced it: ``table`` is a 1 MB config value (:data:`TABLE` floats, as
large as the sender's reusable buffers start, and past what a Ray post carries inline), which
the env keeps by reference as given and shows one element of at every step, read live (a
buffer handed out again while the env holds it would show in the frames).
``set_difficulty(difficulty, delay, table)`` sleeps ``delay`` seconds first (a slow config
method), refuses a table that holds more than one value (a torn copy), and raises, after
changing the env, for a negative difficulty (the marked value of a failing apply: envsync must
put the previous config back).
Unbatched envs carry two stateful transforms: a counting ``VecNormV2`` (for ``sync_stats``)
and an ``ObservationNorm`` whose ``loc`` is the env state the test pushes; its output
``observation_shifted = observation + loc`` shows that env state in every frame too.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from helpers import CounterEnv, NativeCounterEnv
from torchrl.data import Composite, Unbounded

ENV_KINDS = ("plain", "serial", "parallel", "native")
SUB_ENVS = 2
"""Envs per worker of the batched env kinds."""
LOC_KEY = "transforms.1.loc"
"""The pushed env-state entry: the same key in ``env.state_dict()`` and in envsync."""
OBSERVATION = 4
"""Numbers per observation: ``[difficulty, label, step, table]``."""
TABLE = 1 << 18
"""Floats of the ``table`` config value (1 MB: ``envsync.buffers.Buffers.MIN_BYTES``)."""
WIDE_TABLE = 16
"""Floats of the ``table`` value in a cell of thousands of rows (1 MB a row would be GBs)."""


def uniform(table: torch.Tensor) -> float:
    """The one value a pushed table holds (every element equal: a torn copy is refused)."""
    first = float(table.reshape(-1)[0])
    if not bool((table == first).all()):
        raise ValueError(f"table holds more than one value: torn between {float(table.min())} and {float(table.max())}")
    return first


def _configure(env: Any, difficulty: float, delay: float) -> None:
    if delay > 0:
        time.sleep(delay)
    env.difficulty = float(difficulty)
    if difficulty < 0:
        raise ValueError(f"difficulty {difficulty} is marked to fail")


READ_FLAGS = Path(tempfile.gettempdir()) / "envsync-model-read-flags"
"""Where :func:`arm_read` leaves the flags that make an env's next read of ``trouble`` fail."""


def arm_read(label: int) -> None:
    """Make the next read of ``trouble`` by the env labelled ``label`` (a native env: by its
    first row's label) fail once, in any process but this one (the sender's probe env, and a
    single-process collector's env, read on)."""
    READ_FLAGS.mkdir(exist_ok=True)
    (READ_FLAGS / f"read-{label}").write_text(str(os.getpid()))


def disarm_reads() -> None:
    for flag in READ_FLAGS.glob("read-*"):
        flag.unlink(missing_ok=True)


def _read_trouble(label: int) -> None:
    flag = READ_FLAGS / f"read-{label}"
    try:
        armer = int(flag.read_text())
    except (OSError, ValueError):
        return
    if armer != os.getpid():
        flag.unlink(missing_ok=True)
        raise RuntimeError(f"reading env {label}'s trouble fails once (flag {flag})")


class LabelEnv(CounterEnv):
    """A :class:`~helpers.CounterEnv` with a slow, sometimes failing config method and a
    table; episodes of ``horizon`` steps."""

    def __init__(self, label: int, max_steps: int) -> None:
        super().__init__(label=label, max_steps=max_steps)
        self.table = torch.zeros(TABLE)
        self.observation_spec = Composite(observation=Unbounded((OBSERVATION,), dtype=torch.float32))

    def set_difficulty(  # type: ignore[override]
        self, difficulty: float, delay: float = 0.0, table: Any = None
    ) -> None:
        if table is not None:
            table = torch.as_tensor(table)  # kept as given (a numpy copy out of shared memory)
            uniform(table)
            self.table = table
        _configure(self, difficulty, delay)

    def _obs(self) -> torch.Tensor:
        return torch.tensor([self.difficulty, self.label, float(self.count), float(self.table[-1])])

    @property
    def trouble(self) -> float:
        """0, read by ``sender.read_attributes(["trouble"])``; fails once when armed (:func:`arm_read`)."""
        _read_trouble(int(self.label))
        return 0.0

    @trouble.setter
    def trouble(self, value: float) -> None:  # an attribute path names settable attributes
        return None


class NativeLabelEnv(NativeCounterEnv):
    """A natively batched env (``batch_size=[2]``) taking per-row config through ``env_ids``."""

    def __init__(self, n: int, horizon: int, first_label: int, table: int = TABLE) -> None:
        super().__init__(n, horizon, first_label)
        self.table = torch.zeros(n, table)
        self.observation_spec = Composite(observation=Unbounded((n, OBSERVATION), dtype=torch.float32), shape=(n,))

    def set_difficulty(  # type: ignore[override]
        self, difficulty: torch.Tensor, delay: torch.Tensor, table: torch.Tensor, env_ids: torch.Tensor
    ) -> None:
        for row in table:
            uniform(row)
        self.table[env_ids] = table.to(torch.float32)
        if float(delay.max()) > 0:
            time.sleep(float(delay.max()))
        self.difficulty[env_ids] = difficulty.to(torch.float32)
        if bool((difficulty < 0).any()):
            raise ValueError(f"difficulty {difficulty.tolist()} is marked to fail")

    def _obs(self) -> torch.Tensor:
        return torch.stack([self.difficulty, self.labels, self.count, self.table[:, -1]], -1)

    @property
    def trouble(self) -> torch.Tensor:
        """0 per row; fails once when armed for the first row's label (:func:`arm_read`)."""
        _read_trouble(int(self.labels[0]))
        return torch.zeros(len(self.labels))

    @trouble.setter
    def trouble(self, value: torch.Tensor) -> None:
        return None


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
        loc=torch.zeros(OBSERVATION),
        scale=torch.ones(OBSERVATION),
        in_keys=["observation"],
        out_keys=["observation_shifted"],
    )
    return TransformedEnv(LabelEnv(label=label, max_steps=horizon_of(label)), Compose(norm, shift))


TRIPWIRE = "batched.armed"
"""The batched level's :class:`Tripwire` (a push of 1 makes that level fail its version)."""


def _tripwire() -> Any:
    from torchrl.envs import Transform

    class Tripwire(Transform):
        """The batched level of every batched env kind: its ``check`` (the batched level's
        ``reinit`` policy, run for every version the worker reaches) raises while ``armed``."""

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("armed", torch.zeros(()))

        def check(self) -> None:
            if float(self.armed) > 0:
                raise RuntimeError("the tripwire of the batched level is armed")

    return Tripwire()


def make_batched(kind: str, first_label: int) -> Any:
    """A ``SerialEnv``/``ParallelEnv`` (fork) of :data:`SUB_ENVS` labelled envs, under the
    batched level's tripwire."""
    from torchrl.envs import ParallelEnv, SerialEnv, TransformedEnv

    fns = [partial(make_label_env, first_label + i) for i in range(SUB_ENVS)]
    if kind == "serial":
        return TransformedEnv(SerialEnv(SUB_ENVS, fns), _tripwire())
    return TransformedEnv(ParallelEnv(SUB_ENVS, fns, mp_start_method="fork"), _tripwire())


def make_native(first_label: int, rows: int = SUB_ENVS, table: int = TABLE) -> Any:
    """A natively batched env of ``rows`` labelled rows (``table`` floats of table each), under
    the batched level's tripwire."""
    from torchrl.envs import TransformedEnv

    env = NativeLabelEnv(rows, horizon=3, first_label=first_label, table=table)
    env.horizons = torch.tensor([horizon_of(first_label + i) for i in range(rows)])
    return TransformedEnv(env, _tripwire())


def factories(env_kind: str, workers: int, rows: int = SUB_ENVS, table: int = TABLE) -> list[Callable[[], Any]]:
    """One factory per worker; the envs they build are labelled with their fleet indices (a
    natively batched env of ``rows`` rows with ``table`` floats of table each)."""
    if env_kind == "plain":
        return [partial(make_label_env, w) for w in range(workers)]
    if env_kind == "native":
        return [partial(make_native, rows * w, rows, table) for w in range(workers)]
    return [partial(make_batched, env_kind, SUB_ENVS * w) for w in range(workers)]


def envs_per_worker(env_kind: str, rows: int = SUB_ENVS) -> int:
    """Envs per worker: 1 for a plain env, :data:`SUB_ENVS` for a ``SerialEnv`` or a
    ``ParallelEnv``, ``rows`` for a natively batched env."""
    return 1 if env_kind == "plain" else rows if env_kind == "native" else SUB_ENVS


def has_env_state(env_kind: str) -> bool:
    """Whether the env carries the transforms (a natively batched env takes config only)."""
    return env_kind != "native"
