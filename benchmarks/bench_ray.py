"""Over Ray, what does a push cost next to a policy weight update and to a restart?

On a local two-node Ray cluster (``ray.cluster_utils.Cluster``, 1 CPU and an 80 MB object
store per node), a torchrl ``RayCollector`` runs 2 remote ``MultiSyncCollector``s (one per
node) of 2 workers each: 4 workers. Each worker env carries a 1 MB transform buffer
(``transforms.0.buf``) and the policy is an MLP whose parameters total about 1 MB. On the idle
collector (built, not iterated), interleaved round by round:

- envsync: ``push(config={"difficulty": x}, wait="applied")`` and
  ``push(env_state={"transforms.0.buf": <fresh 1 MB>}, wait="applied")`` (``apply_at="step"``);
- torchrl: ``collector.update_policy_weights_()`` after changing the policy's parameters
  in place (``RayWeightSyncScheme``: one gloo send per remote collector, returns once each
  actor has loaded them);

then a restart: ``collector.shutdown()`` + a new ``RayCollector`` + its first batch.

    python benchmarks/bench_ray.py [--quick]
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import bench_envs
import torch
from bench_common import RESULTS, Report, median, parse_args, save_plot, timed
from tqdm import tqdm

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
    repeats: int = 20  # rounds of (config push, env-state push, policy update)
    restarts: int = 3
    frames_per_batch: int = 40
    quick: bool = False
    out: Path = RESULTS


def quick(args: Args) -> Args:
    return replace(args, repeats=3, restarts=1)


@contextmanager
def cluster() -> Iterator[list[dict[str, Any]]]:
    """A local head + one node; yield one actor option set per node."""
    import ray
    from ray.cluster_utils import Cluster

    nodes = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": STORE, "resources": {"n0": 1}},
    )
    nodes.add_node(num_cpus=1, object_store_memory=STORE, resources={"n1": 1})
    ray.init(address=nodes.address, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(bench_envs)  # the cluster's workers cannot import benchmarks/
    try:
        yield [{"num_cpus": 0.25, "memory": 150 * MB, "resources": {f"n{i}": 0.01}} for i in range(2)]
    finally:
        ray.shutdown()
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


def build(sender: EnvStateSender, policy: Any, args: Args, configs: list[dict[str, Any]]) -> Any:
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


def _rounds(collector: Any, sender: EnvStateSender, policy: Any, args: Args, bar: tqdm) -> dict[str, list[float]]:
    """The three updates, interleaved so that they share the machine's noise; round 0 warms up."""
    out: dict[str, list[float]] = {"config": [], "env_state": [], "policy": []}
    for i in range(args.repeats + 1):
        state = torch.rand(args.nbytes // 4)

        def update_policy() -> None:
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(1e-3)
            collector.update_policy_weights_()

        times = {
            "config": timed(lambda x=0.1 * (i % 10): sender.push(config={"difficulty": x}, wait="applied", timeout=60)),
            "env_state": timed(lambda s=state: sender.push(env_state={KEY: s}, wait="applied", timeout=60)),
            "policy": timed(update_policy),
        }
        if i:
            for key, seconds in times.items():
                out[key].append(seconds)
        bar.update()
    return out


def _measure(args: Args, bar: tqdm) -> tuple[dict[str, list[float]], int, int]:
    policy = make_policy(args.nbytes)
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    restarts: list[float] = []
    with cluster() as configs:
        collector = build(sender, policy, args, configs)
        try:
            workers = sender.num_workers or 0
            times = _rounds(collector, sender, policy, args, bar)
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
    return times | {"restart": restarts}, workers, param_bytes(policy)


LABELS = {
    "config": ("envsync push(config), wait='applied'", "a few bytes"),
    "env_state": ("envsync push(env_state), wait='applied'", "1 MB tensor"),
    "policy": ("RayCollector.update_policy_weights_()", "MLP params"),
    "restart": ("restart: shutdown + RayCollector + first batch", "-"),
}


def _rows(times: dict[str, list[float]], policy_bytes: int, args: Args) -> list[dict[str, Any]]:
    base = median(times["env_state"])
    rows = []
    for key, (what, payload) in LABELS.items():
        if key == "env_state":
            payload = f"{args.nbytes / MB:.2f} MB tensor"
        elif key == "policy":
            payload = f"{policy_bytes / MB:.2f} MB of parameters"
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


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv, Args, __doc__, quick)
    bar = tqdm(total=args.repeats + 1 + args.restarts, desc="ray", file=sys.stderr, disable=not sys.stderr.isatty())
    times, workers, policy_bytes = _measure(args, bar)
    bar.close()
    rows = _rows(times, policy_bytes, args)
    by = {r["method"]: r["median_ms"] for r in rows}
    plot = _plot(rows, args.out)
    summary = {
        "workers": workers,
        "nodes": 2,
        "policy_bytes": policy_bytes,
        "policy_over_env_state_push": by["policy"] / by["env_state"],
        "policy_over_config_push": by["policy"] / by["config"],
        "restart_over_env_state_push": by["restart"] / by["env_state"],
        "restart_over_config_push": by["restart"] / by["config"],
        "plots": [os.path.relpath(plot, args.out)],
    }
    notes = [
        f"{workers} workers: {args.collectors} remote MultiSyncCollectors x {args.workers_per_collector} workers, "
        "one per node (actors of 0.25 CPU on nodes of 1 CPU), forked workers",
        "a push returns once every worker applied it; update_policy_weights_() once each remote actor has "
        "loaded the weights (torchrl's RayWeightSyncScheme does not wait for the actor's own worker processes)",
        f"ratios: policy update / env-state push {summary['policy_over_env_state_push']:.2f}x, "
        f"restart / env-state push {summary['restart_over_env_state_push']:.0f}x, "
        f"restart / config push {summary['restart_over_config_push']:.0f}x",
    ]
    columns = [
        ("what", "operation"),
        ("payload", "payload"),
        ("median_ms", "median ms"),
        ("min_ms", "min ms"),
        ("max_ms", "max ms"),
        ("samples", "n"),
        ("over_env_state_push", "x env-state push"),
    ]
    tables = [("Median time per update (idle RayCollector)", columns)]
    return Report(NAME, args, rows, tables, summary, [], notes).write(args.out)


if __name__ == "__main__":
    main()
