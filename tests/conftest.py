"""Shared fixtures: collectors are built through one helper so every test attaches the same way."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector

from envsync import EnvStateSender
from envsync.links.shared_memory import PREFIX, SHM_DIR

KINDS = {"single": Collector, "sync": MultiSyncCollector, "async": MultiAsyncCollector}


def build(
    kind: str,
    sender: EnvStateSender,
    make_env: Callable[..., Any] | Sequence[Callable[..., Any]],
    *,
    workers: int = 2,
    frames_per_batch: int = 64,
    policy: Any = None,
    **kwargs: Any,
) -> Any:
    """Build a collector of ``kind`` whose envs are wrapped by ``sender``."""
    makers = list(make_env) if isinstance(make_env, Sequence) else [make_env] * workers
    wrapped = [sender.env_fn(m) for m in makers]
    env_arg = wrapped[0] if kind == "single" else wrapped
    return KINDS[kind](
        env_arg,
        policy,
        frames_per_batch=frames_per_batch,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
        **kwargs,
    )


def own_shm_files() -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"{PREFIX}{os.getpid()}-")]


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shared_memory() -> Any:
    yield
    gc.collect()
    assert own_shm_files() == []
