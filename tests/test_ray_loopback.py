"""The test run's Ray cluster and the Ray link stay on loopback (127.0.0.0/8): every test's
traffic must. ``tests/conftest.py`` sets ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` before
anything imports Ray, and its cluster fixture refuses to start a cluster off loopback.

The tests without the cluster check that decision and its checks on made-up addresses: a
cluster off loopback is never started to show that they fail (its traffic would leave
loopback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import RAY_LOOPBACK, off_loopback, ray_on_loopback
from helpers import make_counter_env

from envsync import EnvStateSender

ray = pytest.importorskip("ray")
from torchrl.collectors import Collector  # noqa: E402
from torchrl.collectors.distributed import RayCollector  # noqa: E402

from envsync.links.ray import RayLink  # noqa: E402

WILDCARDS = {"0.0.0.0", "::"}  # a socket listening on every interface: no traffic of its own
ROOT = Path(__file__).resolve().parents[1]


def test_off_loopback_names_each_address_outside_127_0_0_0_8() -> None:
    assert off_loopback(["127.0.0.1", "127.3.2.1", "::1", "[::1]", "::ffff:127.0.0.1"]) == []
    outside = ["192.0.2.2", "10.0.0.5", "0.0.0.0", "::ffff:192.0.2.2", "2001:db8::1", "128.0.0.1"]
    assert off_loopback(["127.0.0.1", *outside, "::1"]) == outside


def test_this_run_imported_ray_with_the_loopback_setting() -> None:
    # set by conftest before any import of ray; Ray reads it once, at its import
    assert os.environ[RAY_LOOPBACK] == "0"
    assert ray._private.ray_constants.ENABLE_RAY_CLUSTER is False
    assert ray_on_loopback(ray) == ray.util.get_node_ip_address()
    assert off_loopback([ray.util.get_node_ip_address()]) == []


def test_the_cluster_fixture_refuses_an_address_off_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    # what Ray returns on Linux where the variable is not "0" at its import: the interface address
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "192.0.2.2")
    with pytest.raises(RuntimeError, match=f"192.0.2.2, off loopback: {RAY_LOOPBACK}=0"):
        ray_on_loopback(ray)


SCRIPTS_CHOOSE = """
import os, sys
sys.path[:0] = ["benchmarks", "examples"]
import bench_ray, ray_curriculum

print("ray imported:", "ray" in sys.modules)

def stop(*args):  # in place of the run: what main() chose before it would import Ray
    raise SystemExit(f"{os.environ.get('RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER')} {'ray' in sys.modules}")

bench_ray._measure = ray_curriculum.run = stop
for name, script, argv in (("bench_ray", bench_ray, ["--quick"]), ("ray_curriculum", ray_curriculum, ["--smoke"])):
    for extra in ([], ["--address", "10.0.0.5:6379"]):
        os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        try:
            script.main(argv + extra)
        except SystemExit as chose:
            print(f"{name} {'address' if extra else 'local'}:", chose)
"""


@pytest.mark.timeout(120)
def test_the_ray_benchmark_and_example_set_the_variable_for_their_own_cluster_only() -> None:
    # without the variable in their environment; they never import Ray here (no cluster starts)
    env = {k: v for k, v in os.environ.items() if k != RAY_LOOPBACK}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPTS_CHOOSE], capture_output=True, text=True, timeout=100, cwd=ROOT, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)
    assert lines["ray imported"] == "False"  # so main() decides before Ray reads the variable
    for name in ("bench_ray", "ray_curriculum"):
        assert lines[f"{name} local"] == "0 False"  # its own cluster: on loopback
        assert lines[f"{name} address"] == "None False"  # a real cluster: Ray's default


def sockets_off_loopback() -> list[str]:
    """This process's and its descendants' (Ray's GCS, raylets and workers, the collectors'
    workers) TCP and UDP sockets with an end off loopback, as ``"name pid: local -> remote"``."""
    found = []
    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        try:
            name, connections = process.name(), process.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue  # ended meanwhile
        for c in connections:
            ends = [c.raddr.ip] if c.raddr else []
            if c.laddr and (c.raddr or c.laddr.ip not in WILDCARDS):
                ends.append(c.laddr.ip)
            if off_loopback(ends):
                found.append(f"{name} {process.pid}: {c.laddr} -> {c.raddr or '-'}")
    return found


@pytest.mark.timeout(180)
def test_the_cluster_and_the_ray_link_are_on_loopback(cluster: Any) -> None:
    nodes = ray.nodes()  # a test before this one may have removed a node (listed, not alive)
    assert sum(n["Alive"] for n in nodes) >= 2
    addresses = [n["NodeManagerAddress"] for n in nodes]
    assert off_loopback(addresses) == [], f"nodes announced off loopback: {addresses}"
    assert off_loopback([cluster.address.rsplit(":", 1)[0], ray.util.get_node_ip_address()]) == []
    # the link's listener, where it listens by default (this process's node address)
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = RayCollector(
        [sender.env_fn(make_counter_env)] * 2,
        None,
        collector_class=Collector,
        frames_per_batch=40,
        total_frames=10**9,
        remote_configs=[{"num_cpus": 0.25, "memory": 150 * 2**20, "resources": {n: 0.01}} for n in ("n0", "n1")],
        **sender.ray_kwargs(start_method="fork"),
    )
    try:
        sender.push(config={"difficulty": 1.0}, wait="applied", timeout=60)  # both relays connected
        (link,) = sender.port.links()
        assert isinstance(link, RayLink)
        host = link.handle().address[0]
        assert off_loopback([host]) == [], f"the Ray link listens on {host}"
        next(iter(collector))  # a batch: the actors' traffic too
        assert sockets_off_loopback() == []
    finally:
        collector.shutdown()
        sender.close()
