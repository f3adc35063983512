"""The matrix, end to end: one test per cell of {Collector, MultiSyncCollector,
MultiAsyncCollector, a RayCollector of each} x {plain env, SerialEnv(2), ParallelEnv(2), a
natively batched env of 2}, each with real workers (and, for Ray, the two-node local cluster).

Every cell asserts truthful tags (each frame shows the config row its ``env_version`` names,
for the env its ``env_index`` names), ``reinit`` (each env's ObservationNorm recomputed under
its own new row, on the main process's probe env; not for the natively batched env, whose
rows share one), the gathered state
(an env-state entry pushed to one env comes back from that env only) and a checkpoint round
trip (``state_dict()`` loaded into a new sender gives back the same config and env-state rows).
``docs/matrix.md`` is checked against this module: every test it names exists, and every cell
appears in it.

The Ray cells of a ``Collector`` run in ``make test``; those of ``MultiSyncCollector`` and
``MultiAsyncCollector`` (twice the actors' worker processes each) are marked ``wide``: ``make
wide`` (CI) and ``make soak`` run them.
"""

from __future__ import annotations

import functools
import importlib
import multiprocessing as mp
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import CounterEnv, make_native_normed, rows, start_method
from tensordict import TensorDictBase
from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector
from torchrl.envs import ObservationNorm, ParallelEnv, SerialEnv, TransformedEnv

from envsync import EnvStateSender, reinit

pytestmark = pytest.mark.timeout(240)

N = 2  # sub-envs of a batched env
WORKERS = 2  # workers of a Multi* collector
ENV_KINDS = ("plain", "serial", "parallel", "native")
COLLECTOR_KINDS = {"single": Collector, "sync": MultiSyncCollector, "async": MultiAsyncCollector}
SHIFT = torch.tensor([0.0, 0.0, 5.0])  # an ObservationNorm loc that leaves difficulty and label as they are


def make_normed_counter(label: int = 0) -> Any:
    """A CounterEnv normalised by an ObservationNorm that writes ``"observation_norm"``."""
    norm = ObservationNorm(
        loc=torch.zeros(3), scale=torch.ones(3), in_keys=["observation"], out_keys=["observation_norm"]
    )
    return TransformedEnv(CounterEnv(label=label), norm)


def make_env(kind: str, first_label: int = 0) -> Any:
    """An env of ``kind`` whose envs are labelled ``first_label + i``, each with an
    ObservationNorm (one per sub-env, or one of a row per env for the native env)."""
    if kind == "plain":
        return make_normed_counter(first_label)
    if kind == "native":
        return make_native_normed(N, first_label)
    fns = [functools.partial(make_normed_counter, first_label + i) for i in range(N)]
    if kind == "serial":
        return SerialEnv(N, fns)
    return ParallelEnv(N, fns, mp_start_method=mp.get_start_method())


def envs_per_worker(env_kind: str) -> int:
    return 1 if env_kind == "plain" else N


def local_collector(kind: str, env_kind: str, sender: EnvStateSender) -> Any:
    cls = COLLECTOR_KINDS[kind]
    workers = 1 if cls is Collector else WORKERS
    per = envs_per_worker(env_kind)
    factories = [sender.env_fn(functools.partial(make_env, env_kind, w * per)) for w in range(workers)]
    with start_method("fork"):
        return cls(
            factories[0] if cls is Collector else factories,
            None,
            frames_per_batch=8 * workers * per,
            total_frames=-1,
            weight_sync_schemes=sender.schemes(),
        )


def ray_collector(kind: str, env_kind: str, sender: EnvStateSender) -> Any:
    """A RayCollector of two remote ``kind`` collectors, one pinned to each node."""
    from torchrl.collectors.distributed import RayCollector

    cls = COLLECTOR_KINDS[kind]
    nodes = ("n0", "n1")
    return RayCollector(
        [sender.env_fn(functools.partial(make_env, env_kind))] * len(nodes),
        None,
        collector_class=cls,
        num_workers_per_collector=1 if cls is Collector else WORKERS,
        frames_per_batch=8 * len(nodes) * envs_per_worker(env_kind),
        total_frames=10**9,
        remote_configs=[{"num_cpus": 0.25, "memory": 150 * 2**20, "resources": {n: 0.01}} for n in nodes],
        **sender.ray_kwargs(start_method="fork"),
    )


def check_tags(batch: TensorDictBase, difficulty: dict[int, dict[int, float]], labelled: bool) -> None:
    """Every frame shows the difficulty of the version its tags name, for the env its
    ``env_index`` names (which, ``labelled``, is also the label the env was built with)."""
    for row in rows(batch):
        if labelled:
            assert row["env_index"].eq(row["observation"][:, 1].long()).all()
        for tag, obs in (("env_version", "observation"), (("next", "env_version"), ("next", "observation"))):
            for env, version, value in zip(
                row["env_index"].tolist(), row[tag].tolist(), row[obs][:, 0].tolist(), strict=True
            ):
                assert abs(difficulty[env][version] - value) < 1e-5, (tag, env, version, value)


