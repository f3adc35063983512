"""Over Ray, what does a push cost next to a policy weight update and to a restart?

On a local two-node Ray cluster (``ray.cluster_utils.Cluster``, 1 CPU and an 80 MB object
store per node), a torchrl ``RayCollector`` runs 2 remote ``MultiSyncCollector``s (one per
node) of 2 workers each: 4 workers. Each worker env carries a 1 MB transform buffer
(``transforms.0.buf``), the config has a ``"table"`` of 1 MB / 4 per env, and the policy is an
MLP whose parameters total about 1 MB. On the idle collector (built, not iterated),
interleaved round by round:

- envsync: ``push(config={"difficulty": x}, wait="applied")``,
  ``push(env_state={"transforms.0.buf": <fresh 1 MB>}, wait="applied")`` (the same tensor for
  every worker) and ``push(config=<one fresh table row per env>, wait="applied")`` (1 MB over
  the fleet, each node's object holding only its 2 rows), ``apply_at="step"``;
- torchrl: ``collector.update_policy_weights_()`` after changing the policy's parameters
  in place (``RayWeightSyncScheme``: one gloo send per remote collector, returns once each
  actor has loaded them);

- worlds: ``push(config=<a row per world>, wait="applied")`` to one remote ``Collector`` of a
  natively batched env of ``--worlds`` worlds (``bench_envs.WorldsEnv``, on node n0), against
  the same push to the same env in a local ``Collector``, interleaved (rows travel as columns
  over Ray: the share, the relay's write and its report cost a few vector ops, not a Python
  entry per world);

and what each push moved: the shares the main process made (one per node with rows in the
push: its rows, sent on the node's relay's connection), the distinct shares the relays took,
and the bytes each node's relays decoded; then a restart: ``collector.shutdown()``
+ a new ``RayCollector`` + its first batch.

    python benchmarks/bench_ray.py [--quick] [--address ADDRESS]

The local cluster runs on loopback (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, set by :func:`main`
before Ray is imported: docs/ray.md; what imports Ray, through torchrl, is imported where it is
used); with ``--address`` Ray finds the node's address as usual.
"""

from __future__ import annotations

import ipaddress
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from bench_common import RESULTS, Report, median, parse_args, save_plot, target, timed
from tensordict import TensorDict
from tqdm import tqdm

if TYPE_CHECKING:
    from envsync import EnvStateSender

NAME = "ray"
KEY = "transforms.0.buf"
MB = 1 << 20
STORE = 80 * MB  # bytes of object store per node


@dataclass
class Args:
    collectors: int = 2  # remote collectors, one per node
    workers_per_collector: int = 2
    nbytes: int = MB  # env state pushed; the policy's parameters are sized to match
    repeats: int = 20  # rounds of (config push, env-state push, rows push, policy update)
    restarts: int = 3
    frames_per_batch: int = 40
    worlds: int = 4096  # rows of the natively batched env of the worlds measure
    address: str = ""  # an existing cluster whose two nodes carry resources n0 and n1; empty: start one
    quick: bool = False
    out: Path = RESULTS


def quick(args: Args) -> Args:
    return replace(args, repeats=3, restarts=1, worlds=256)


