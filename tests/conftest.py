"""Shared fixtures: collectors are built through one helper so every test attaches the same way."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
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


RAY_STORE = 80 * 2**20  # bytes of object store per node


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A local two-node Ray cluster (head ``n0``, node ``n1``; 1 CPU each), shared by the
    tests of one module: shut down at the module's end, since later modules fork workers
    (a process that forks with Ray's threads running can hang in the child)."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    # the raylets' workers inherit the environment: they import this directory's modules
    path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parent), path) if p)
    nodes = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": RAY_STORE, "resources": {"n0": 1}},
    )
    nodes.add_node(num_cpus=1, object_store_memory=RAY_STORE, resources={"n1": 1})
    ray.init(address=nodes.address, log_to_driver=False)
    try:
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()
        os.environ["PYTHONPATH"] = path