def collect_until_shown(it: Any, version: int, num_envs: int, check: Any) -> TensorDictBase:
    """Collect (checking every batch) until a batch whose every frame is of ``version`` and
    every env has shown it: collectors may hand out batches begun before the push."""
    shown: set[int] = set()
    for _ in range(40):
        batch = next(it)
        check(batch)
        tags = batch["next", "env_version"].reshape(-1)
        shown.update(batch["next", "env_index"].reshape(-1)[tags == version].tolist())
        if len(shown) == num_envs and bool(tags.eq(version).all()):
            return batch
    raise AssertionError(f"version {version} not shown by every env within 40 batches")


def exercise(sender: EnvStateSender, collector: Any, labelled: bool, recomputed: bool) -> dict[str, Any]:
    """Tags, gathered state and a checkpoint of a running cell; returns the checkpoint.
    ``recomputed``: the sender recomputes every env's ObservationNorm at a config change."""
    it = iter(collector)
    n = sender.num_envs
    difficulty: dict[int, dict[int, float]] = {e: {0: 0.0} for e in range(n)}
    values = torch.arange(n, dtype=torch.float32) + 10.0  # a row per env: the frames name their env
    version = sender.push(config={"difficulty": values}, wait="applied", timeout=60)
    for env in range(n):
        difficulty[env][version] = float(values[env])
    batch = collect_until_shown(it, version, n, lambda b: check_tags(b, difficulty, labelled))
    for row in rows(batch):
        assert row["next", "observation"][:, 0].eq(values[int(row["env_index"][0])]).all()

    target = n - 1
    state_version = sender.push(env_state={"loc": SHIFT}, envs=[target], wait="applied", timeout=60)
    assert sender.env_versions()[target] == state_version
    loc = sender.gather(["loc"], timeout=60)["loc"]
    assert loc.shape[0] == n
    for env in range(n):
        if env == target:
            assert loc[env].equal(SHIFT), (env, loc[env])
        elif recomputed:  # under the env's own row (on the main process's probe env, and
            # sent with the row): the constant difficulty is only centred (loc = -mean)
            assert abs(float(loc[env][0]) + float(values[env])) < 1e-5, (env, loc[env])
        else:
            assert loc[env].equal(torch.zeros(3)), (env, loc[env])
    one = sender.gather(["loc"], envs=[target], timeout=60)["loc"]
    assert one.shape[0] == 1 and one[0].equal(SHIFT)
    return sender.state_dict()


def check_round_trip(checkpoint: dict[str, Any]) -> None:
    resumed = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    try:
        resumed.load_state_dict(checkpoint)
        again = resumed.state_dict()
    finally:
        resumed.close()
    for part in ("config", "env_state", "env_state_rows"):  # the version is the new sender's own
        torch.testing.assert_close(again.get(part), checkpoint.get(part), rtol=0, atol=0, msg=part)


def run_cell(kind: str, env_kind: str) -> None:
    """Build the cell's collector, exercise it and check its checkpoint round trip."""
    remote = kind.startswith("ray-")
    # a natively batched env's rows share one ObservationNorm: its reinit is refused at
    # attach (tests/test_batched_state.py), so that cell runs without. where="main": each
    # row's statistics travel with it as env state, so the env-state push after it (which
    # in-worker recomputation would recompute over) comes back as pushed
    recomputed = env_kind != "native"
    policies = {"ObservationNorm": reinit.recompute(8, where="main")} if recomputed else None
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step", reinit=policies)
    try:
        build = ray_collector if remote else local_collector
        collector = build(kind.removeprefix("ray-"), env_kind, sender)
        try:
            checkpoint = exercise(sender, collector, labelled=not remote, recomputed=recomputed)
        finally:
            collector.shutdown()
    finally:
        sender.close()
    check_round_trip(checkpoint)


LOCAL_CELLS = [(kind, env) for kind in COLLECTOR_KINDS for env in ENV_KINDS]
RAY_CELLS = [(f"ray-{kind}", env) for kind in COLLECTOR_KINDS for env in ENV_KINDS]


@pytest.mark.parametrize(("kind", "env_kind"), LOCAL_CELLS, ids=[f"{k}-{e}" for k, e in LOCAL_CELLS])
def test_cell(kind: str, env_kind: str) -> None:
    run_cell(kind, env_kind)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("kind", "env_kind"),
    [pytest.param(k, e, id=f"{k}-{e}", marks=() if k == "ray-single" else pytest.mark.wide) for k, e in RAY_CELLS],
)
def test_ray_cell(cluster: Any, kind: str, env_kind: str) -> None:
    run_cell(kind, env_kind)


# ---- docs/matrix.md is checked against this module ---------------------------------------

MATRIX = Path(__file__).resolve().parent.parent / "docs" / "matrix.md"
NAMED = re.compile(r"`(tests/test_\w+\.py)::(\w+)(?:\[[^\]]*\])?`")


def test_every_test_the_docs_matrix_names_exists() -> None:
    named = NAMED.findall(MATRIX.read_text())
    assert named, "docs/matrix.md names no tests"
    for path, function in named:
        module = importlib.import_module(Path(path).stem)
        assert callable(getattr(module, function, None)), f"{path}::{function} named in docs/matrix.md"


def test_every_cell_appears_in_the_docs_matrix() -> None:
    text = MATRIX.read_text()
    for kind, env_kind in LOCAL_CELLS + RAY_CELLS:
        test = "test_ray_cell" if kind.startswith("ray-") else "test_cell"
        assert f"`tests/test_matrix.py::{test}[{kind}-{env_kind}]`" in text, (kind, env_kind)
