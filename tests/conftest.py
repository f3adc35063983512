"""Shared fixtures: collectors are built through one helper so every test attaches the same way.

How a run is laid out (what keeps ``make test`` short without losing what it proves):

- workers **fork** unless a test asks for spawn (``start_method("spawn")``, or a ``spawn``
  parameter): spawn's start-up (a fresh interpreter importing torch and torchrl, ~1-3 s a
  process here) is only worth paying where the start method is the point;
- **one Ray cluster** for the whole run (the session-scoped ``cluster`` fixture), started by the
  first test that asks for it; every such test runs **after all the others**
  (:func:`pytest_collection_modifyitems`), since a process that forks while Ray's threads run
  can hang in the child, and from then on workers spawn;
- tests marked ``wide`` are left out of ``make test`` (``-m "not wide"``) and run by
  ``make wide`` (CI's second step): the model-based cells outside the covering subset, every
  Ray cell of the matrix, the load runs;
- every **Ray cluster runs on loopback** (127.0.0.1), as every test's traffic must: see
  :data:`RAY_LOOPBACK`, set at the top of this file, before anything imports Ray.
"""

from __future__ import annotations

import gc
import ipaddress
import multiprocessing as mp
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

RAY_LOOPBACK = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""With it ``"0"`` when ``ray`` is imported (Ray reads it once, then), Ray runs a local cluster
on 127.0.0.1: ``ray.util.get_node_ip_address()`` returns it, so the nodes are announced there
and the Ray link listens there. Without it, on Linux, Ray announces them on the machine's
interface address (and turns a ``127.0.0.1`` given to ``ray.init(address=...)`` back into it).
Set, not defaulted: no test run leaves loopback, whatever the caller's environment says. The
test run's subprocesses (Ray's workers, ``run_to_exit``) inherit it; docs/ray.md."""
os.environ[RAY_LOOPBACK] = "0"

import pytest  # noqa: E402
from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector  # noqa: E402  (imports Ray)

from envsync import EnvStateSender  # noqa: E402
from envsync.links.shared_memory import PREFIX, SHM_DIR  # noqa: E402

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


def off_loopback(hosts: Iterable[str]) -> list[str]:
    """The hosts of ``hosts`` (IP addresses, ``[v6]`` bracketed or not) outside loopback
    (127.0.0.0/8, ::1; an IPv4-mapped IPv6 address counts as its IPv4 address)."""
    found = []
    for host in hosts:
        address = ipaddress.ip_address(host.strip("[]"))
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if not address.is_loopback:
            found.append(host)
    return found


def ray_on_loopback(ray: Any) -> str:
    """The address a Ray cluster started by this process would be announced on (and the Ray
    link would listen on); raises, so that nothing starts, if it is not on loopback."""
    host = str(ray.util.get_node_ip_address())
    if off_loopback([host]):
        raise RuntimeError(
            f"Ray would run a local cluster on {host}, off loopback: {RAY_LOOPBACK}=0 must be set "
            "before ray is imported (tests/conftest.py sets it first; did something import ray before it?)"
        )
    return host


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "wide: the wider set (make wide, CI's second step), left out of make test (-m 'not wide')"
    )
    mp.set_start_method("fork", force=True)  # torchrl's import chose spawn; tests that need it ask for it


def uses_ray(item: pytest.Item) -> bool:
    return "cluster" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests on the Ray cluster run last (each module's in their order), so that no test
    forks workers after the cluster started."""
    items.sort(key=uses_ray)  # stable


@pytest.fixture(scope="session")
def cluster() -> Iterator[Any]:
    """A local two-node Ray cluster (head ``n0``, node ``n1``; 1 CPU each), shared by every test
    of the run that asks for it; those run last (see :func:`pytest_collection_modifyitems`), and
    build their local workers by spawn: a process that forks with Ray's threads running can
    hang in the child."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    try:
        ray_on_loopback(ray)  # refuse before anything listens or connects
    except RuntimeError as err:
        pytest.fail(str(err), pytrace=False)
    mp.set_start_method("spawn", force=True)
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


@pytest.fixture
def cluster_address(cluster: Any) -> Iterator[str]:
    """The shared cluster's address, for a program under test that connects by itself
    (``ray.init(address=...)``, then ``ray.shutdown()``): this process lets go of the cluster
    for the test and connects again after it."""
    import ray

    ray.shutdown()
    try:
        yield cluster.address
    finally:
        if not ray.is_initialized():
            ray.init(address=cluster.address, log_to_driver=False)