@contextmanager
def cluster(address: str = "") -> Iterator[list[dict[str, Any]]]:
    """Connect to ``address``, or start a local head + one node on loopback; yield one actor
    option set per node (nodes ``n0`` and ``n1``)."""
    import bench_envs
    import ray
    from ray.cluster_utils import Cluster

    nodes = None
    if not address:
        host = ray.util.get_node_ip_address()
        if not ipaddress.ip_address(host).is_loopback:  # refused before anything listens
            raise SystemExit(
                f"bench_ray: a local cluster would run on {host}, not on loopback: set "
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before Ray is imported (docs/ray.md)"
            )
        nodes = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "object_store_memory": STORE, "resources": {"n0": 1}},
        )
        nodes.add_node(num_cpus=1, object_store_memory=STORE, resources={"n1": 1})
        address = nodes.address
    ray.init(address=address, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(bench_envs)  # the cluster's workers cannot import benchmarks/
    try:
        yield [{"num_cpus": 0.25, "memory": 150 * MB, "resources": {f"n{i}": 0.01}} for i in range(2)]
    finally:
        ray.shutdown()
        if nodes is not None:
            nodes.shutdown()


def make_policy(nbytes: int) -> Any:
    """An MLP 2 -> h -> h -> 1 whose float32 parameters total about ``nbytes``."""
    from tensordict.nn import TensorDictModule

    hidden = int((nbytes / 4) ** 0.5)
    net = torch.nn.Sequential(
        torch.nn.Linear(2, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, 1),
        torch.nn.Tanh(),
    )
    return TensorDictModule(net, ["observation"], ["action"])


def param_bytes(policy: Any) -> int:
    return sum(p.numel() * p.element_size() for p in policy.parameters())


def make_sender(args: Args) -> EnvStateSender:
    import bench_envs  # imported once main() chose where Ray runs: they import Ray (through torchrl)

    from envsync import EnvStateSender

    table = torch.zeros(args.nbytes // 4 // (args.collectors * args.workers_per_collector))
    return EnvStateSender(
        config={"difficulty": 0.0, "table": table}, apply=bench_envs.apply_difficulty, apply_at="step"
    )


def build(sender: EnvStateSender, policy: Any, args: Args, configs: list[dict[str, Any]]) -> Any:
    import bench_envs
    from torchrl.collectors import MultiSyncCollector
    from torchrl.collectors.distributed import RayCollector

    return RayCollector(
        [sender.env_fn(partial(bench_envs.make_buffer_env, args.nbytes // 4))] * args.collectors,
        policy,
        collector_class=MultiSyncCollector,
        num_workers_per_collector=args.workers_per_collector,
        frames_per_batch=args.frames_per_batch,
        total_frames=10**9,
        remote_configs=[configs[i % len(configs)] for i in range(args.collectors)],
        **sender.ray_kwargs(start_method="fork"),
    )


class Meter:
    """What each push moved: shares made per node (main process), and per relay the shares
    it took and the bytes it decoded (read from the actors between pushes)."""

    def __init__(self, sender: EnvStateSender, collector: Any) -> None:
        from envsync.integrations.torchrl.ray import relay_traffic

        self._link = sender.port.links()[0]
        self._actors = collector.remote_collectors
        self._read = relay_traffic
        self.pushes: dict[str, list[dict[str, Any]]] = {"env_state": [], "rows": []}

    def _relays(self) -> list[Any]:
        import ray

        return [t for _, t in ray.get([a.__ray_call__.remote(self._read) for a in self._actors])]

    def measure(self, key: str, push: Callable[[], Any]) -> float:
        put, relays = [t.objects for t in self._link.traffic], self._relays()
        seconds = timed(push)
        after = self._relays()
        nodes = self._link.nodes
        decoded = [0] * len(self._link.traffic)
        fetched: set[str] = set()
        for node, old, new in zip(nodes, relays, after, strict=True):
            decoded[node] += new.nbytes - old.nbytes
            if new.objects > old.objects:
                fetched.add(new.last)
        objects = sum(t.objects - o for t, o in zip(self._link.traffic, put, strict=True))
        self.pushes[key].append({"put": objects, "fetched": len(fetched), "decoded": decoded})
        return seconds


def _rounds(
    collector: Any, sender: EnvStateSender, policy: Any, args: Args, bar: tqdm
) -> tuple[dict[str, list[float]], Meter]:
    """The four updates, interleaved so that they share the machine's noise; round 0 warms up."""
    out: dict[str, list[float]] = {"config": [], "env_state": [], "rows": [], "policy": []}
    meter = Meter(sender, collector)
    envs = sender.num_envs or 0
    width = int(sender.desired_config()["table"].numel())
    for i in range(args.repeats + 1):
        state = torch.rand(args.nbytes // 4)
        rows = TensorDict(difficulty=torch.full((envs,), 0.1), table=torch.rand(envs, width), batch_size=[envs])

        def update_policy() -> None:
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(1e-3)
            collector.update_policy_weights_()

        times = {
            "config": timed(lambda x=0.1 * (i % 10): sender.push(config={"difficulty": x}, wait="applied", timeout=60)),
            "env_state": meter.measure(
                "env_state", lambda s=state: sender.push(env_state={KEY: s}, wait="applied", timeout=60)
            ),
            "rows": meter.measure("rows", lambda r=rows: sender.push(config=r, wait="applied", timeout=60)),
            "policy": timed(update_policy),
        }
        if i:
            for key, seconds in times.items():
                out[key].append(seconds)
        bar.update()
    return out, meter


def _worlds(args: Args, configs: list[dict[str, Any]], bar: tqdm) -> dict[str, list[float]]:
    """Seconds of a push of a row per world to "applied", over Ray and to a local ``Collector``
    of the same env, ``args.repeats`` rounds after one warm-up round."""
    import bench_envs
    from torchrl.collectors import Collector
    from torchrl.collectors.distributed import RayCollector

    from envsync import EnvStateSender

    n = args.worlds
    make = partial(bench_envs.make_worlds_env, n)
    senders = [EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step") for _ in "rl"]
    remote = local = None
    out: dict[str, list[float]] = {"worlds": [], "worlds_local": []}
    try:
        remote = RayCollector(
            [senders[0].env_fn(make)],
            None,
            collector_class=Collector,
            num_workers_per_collector=1,
            frames_per_batch=n,
            total_frames=10**9,
            remote_configs=[configs[0] | {"memory": 1024 * MB}],
            **senders[0].ray_kwargs(start_method="fork"),
        )
        next(iter(remote))
        local = Collector(
            senders[1].env_fn(make), None, frames_per_batch=n, total_frames=-1, weight_sync_schemes=senders[1].schemes()
        )
        next(iter(local))
        for i in range(args.repeats + 1):
            rows = TensorDict(difficulty=torch.rand(n, dtype=torch.float64), batch_size=[n])
            took = [timed(lambda s=s, r=rows: s.push(config=r, wait="applied", timeout=60)) for s in senders]
            if i:
                out["worlds"].append(took[0])
                out["worlds_local"].append(took[1])
            bar.update()
    finally:
        for collector in (remote, local):
            if collector is not None:
                collector.shutdown()
        for sender in senders:
            sender.close()
    return out


def _measure(args: Args, bar: tqdm) -> tuple[dict[str, list[float]], int, int, Meter]:
    policy = make_policy(args.nbytes)
    sender = make_sender(args)
    restarts: list[float] = []
    with cluster(args.address) as configs:
        collector = build(sender, policy, args, configs)
        try:
            workers = sender.num_workers or 0
            times, meter = _rounds(collector, sender, policy, args, bar)
            times |= _worlds(args, configs, bar)
            for _ in range(args.restarts):
                start = time.perf_counter()
                collector.shutdown()
                collector = None
                collector = build(sender, policy, args, configs)
                next(iter(collector))
                restarts.append(time.perf_counter() - start)
                bar.update()
        finally:
            if collector is not None:
                collector.shutdown()
            sender.close()
    return times | {"restart": restarts}, workers, param_bytes(policy), meter


LABELS = {
    "config": ("envsync push(config), wait='applied'", "a few bytes"),
    "env_state": ("envsync push(env_state), wait='applied'", "1 MB tensor"),
    "rows": ("envsync push(config=<a row per env>), wait='applied'", "1 MB of rows"),
    "policy": ("RayCollector.update_policy_weights_()", "MLP params"),
    "restart": ("restart: shutdown + RayCollector + first batch", "-"),
    "worlds": ("envsync push(config=<a row per world>) to a remote natively batched env, wait='applied'", "-"),
    "worlds_local": ("the same push to the same env in a local Collector (baseline)", "-"),
}


def _rows(times: dict[str, list[float]], policy_bytes: int, args: Args) -> list[dict[str, Any]]:
    base = median(times["env_state"])
    rows = []
    for key, (what, payload) in LABELS.items():
        if key == "env_state":
            payload = f"{args.nbytes / MB:.2f} MB tensor, the same for every worker"
        elif key == "rows":
            payload = f"{args.nbytes / MB:.2f} MB over the fleet, a row per env"
        elif key == "policy":
            payload = f"{policy_bytes / MB:.2f} MB of parameters"
        elif key.startswith("worlds"):
            payload = f"{args.worlds:,} worlds, a float64 row each"
        rows.append(
            {
                "method": key,
                "what": what,
                "payload": payload,
                "median_ms": median(times[key]) * 1e3,
                "min_ms": min(times[key]) * 1e3,
                "max_ms": max(times[key]) * 1e3,
                "samples": len(times[key]),
                "over_env_state_push": median(times[key]) / base,
                "over_policy_update": median(times[key]) / median(times["policy"]),
                "raw_s": times[key],
            }
        )
    return rows


def _plot(rows: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh([r["method"] for r in rows][::-1], [r["median_ms"] for r in rows][::-1])
    ax.set_xscale("log")
    ax.set_xlabel("median ms (log)")
    ax.set_title("Ray, 2 nodes x 2 workers: push vs policy update vs restart")
    return save_plot(fig, out, NAME)


def _traffic(meter: Meter) -> dict[str, Any]:
    """Per kind of push, the median shares made and taken per push and bytes decoded per node."""
    out = {}
    for key, pushes in meter.pushes.items():
        counted = pushes[1:]  # round 0 warms up
        out[key] = {
            "shares_made_per_push": median([p["put"] for p in counted]),
            "shares_taken_per_push": median([p["fetched"] for p in counted]),
            "bytes_decoded_per_node": [
                median([p["decoded"][n] for p in counted]) for n in range(len(counted[0]["decoded"]))
            ],
        }
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv, Args, __doc__, quick)
    if not args.address:  # the local cluster on loopback: Ray reads it once, at its import (docs/ray.md)
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    rounds = 2 * (args.repeats + 1) + args.restarts
    bar = tqdm(total=rounds, desc="ray", file=sys.stderr, disable=not sys.stderr.isatty())
    times, workers, policy_bytes, meter = _measure(args, bar)
    bar.close()
    rows = _rows(times, policy_bytes, args)
    by = {r["method"]: r["median_ms"] for r in rows}
    plot = _plot(rows, args.out)
    traffic = _traffic(meter)
    summary = {
        "workers": workers,
        "nodes": 2,
        "policy_bytes": policy_bytes,
        "traffic": traffic,
        "env_state_push_over_policy": by["env_state"] / by["policy"],
        "rows_push_over_policy": by["rows"] / by["policy"],
        "policy_over_env_state_push": by["policy"] / by["env_state"],
        "policy_over_config_push": by["policy"] / by["config"],
        "restart_over_env_state_push": by["restart"] / by["env_state"],
        "restart_over_config_push": by["restart"] / by["config"],
        "worlds": args.worlds,
        "worlds_push_over_local": by["worlds"] / by["worlds_local"],
        "plots": [os.path.relpath(plot, args.out)],
    }
    targets = [
        target(
            "env-state push / update_policy_weights_ (same bytes)",
            summary["env_state_push_over_policy"],
            1.0,
            higher_is_better=False,
        ),
        target(
            "rows push / update_policy_weights_ (same bytes)",
            summary["rows_push_over_policy"],
            1.0,
            higher_is_better=False,
        ),
    ]
    targets += [
        target(
            f"{key} push: shares taken per push / nodes",
            t["shares_taken_per_push"] / 2,
            1.0,
            higher_is_better=False,
        )
        for key, t in traffic.items()
    ]
    rows_traffic = traffic["rows"]
    notes = [
        f"{workers} workers: {args.collectors} remote MultiSyncCollectors x {args.workers_per_collector} workers, "
        "one per node (actors of 0.25 CPU on nodes of 1 CPU), forked workers",
        "a push returns once every worker applied it; update_policy_weights_() once each remote actor has "
        "loaded the weights (torchrl's RayWeightSyncScheme does not wait for the actor's own worker processes)",
        f"per push, shares made / taken by the relays: env state {traffic['env_state']['shares_made_per_push']:g} / "
        f"{traffic['env_state']['shares_taken_per_push']:g}, rows {rows_traffic['shares_made_per_push']:g} / "
        f"{rows_traffic['shares_taken_per_push']:g} (2 nodes); bytes decoded per node, rows push: "
        + ", ".join(f"{b / MB:.2f} MB" for b in rows_traffic["bytes_decoded_per_node"])
        + f" of {args.nbytes / MB:.2f} MB over the fleet (each node only its own rows)",
        f"ratios: env-state push / policy update {summary['env_state_push_over_policy']:.2f}x, "
        f"rows push / policy update {summary['rows_push_over_policy']:.2f}x, "
        f"restart / env-state push {summary['restart_over_env_state_push']:.0f}x, "
        f"restart / config push {summary['restart_over_config_push']:.0f}x",
        f"worlds: a push of a row per world to {args.worlds:,} worlds of one natively batched env behind a "
        f"RayCollector (a Collector on node n0) takes {by['worlds']:.1f} ms to 'applied', "
        f"{summary['worlds_push_over_local']:.1f}x the same push to a local Collector ({by['worlds_local']:.2f} ms)",
    ]
    columns = [
        ("what", "operation"),
        ("payload", "payload"),
        ("median_ms", "median ms"),
        ("min_ms", "min ms"),
        ("max_ms", "max ms"),
        ("samples", "n"),
        ("over_env_state_push", "x env-state push"),
        ("over_policy_update", "x policy update"),
    ]
    tables = [("Median time per update (idle RayCollector)", columns)]
    return Report(NAME, args, rows, tables, summary, targets, notes).write(args.out)


if __name__ == "__main__":
    main()
