"""Curriculum PPO: envsync raises the difficulty of running workers when the agent is ready.

PPO (torchrl's ``ClipPPOLoss`` + ``GAE``) learns envsync's ``DriftEnv``: keep a point near 0
against a drift whose strength is the *difficulty* (reward ``1 - |x|`` per step, 50 steps).
Four workers collect through one ``MultiAsyncCollector`` that runs for the whole training.
``envsync.curriculum.Lessons`` holds one lesson per difficulty (ML-Agents' completion
criteria): when the mean return of the last ``window`` episodes run under the current lesson
passes ``threshold``, its ``observe(batch)`` in the main loop pushes the next difficulty;
each worker switches at its next episode reset, so no episode mixes two difficulties. The observation
goes through an ``ObservationNorm`` whose statistics envsync recomputes for every stage, once,
in the main process (``reinit.recompute(where="main")``), so all workers normalise alike.

Only episodes of the current lesson count towards the threshold: batches collected before a
switch still arrive afterwards, truthfully tagged with the older version, and the ledger
inside ``Lessons`` credits each episode to the config it ran. The
env_version of every batch is logged, and the learning curve (mean episode return per batch)
is written as a PNG with the difficulty stages marked.

Needs: envsync alone. The learning-curve plot needs matplotlib (`pip install "envsync[bench]"`);
without it the run goes on and says so instead of drawing.

    python examples/curriculum_ppo.py            # 4 workers, ~250k frames, a few minutes on 2 CPU cores
    python examples/curriculum_ppo.py --smoke    # 2 workers, a few batches
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torch import nn
from torchrl.collectors import MultiAsyncCollector
from torchrl.envs import Compose, ObservationNorm, TransformedEnv
from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE

from envsync import EnvStateSender, curriculum, reinit
from envsync.envs import MAX_EPISODE_STEPS, make_drift_env

DEFAULT_OUT = Path(__file__).resolve().parent / "out"
STAGES = (0.0, 0.4, 0.8, 1.2, 1.6, 2.0)


@dataclass
class Args:
    """Arguments of the example."""

    workers: int = 4
    total_frames: int = 200_000
    frames_per_batch: int = 500
    threshold: float = 44.0
    window: int = 40
    log_every: int = 25
    epochs: int = 4
    minibatch: int = 125
    lr: float = 1e-3
    gamma: float = 0.98
    seed: int = 0
    norm_steps: int = 500
    out: Path = DEFAULT_OUT

    @classmethod
    def smoke(cls) -> Args:
        """A tiny budget for CI: a low threshold so that the curriculum moves at once."""
        return cls(workers=2, total_frames=3_000, frames_per_batch=200, threshold=5.0, window=4, epochs=1, log_every=3)


def make_env() -> TransformedEnv:
    """``DriftEnv`` (observation ``[x, difficulty]``), normalised, with the episode return summed
    up. envsync recomputes the normalisation at every stage (see ``train``)."""
    norm = ObservationNorm(
        loc=torch.zeros(2),
        scale=torch.ones(2),
        in_keys=["observation"],
        out_keys=["observation_norm"],  # the raw observation stays, to check the tags against
        standard_normal=True,
    )
    return TransformedEnv(make_drift_env(), Compose(norm))


def make_agent(env: Any) -> tuple[ProbabilisticActor, ValueOperator]:
    """A tanh-Gaussian actor and a value network, both small MLPs over the observation."""
    observation = env.observation_spec["observation"].shape[-1]
    action = env.action_spec.shape[-1]
    actor = ProbabilisticActor(
        TensorDictModule(
            nn.Sequential(
                MLP(in_features=observation, out_features=2 * action, num_cells=[64, 64], activation_class=nn.Tanh),
                NormalParamExtractor(),
            ),
            in_keys=["observation_norm"],
            out_keys=["loc", "scale"],
        ),
        spec=env.action_spec,
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
        distribution_kwargs={"low": -1.0, "high": 1.0},
        return_log_prob=True,
    )
    value = ValueOperator(
        MLP(in_features=observation, out_features=1, num_cells=[64, 64], activation_class=nn.Tanh),
        in_keys=["observation_norm"],
    )
    return actor, value


@dataclass
class Log:
    """One row per batch, plus the stage switches."""

    frames: list[int] = field(default_factory=list)
    mean_return: list[float | None] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    switches: list[dict[str, Any]] = field(default_factory=list)
    difficulty_of: dict[int, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def make_lessons(args: Args, sender: EnvStateSender) -> curriculum.Lessons:
    """One lesson per stage, left when the mean return of its last ``window`` episodes passes
    ``threshold`` (ML-Agents' completion criteria, without smoothing)."""
    stages = [
        curriculum.Lesson(
            {"difficulty": difficulty},
            name=f"difficulty {difficulty:g}",
            threshold=args.threshold,
            min_lesson_length=args.window,
            signal_smoothing=False,
        )
        for difficulty in STAGES
    ]
    return curriculum.Lessons(sender, stages)


def train_step(batch: TensorDictBase, loss: ClipPPOLoss, gae: GAE, optim: torch.optim.Optimizer, args: Args) -> None:
    with torch.no_grad():
        gae(batch)
    data = batch.reshape(-1)
    for _ in range(args.epochs):
        for index in torch.randperm(data.numel()).split(args.minibatch):
            losses = loss(data[index])
            total = losses["loss_objective"] + losses["loss_critic"] + losses["loss_entropy"]
            optim.zero_grad()
            total.backward()
            nn.utils.clip_grad_norm_(loss.parameters(), 1.0)
            optim.step()


def check_truthful(batch: TensorDictBase, difficulty_of: dict[int, float]) -> bool:
    """Every observation shows the difficulty of the version its tag names."""
    for tag, obs in (("env_version",), ("observation",)), (("next", "env_version"), ("next", "observation")):
        expected = torch.tensor([difficulty_of[v] for v in batch[tag].reshape(-1).tolist()])
        if not torch.allclose(batch[obs][..., 1].reshape(-1), expected):
            return False
    return True


def train(args: Args) -> Log:
    """Train with the curriculum; return the per-batch log."""
    torch.manual_seed(args.seed)
    probe = make_env()
    actor, value = make_agent(probe)
    probe.close()
    loss = ClipPPOLoss(actor, value, clip_epsilon=0.2, entropy_coeff=1e-3, normalize_advantage=True)
    gae = GAE(gamma=args.gamma, lmbda=0.95, value_network=value, average_gae=False)
    optim = torch.optim.Adam(loss.parameters(), lr=args.lr)
    sender = EnvStateSender(
        config={"difficulty": STAGES[0]},
        apply="set_difficulty",
        apply_at="reset",
        # fresh statistics for each stage, computed once in this process: every worker
        # normalises identically
        reinit={"ObservationNorm": reinit.recompute(num_iter=args.norm_steps, where="main")},
    )
    collector = MultiAsyncCollector(
        [sender.env_fn(make_env)] * args.workers,
        actor,
        frames_per_batch=args.frames_per_batch,
        total_frames=args.total_frames,
        weight_sync_schemes=sender.schemes(),
    )
    lessons = make_lessons(args, sender)
    log = Log(difficulty_of={0: STAGES[0], lessons.since: STAGES[0]})
    frames, stage = 0, 0
    try:
        for i, batch in enumerate(collector):
            frames += batch.numel()
            episodes = lessons.observe(batch)  # attributes the episodes; pushes the next lesson when it is time
            returns = [e.episode_return for e in episodes]
            log.frames.append(frames)
            log.mean_return.append(sum(returns) / len(returns) if returns else None)
            log.versions.append(sorted(set(batch["next", "env_version"].reshape(-1).tolist())))
            if i % args.log_every == 0:
                shown = "   n/a" if log.mean_return[-1] is None else f"{log.mean_return[-1]:6.2f}"
                print(f"batch {i:>4}  frames {frames:>7}  env_version {log.versions[-1]}  mean return {shown}")
            if not check_truthful(batch, log.difficulty_of):
                log.failures.append(f"batch {i}: a tag names a difficulty its observation does not show")
            if lessons.lesson != stage:
                stage, version, difficulty = lessons.lesson, lessons.since, STAGES[lessons.lesson]
                log.difficulty_of[version] = difficulty
                log.switches.append({"batch": i, "frames": frames, "version": version, "difficulty": difficulty})
                print(f"frames {frames:>7}: return > {args.threshold:g}, pushed v{version}: difficulty {difficulty}")
            train_step(batch, loss, gae, optim, args)
            collector.update_policy_weights_()
    finally:
        collector.shutdown()
        sender.close()
    return log


def first_batch_of(log: Log, version: int) -> int | None:
    """Frames collected before the first batch holding ``version``, or ``None``."""
    before = [0, *log.frames]
    return next((before[i] for i, vs in enumerate(log.versions) if version in vs), None)


def plot(log: Log, path: Path, threshold: float) -> None:
    """The learning curve, coloured by the newest version in each batch, with the stages shaded."""
    if importlib.util.find_spec("matplotlib") is None:
        print(f'no plot ({path.name}): matplotlib is missing; pip install "envsync[bench]"')
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(10, 4.5))
    difficulty_of = log.difficulty_of
    colours = plt.get_cmap("viridis", len(difficulty_of))
    starts = {v: first_batch_of(log, v) for v in difficulty_of}
    shown = sorted((f, v) for v, f in starts.items() if f is not None)
    ends = [f for f, _ in shown[1:]] + [log.frames[-1]]
    for (start, version), end in zip(shown, ends, strict=True):
        axis.axvspan(start, end, color=colours(version), alpha=0.12)
    rows = zip(log.frames, log.mean_return, log.versions, strict=True)
    points = [(f, r, max(vs)) for f, r, vs in rows if r is not None]
    for version, difficulty in difficulty_of.items():
        xs = [f for f, _, v in points if v == version]
        ys = [r for _, r, v in points if v == version]
        if xs:
            axis.scatter(xs, ys, s=8, color=colours(version), label=f"version {version}: difficulty {difficulty:g}")
    for switch in log.switches:
        axis.axvline(switch["frames"], color="grey", linestyle="--", linewidth=1)
    axis.axhline(threshold, color="red", linestyle=":", linewidth=1, label=f"threshold {threshold:g}")
    axis.set_xlabel("frames collected")
    axis.set_ylabel("mean episode return in the batch")
    axis.set_ylim(0, MAX_EPISODE_STEPS + 1)
    axis.set_title("PPO on DriftEnv, curriculum pushed by envsync (dashed: push; shaded: tagged batches)")
    axis.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny budget (CI)")
    for arg in dataclasses.fields(Args):
        parser.add_argument(f"--{arg.name.replace('_', '-')}", type=type(arg.default), default=None)
    given = vars(parser.parse_args(argv))
    args = Args.smoke() if given.pop("smoke") else Args()
    return dataclasses.replace(args, **{k: v for k, v in given.items() if v is not None})


def main(argv: Sequence[str] | None = None) -> None:
    """Train; exit non-zero if the curriculum never moved or a tag lied."""
    args = parse_args(argv)
    start = time.perf_counter()
    log = train(args)
    elapsed = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    plot(log, args.out / "curriculum_ppo.png", args.threshold)
    (args.out / "curriculum_ppo.json").write_text(json.dumps(dataclasses.asdict(log), indent=2))
    seen = sorted({v for vs in log.versions for v in vs})
    print(f"{log.frames[-1] if log.frames else 0} frames in {elapsed:.0f} s; env_versions seen in the data: {seen}")
    print("stages reached: " + ", ".join(f"difficulty {log.difficulty_of[v]:g} (version {v})" for v in seen))
    if not log.switches or log.switches[0]["version"] not in seen:
        log.failures.append("the curriculum never moved to a harder stage that the data shows")
    if log.failures:
        sys.exit("FAILED:\n" + "\n".join(log.failures))


if __name__ == "__main__":
    main()
