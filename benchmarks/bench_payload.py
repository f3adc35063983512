"""How does a push scale with the size of what it carries?

Each worker env carries a transform with a float32 buffer of 1 KB, 1 MB or 32 MB (think
``ObservationNorm`` statistics of a large observation), as ``transforms.0.buf`` of its
``state_dict()``, and takes a config ``table`` of the same size (think a terrain height map;
its config method keeps it, see ``bench_envs.keep_table``). On an idle ``MultiAsyncCollector``
with 1, 2 and 4 workers, in the same run:

- envsync, env state: ``push(env_state={"transforms.0.buf": t}, wait="applied")``;
- envsync, config: ``push(config={"table": t}, wait="applied")``;
- torchrl: ``collector.map_fn("env.transform[0].set_buf", [(t,)] * workers)``, the tensor
  carried through the pipes (torch moves it into shared memory and passes a handle);
- torchrl: ``update_policy_weights_()`` of a policy whose weights hold the same bytes
  (``bench_envs.BigPolicy``), on a second idle collector of as many workers with torchrl's
  default scheme (shared memory: it copies the weights into the buffer the workers read and
  returns; no worker copies or acknowledges);
- the memcpy floor: ``workers`` x one ``dst.copy_(src)`` of that size in this process.

Every repeat pushes a fresh tensor (so nothing is cached), the same for every path.

    python benchmarks/bench_payload.py [--quick]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from bench_common import RESULTS, Report, median, parse_args, save_plot, start_method, target, timed
from bench_envs import BigPolicy, keep_table, make_buffer_env
from tqdm import tqdm

from envsync import EnvStateSender

NAME = "payload"
KEY = "transforms.0.buf"
KB, MB = 1 << 10, 1 << 20


@dataclass
class Args:
    sizes: list[int] = field(default_factory=lambda: [KB, MB, 32 * MB])  # bytes
    workers: list[int] = field(default_factory=lambda: [1, 2, 4])
    repeats: int = 10
    start_method: str = "fork"  # the push path is the same under spawn; fork builds faster
    quick: bool = False
    out: Path = RESULTS


def quick(args: Args) -> Args:
    return replace(args, sizes=[KB, MB], workers=[1, 2], repeats=2)


def _label(nbytes: int) -> str:
    return f"{nbytes // MB} MB" if nbytes >= MB else f"{nbytes // KB} KB"


def _memcpy(numel: int, workers: int) -> float:
    src, dst = torch.rand(numel), torch.empty(numel)
    dst.copy_(src)  # first touch of the pages is not part of a copy
    return sum(timed(lambda: dst.copy_(src)) for _ in range(workers))


def _measure(nbytes: int, workers: int, args: Args, bar: tqdm) -> dict[str, Any]:
    from tensordict.nn import TensorDictModule
    from torchrl.collectors import MultiAsyncCollector

    numel = nbytes // 4
    sender = EnvStateSender(config={"table": torch.zeros(numel)}, apply=keep_table, apply_at="step")
    policy = TensorDictModule(BigPolicy(numel), in_keys=["observation"], out_keys=["action"])
    collector = weighted = None
    times: dict[str, list[float]] = {"envsync": [], "config": [], "map_fn": [], "policy": [], "memcpy": []}
    try:
        with start_method(args.start_method):
            collector = MultiAsyncCollector(
                [sender.env_fn(partial(make_buffer_env, numel))] * workers,
                None,
                frames_per_batch=64,
                total_frames=-1,
                weight_sync_schemes=sender.schemes(),
            )
            weighted = MultiAsyncCollector(
                [partial(make_buffer_env, 1)] * workers, policy, frames_per_batch=64, total_frames=-1
            )
        table = policy.module.table
        for i in range(args.repeats + 1):
            ours, config, theirs, weights = (torch.rand(numel) for _ in range(4))
            seconds = {
                "envsync": timed(lambda t=ours: sender.push(env_state={KEY: t}, wait="applied")),
                "config": timed(lambda t=config: sender.push(config={"table": t}, wait="applied")),
                "map_fn": timed(lambda t=theirs: collector.map_fn("env.transform[0].set_buf", [(t,)] * workers)),
                "policy": timed(lambda t=weights: (table.data.copy_(t), weighted.update_policy_weights_())),
                "memcpy": _memcpy(numel, workers),
            }
            if i == 0:  # warm-up; also check that the paths really land in the workers' envs
                _check(collector, sender, workers, numel)
            else:
                for key, value in seconds.items():
                    times[key].append(value)
            bar.update()
    finally:
        for built in (collector, weighted):
            if built is not None:
                built.shutdown()
        sender.close()
    return _row(nbytes, workers, times)


def _check(collector: Any, sender: EnvStateSender, workers: int, numel: int) -> None:
    value = torch.full((numel,), 0.5)
    sender.push(env_state={KEY: value}, wait="applied")
    sums = collector.map_fn("env.transform[0].buf.sum")
    if any(abs(float(s) - 0.5 * numel) > 1e-3 * numel for s in sums):
        raise RuntimeError(f"envsync push did not reach the workers' buffers: {sums}")
    collector.map_fn("env.transform[0].set_buf", [(value * 2,)] * workers)
    if any(abs(float(s) - numel) > 1e-3 * numel for s in collector.map_fn("env.transform[0].buf.sum")):
        raise RuntimeError("map_fn did not reach the workers' buffers")
    sender.push(config={"table": value * 3}, wait="applied")
    if any(abs(float(s) - 1.5 * numel) > 1e-3 * numel for s in collector.map_fn("env.transform[0].table_sum")):
        raise RuntimeError("the config push did not reach the workers' envs")


def _row(nbytes: int, workers: int, times: dict[str, list[float]]) -> dict[str, Any]:
    row: dict[str, Any] = {
        "size": _label(nbytes),
        "bytes": nbytes,
        "workers": workers,
        "envsync_ms": median(times["envsync"]) * 1e3,
        "config_ms": median(times["config"]) * 1e3,
        "map_fn_ms": median(times["map_fn"]) * 1e3,
        "policy_ms": median(times["policy"]) * 1e3,
        "memcpy_ms": median(times["memcpy"]) * 1e3,
        "raw_s": times,
    }
    row["envsync_over_memcpy"] = row["envsync_ms"] / row["memcpy_ms"]
    row["config_over_memcpy"] = row["config_ms"] / row["memcpy_ms"]
    row["envsync_over_policy"] = row["envsync_ms"] / row["policy_ms"]
    row["config_over_policy"] = row["config_ms"] / row["policy_ms"]
    row["map_fn_over_envsync"] = row["map_fn_ms"] / row["envsync_ms"]
    return row


COLUMNS = [
    ("size", "payload"),
    ("workers", "workers"),
    ("envsync_ms", "env state push->applied (ms)"),
    ("config_ms", "config push->applied (ms)"),
    ("map_fn_ms", "map_fn with the tensor (ms)"),
    ("policy_ms", "torchrl update_policy_weights_ (ms)"),
    ("memcpy_ms", "memcpy floor (ms)"),
    ("envsync_over_memcpy", "env state / memcpy floor"),
    ("config_over_memcpy", "config / memcpy floor"),
    ("envsync_over_policy", "env state / policy update"),
    ("config_over_policy", "config / policy update"),
    ("map_fn_over_envsync", "map_fn / env state"),
]


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    big = max(rows, key=lambda r: (r["bytes"], r["workers"]))
    where = f"{big['size']} to {big['workers']} workers"
    return [
        target(f"{where}: env state / memcpy floor", big["envsync_over_memcpy"], 1.5, higher_is_better=False),
        target(f"{where}: config / memcpy floor", big["config_over_memcpy"], 1.5, higher_is_better=False),
        target(f"{where}: env state / update_policy_weights_", big["envsync_over_policy"], 1, higher_is_better=False),
        target(f"{where}: config / update_policy_weights_", big["config_over_policy"], 1, higher_is_better=False),
        target(f"{where}: map_fn / envsync", big["map_fn_over_envsync"], 5, higher_is_better=True),
    ]


def _plot(rows: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib.pyplot as plt

    sizes = sorted({r["bytes"] for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(4 * len(sizes), 4), squeeze=False)
    for ax, nbytes in zip(axes[0], sizes, strict=True):
        sel = [r for r in rows if r["bytes"] == nbytes]
        workers = [r["workers"] for r in sel]
        lines = (
            ("envsync_ms", "envsync env state"),
            ("config_ms", "envsync config"),
            ("map_fn_ms", "map_fn"),
            ("policy_ms", "torchrl update_policy_weights_"),
            ("memcpy_ms", "memcpy floor"),
        )
        for key, label in lines:
            ax.plot(workers, [r[key] for r in sel], marker="o", label=label)
        ax.set(title=_label(nbytes), xlabel="workers", ylabel="median time (ms, log)", yscale="log")
        ax.set_xticks(workers, [str(w) for w in workers])
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Pushing env state and config to idle workers")
    return save_plot(fig, out, NAME)


def run(args: Args) -> dict[str, Any]:
    rows = []
    with tqdm(total=len(args.sizes) * len(args.workers) * (args.repeats + 1), desc=NAME, unit="push") as bar:
        for nbytes in args.sizes:
            for workers in args.workers:
                bar.set_postfix(size=_label(nbytes), workers=workers)
                rows.append(_measure(nbytes, workers, args, bar))
    report = Report(
        name=NAME,
        args=args,
        rows=rows,
        tables=[("Median time to get the payload into every worker", COLUMNS)],
        summary={"plots": [_plot(rows, args.out).name]},
        targets=_targets(rows),
        notes=[
            f"collector: MultiAsyncCollector built with {args.start_method}, idle; apply_at='step'; a fresh "
            "tensor per repeat for each path",
            "memcpy floor: workers x one torch copy_ of the buffer, measured in this process in the same repeat",
        ],
    )
    return report.write(args.out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return run(parse_args(argv, Args, __doc__, quick))


if __name__ == "__main__":
    main()
