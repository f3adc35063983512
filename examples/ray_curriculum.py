"""A difficulty curriculum over a torchrl ``RayCollector`` on a two-node Ray cluster.

Two remote ``MultiSyncCollector``s (one per node, two workers each) collect envsync's
``DriftEnv`` for the whole run. When the mean return of the episodes *tagged with the current
version* passes a threshold (in smoke mode: after a fixed number of batches), the loop raises
the difficulty with one ``sender.push(config=...)``: one put into Ray's object store, relayed
to both nodes, applied by every worker at its next episode reset (``apply_at="reset"``).
A random policy stands in for the learner, so the curriculum stops at the stage whose return
falls below the threshold (``examples/curriculum_ppo.py`` shows a learner on one machine).

Every frame's observation carries the difficulty it ran under (``observation[..., 1]``); the
script checks that it is always the difficulty of the version the frame is tagged with, and
times each push (push -> every worker received it; batches until every worker applied it).

Without ``--address`` the script starts a local cluster of two nodes (``ray.cluster_utils``:
1 CPU and an 80 MB object store each) on loopback, 127.0.0.1, and shuts it down at the end.
Ray reads where it runs once, when it is imported: so :func:`main` sets
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` for a local cluster before anything imports Ray (torchrl
and ``envsync.EnvStateSender`` do; this file imports them where it uses them). With
``--address`` it sets nothing: on a real cluster each node runs on its own address.

Needs: the `ray` extra (`pip install "envsync[ray]"`); without it the script stops with that
line.

    python examples/ray_curriculum.py                  # 5 stages, threshold on the return
    python examples/ray_curriculum.py --smoke          # 3 stages, one every 2 batches (< 60 s)
    python examples/ray_curriculum.py --address auto   # an existing cluster
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import ipaddress
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDictBase

from envsync.envs import make_drift_env

if TYPE_CHECKING:
    from torchrl.envs import TransformedEnv

    from envsync import EnvStateSender

if importlib.util.find_spec("ray") is None:
    raise SystemExit('examples/ray_curriculum.py needs Ray: pip install "envsync[ray]"')

DEFAULT_OUT = Path(__file__).resolve().parent / "out"
STORE = 80 * 2**20  # bytes of object store per local node


@dataclass
class Args:
    """Arguments of the example."""

    address: str = ""  # an existing Ray cluster; empty: start a local two-node one
    collectors: int = 2  # remote collectors, one per node of the local cluster
    workers_per_collector: int = 2
    stages: int = 5  # difficulties 0, step, 2*step, ...
    step: float = 0.25
    threshold: float = 30.0  # mean return of the current version's episodes that advances a stage
    episodes_to_judge: int = 8  # episodes of the current version needed before judging
    advance_every: int = 0  # if > 0: advance after this many batches, whatever the return
    frames_per_batch: int = 400
    total_frames: int = 20_000
    out: Path = DEFAULT_OUT

    @classmethod
    def smoke(cls) -> Args:
        """A tiny budget for CI (well under a minute on 2 cores)."""
        return cls(stages=3, advance_every=2, frames_per_batch=200, total_frames=200 * 7)


def make_task_env() -> TransformedEnv:
    """``DriftEnv`` (observation ``[x, difficulty]``) with the episode return summed up."""
    from torchrl.envs import RewardSum, TransformedEnv

    return TransformedEnv(make_drift_env(), RewardSum())


@contextmanager
def ray_cluster(address: str) -> Iterator[list[dict[str, Any]]]:
    """Connect to ``address``, or start a local head + one node on loopback; yield the actors'
    options."""
    import ray
    from ray.cluster_utils import Cluster

    nodes = None
    if not address:
        host = ray.util.get_node_ip_address()
        if not ipaddress.ip_address(host).is_loopback:  # Ray was imported before main() set it
            raise SystemExit(f"a local cluster would run on {host}: set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 first")
        nodes = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "object_store_memory": STORE, "resources": {"n0": 1}},
        )
        nodes.add_node(num_cpus=1, object_store_memory=STORE, resources={"n1": 1})
        address = nodes.address
    ray.init(address=address, log_to_driver=False)
    # the env factory lives in this file, which the cluster's workers cannot import: send it by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    small = {"num_cpus": 0.25, "memory": 150 * 2**20}
    try:
        yield [small | ({"resources": {f"n{i % 2}": 0.01}} if nodes else {}) for i in range(2)]
    finally:
        ray.shutdown()
        if nodes is not None:
            nodes.shutdown()


@dataclass
class Push:
    """One stage: the version that carries it and what its push cost."""

    stage: int
    difficulty: float
    version: int
    batch: int
    received_ms: float
    applied_after_batches: int | None = None
    returns: list[float] = field(default_factory=list)


class Curriculum:
    """Judges the current stage from its tagged episodes and pushes the next one."""

    def __init__(self, args: Args, sender: EnvStateSender) -> None:
        self.args = args
        self.sender = sender
        self.pushes = [Push(stage=0, difficulty=0.0, version=0, batch=0, received_ms=0.0, applied_after_batches=0)]
        self.difficulty_of = {0: 0.0}
        self.frames = 0
        self.failures: list[str] = []

    @property
    def current(self) -> Push:
        return self.pushes[-1]

    def observe(self, index: int, batch: TensorDictBase) -> None:
        self._check_truthful(index, batch)
        self.frames += batch.numel()
        current = self.current
        if current.applied_after_batches is None and min(self.sender.versions()) >= current.version:
            current.applied_after_batches = index - current.batch + 1
        done = batch["next", "done"].reshape(-1)
        versions = batch["next", "env_version"].reshape(-1)[done]
        returns = batch["next", "episode_reward"].reshape(-1)[done]
        current.returns += returns[versions == current.version].tolist()
        if len(self.pushes) < self.args.stages and self._ready(index):
            self._advance(index + 1)

    def _ready(self, index: int) -> bool:
        if self.args.advance_every > 0:
            return index + 1 - self.current.batch >= self.args.advance_every
        returns = self.current.returns
        return len(returns) >= self.args.episodes_to_judge and sum(returns) / len(returns) >= self.args.threshold

    def _advance(self, batch: int) -> None:
        stage = len(self.pushes)
        difficulty = round(stage * self.args.step, 6)
        start = time.perf_counter()
        version = self.sender.push(config={"difficulty": difficulty}, wait="received", timeout=30)
        received_ms = (time.perf_counter() - start) * 1e3
        self.difficulty_of[version] = difficulty
        self.pushes.append(Push(stage, difficulty, version, batch, received_ms))

    def _check_truthful(self, index: int, batch: TensorDictBase) -> None:
        for tag, obs in (("env_version",), ("observation",)), (("next", "env_version"), ("next", "observation")):
            versions = batch[tag].reshape(-1).tolist()
            unknown = set(versions) - set(self.difficulty_of)
            if unknown:
                self.failures.append(f"batch {index}: {tag} names versions never pushed: {sorted(unknown)}")
                continue
            expected = torch.tensor([self.difficulty_of[v] for v in versions])
            if not torch.allclose(batch[obs][..., 1].reshape(-1), expected):
                self.failures.append(f"batch {index}: {tag} names a difficulty its observation does not show")


def run(args: Args) -> tuple[Curriculum, int]:
    """Collect ``total_frames``; return the curriculum and the number of remote workers."""
    from torchrl.collectors import MultiSyncCollector
    from torchrl.collectors.distributed import RayCollector

    from envsync import EnvStateSender

    with ray_cluster(args.address) as remote_configs:
        sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="reset")
        collector = RayCollector(
            [sender.env_fn(make_task_env)] * args.collectors,
            None,
            collector_class=MultiSyncCollector,
            num_workers_per_collector=args.workers_per_collector,
            frames_per_batch=args.frames_per_batch,
            total_frames=args.total_frames,
            remote_configs=[remote_configs[i % 2] for i in range(args.collectors)],
            **sender.ray_kwargs(start_method="fork"),
        )
        curriculum = Curriculum(args, sender)
        try:
            workers = sender.num_workers or 0
            for i, batch in enumerate(collector):
                curriculum.observe(i, batch)
        finally:
            collector.shutdown()
            sender.close()
    return curriculum, workers


def summary(curriculum: Curriculum, workers: int) -> dict[str, Any]:
    stages = [
        {
            "stage": p.stage,
            "difficulty": p.difficulty,
            "version": p.version,
            "pushed_after_batch": p.batch,
            "received_ms": p.received_ms,
            "applied_after_batches": p.applied_after_batches,
            "episodes": len(p.returns),
            "mean_return": sum(p.returns) / len(p.returns) if p.returns else None,
        }
        for p in curriculum.pushes
    ]
    return {
        "remote_workers": workers,
        "frames": curriculum.frames,
        "stages_reached": len(curriculum.pushes),
        "pushes": len(curriculum.pushes) - 1,
        "push_received_ms": [p.received_ms for p in curriculum.pushes[1:]],
        "stages": stages,
        "tags_truthful": not curriculum.failures,
        "failures": curriculum.failures,
    }


def report(result: dict[str, Any]) -> str:
    lines = [
        f"{result['remote_workers']} remote workers, {result['frames']} frames, "
        f"{result['pushes']} pushes, {result['stages_reached']} stages reached",
        "",
        "stage  difficulty  version  pushed at batch  push->received ms  batches to apply  episodes  mean return",
        "-----  ----------  -------  ---------------  -----------------  ----------------  --------  -----------",
    ]
    for s in result["stages"]:
        mean = "n/a" if s["mean_return"] is None else f"{s['mean_return']:.2f}"
        applied = "n/a" if s["applied_after_batches"] is None else str(s["applied_after_batches"])
        lines.append(
            f"{s['stage']:>5}  {s['difficulty']:>10.2f}  {s['version']:>7}  {s['pushed_after_batch']:>15}  "
            f"{s['received_ms']:>17.1f}  {applied:>16}  {s['episodes']:>8}  {mean:>11}"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny budget (CI)")
    for arg in dataclasses.fields(Args):
        parser.add_argument(f"--{arg.name.replace('_', '-')}", type=type(arg.default), default=None)
    given = vars(parser.parse_args(argv))
    args = Args.smoke() if given.pop("smoke") else Args()
    return dataclasses.replace(args, **{k: v for k, v in given.items() if v is not None})


def main(argv: Sequence[str] | None = None) -> None:
    """Run the curriculum; exit non-zero if a frame's tag and its observation disagree."""
    args = parse_args(argv)
    if not args.address:  # the local cluster on loopback: before Ray is imported (docs/ray.md)
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    curriculum, workers = run(args)
    result = summary(curriculum, workers)
    print(report(result))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ray_curriculum.json").write_text(json.dumps(result, indent=2))
    if curriculum.failures:
        sys.exit("FAILED:\n" + "\n".join(curriculum.failures))
    print(f"every frame showed the difficulty its tag names; JSON in {args.out}")


if __name__ == "__main__":
    main()
