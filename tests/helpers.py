"""Test envs and checks shared by the end-to-end tests (importable by spawn workers)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Bounded, Categorical, Composite, Unbounded
from torchrl.envs import EnvBase
from torchrl.envs.transforms import Transform

from envsync import AckTimeout
from envsync.envs import make_drift_env, start_method  # noqa: F401 (start_method: for the tests)


def set_action_reward_done_specs(env: EnvBase) -> None:
    """One float action in [-1, 1], a float reward, and done/terminated/truncated flags."""
    env.action_spec = Bounded(-1.0, 1.0, (1,))
    env.reward_spec = Unbounded((1,))
    env.done_spec = Composite(
        done=Categorical(2, (1,), dtype=torch.bool),
        terminated=Categorical(2, (1,), dtype=torch.bool),
        truncated=Categorical(2, (1,), dtype=torch.bool),
    )


class CounterEnv(EnvBase):
    """A torchrl-native env whose observation is ``[difficulty, label, step]``.

    ``label`` tells which worker built it; ``step`` counts steps in the episode, so a test can
    see dropped or duplicated frames. Episodes are truncated after ``max_steps``.
    """

    def __init__(self, label: int = 0, max_steps: int = 1000, difficulty: float = 0.0) -> None:
        super().__init__(batch_size=torch.Size([]))
        self.label = float(label)
        self.max_steps = max_steps
        self.difficulty = float(difficulty)
        self.count = 0
        self.observation_spec = Composite(observation=Unbounded((3,), dtype=torch.float32))
        set_action_reward_done_specs(self)

    def set_difficulty(self, difficulty: float) -> None:
        self.difficulty = float(difficulty)

    def _obs(self) -> torch.Tensor:
        return torch.tensor([self.difficulty, self.label, float(self.count)])

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDict:
        self.count = 0
        false = torch.zeros(1, dtype=torch.bool)
        return TensorDict(observation=self._obs(), done=false, terminated=false.clone(), truncated=false.clone())

    def _step(self, tensordict: TensorDictBase) -> TensorDict:
        self.count += 1
        truncated = torch.tensor([self.count >= self.max_steps])
        return TensorDict(
            observation=self._obs(),
            reward=torch.ones(1),
            done=truncated.clone(),
            terminated=torch.zeros(1, dtype=torch.bool),
            truncated=truncated,
        )

    def _set_seed(self, seed: int | None) -> None:
        return None


def make_counter_env(label: int = 0, max_steps: int = 1000) -> CounterEnv:
    return CounterEnv(label=label, max_steps=max_steps)


def drift_env() -> Any:
    return make_drift_env()


def push_to_a_killed_process(sender: Any, process: Any, *, timeout: float) -> tuple[AckTimeout, float]:
    """SIGKILL ``process`` (a worker, or a ``ParallelEnv``'s sub-process), then push and wait
    for "applied": return the ``AckTimeout`` the push raised and the seconds it took."""
    os.kill(process.pid, signal.SIGKILL)
    process.join(5)
    start = time.monotonic()
    try:
        sender.push(config={"difficulty": 1.0}, wait="applied", timeout=timeout)
    except AckTimeout as err:
        return err, time.monotonic() - start
    raise AssertionError("a push waiting for a killed process returned")


def unconfirmed_rollback(error: BaseException) -> list[str]:
    """The notes of a raised failure that say its rollback was not confirmed (the wait gave
    up on it: a failure must be raised with its rollback in place)."""
    return [note for note in getattr(error, "__notes__", []) if "not confirmed" in note]


def rows(batch: TensorDictBase) -> list[TensorDictBase]:
    """The batch as a list of time-ordered streams (one per env)."""
    batch = batch.cpu()
    return [batch] if batch.ndim == 1 else list(batch.reshape(-1, batch.shape[-1]).unbind(0))


def check_truthful(batch: TensorDictBase, difficulty_of_version: Mapping[int, Any], index: int) -> None:
    """Every frame's observations show the difficulty of the version its tags name."""
    for row in rows(batch):
        for tag_key, obs_key in (("env_version", "observation"), (("next", "env_version"), ("next", "observation"))):
            tags = row[tag_key].reshape(-1).tolist()
            seen = row[obs_key][..., index].reshape(-1).tolist()
            for tag, value in zip(tags, seen, strict=True):
                expected = difficulty_of_version[tag]
                allowed = expected if isinstance(expected, set) else {expected}
                assert any(abs(value - a) < 1e-5 for a in allowed), (tag_key, tag, value, allowed)


def tags_non_decreasing(batch: TensorDictBase) -> bool:
    return all(bool((row["next", "env_version"].diff() >= 0).all()) for row in rows(batch))


def picky_apply(env: Any, config: TensorDictBase) -> None:
    """An apply callable that refuses negative difficulties (after touching the env)."""
    base = env.base_env if hasattr(env, "base_env") else env
    base.set_difficulty(float(config["difficulty"]))
    if float(config["difficulty"]) < 0:
        raise ValueError("negative difficulty")


def picky_on_worker_one(env: Any, config: TensorDictBase) -> None:
    """An apply callable that fails on the env labelled 1 only, for negative difficulties."""
    base = env.base_env if hasattr(env, "base_env") else env
    base.set_difficulty(float(config["difficulty"]))
    if base.label == 1 and float(config["difficulty"]) < 0:
        raise ValueError("worker one refuses negative difficulty")


def make_normed_counter_env(label: int = 0) -> Any:
    from torchrl.envs import ObservationNorm, TransformedEnv

    norm = ObservationNorm(loc=torch.zeros(3), scale=torch.ones(3), in_keys=["observation"], standard_normal=True)
    return TransformedEnv(CounterEnv(label=label), norm)


class NoisyEnv(EnvBase):
    """A torchrl-native env whose observation is ``scale * N(0, 1)`` in 3 dims, plus the
    episode's step count under ``"count"`` (not normalised)."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__(batch_size=torch.Size([]))
        self.scale = float(scale)
        self.count = 0
        self.generator = torch.Generator().manual_seed(0)
        self.observation_spec = Composite(
            observation=Unbounded((3,), dtype=torch.float32), count=Unbounded((1,), dtype=torch.int64)
        )
        set_action_reward_done_specs(self)

    def set_scale(self, scale: float) -> None:
        self.scale = float(scale)

    def _obs(self) -> TensorDict:
        noise = torch.randn(3, generator=self.generator) * self.scale
        return TensorDict(observation=noise, count=torch.tensor([self.count]))

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDict:
        self.count = 0
        out = self._obs()
        for key in ("done", "terminated", "truncated"):
            out[key] = torch.zeros(1, dtype=torch.bool)
        return out

    def _step(self, tensordict: TensorDictBase) -> TensorDict:
        self.count += 1
        out = self._obs()
        out["reward"] = torch.ones(1)
        for key in ("done", "terminated", "truncated"):
            out[key] = torch.zeros(1, dtype=torch.bool)
        return out

    def _set_seed(self, seed: int | None) -> None:
        if seed is not None:
            self.generator.manual_seed(seed)


class ResetCounter(Transform):
    """A custom stateful transform: counts its ``reset_state`` calls."""

    def __init__(self) -> None:
        super().__init__(in_keys=[], out_keys=[])
        self.calls = 0

    def reset_state(self) -> None:
        self.calls += 1

    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        return next_tensordict


def make_noisy_env(norm: str = "observation_norm", label: int = 0) -> Any:
    """NoisyEnv with one stateful transform (``norm`` names which) and a StepCounter."""
    from torchrl.envs import Compose, ObservationNorm, StepCounter, TransformedEnv, VecNorm, VecNormV2

    first: Transform
    if norm == "observation_norm":
        first = ObservationNorm(loc=torch.zeros(3), scale=torch.ones(3), in_keys=["observation"], standard_normal=True)
    elif norm == "vecnorm":
        first = VecNorm(in_keys=["observation"], decay=0.99, new_api=False)
    elif norm == "vecnorm_v2":
        first = VecNormV2(in_keys=["observation"], decay=0.99)
    else:
        first = ResetCounter()
    env = NoisyEnv()
    env.generator.manual_seed(label)
    return TransformedEnv(env, Compose(first, StepCounter()))


class NoTruncationEnv(CounterEnv):
    """A CounterEnv whose done spec has no ``"truncated"`` key."""

    def __init__(self) -> None:
        super().__init__()
        self.done_spec = Composite(
            done=Categorical(2, (1,), dtype=torch.bool), terminated=Categorical(2, (1,), dtype=torch.bool)
        )

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDict:
        return super()._reset(tensordict).exclude("truncated")

    def _step(self, tensordict: TensorDictBase) -> TensorDict:
        return super()._step(tensordict).exclude("truncated")


def built_in_main_refused(label: int = 0, main_pid: int = 0) -> CounterEnv:
    """A factory that refuses to build an env in the process ``main_pid`` (a simulator that
    must not be initialised before workers fork)."""
    import os

    if os.getpid() == main_pid:
        raise RuntimeError("this env must not be built in the main process")
    return make_normed_counter_env(label)


def apply_breaking_reset(env: Any, config: TensorDictBase) -> None:
    """Sets the difficulty; a difficulty above 100 makes the next reset raise."""
    base = env.base_env if hasattr(env, "base_env") else env
    base.set_difficulty(float(config["difficulty"]))
    base.break_reset = float(config["difficulty"]) > 100


class FragileResetEnv(CounterEnv):
    """A CounterEnv whose reset raises once ``break_reset`` is set."""

    break_reset = False

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDict:
        if self.break_reset:
            raise RuntimeError("reset refused under this config")
        return super()._reset(tensordict, **kwargs)


def make_fragile_env(label: int = 0) -> FragileResetEnv:
    return FragileResetEnv(label=label)


class OffsetNoiseEnv(NoisyEnv):
    """A never-ending env whose observation is ``[difficulty, offset + scale * N(0, 1) x 2]``,
    with a worker-dependent offset and scale (``label``), plus the step count under ``"count"``."""

    def __init__(self, label: int = 0) -> None:
        super().__init__()
        self.label = label
        self.difficulty = 0.0
        self.generator.manual_seed(100 + label)

    def set_difficulty(self, difficulty: float) -> None:
        self.difficulty = float(difficulty)

    def _obs(self) -> TensorDict:
        noise = torch.randn(3, generator=self.generator) * (1.0 + self.label) + 3.0 * self.label
        noise[0] = self.difficulty  # the first feature shows the config
        return TensorDict(observation=noise, count=torch.tensor([self.count]))

    def _set_seed(self, seed: int | None) -> None:
        return None


def make_vecnorm_env(label: int = 0, decay: float = 1.0, v1: bool = False) -> Any:
    """OffsetNoiseEnv normalised by a VecNormV2 (or, ``v1``, a VecNorm) that keeps the raw
    observation."""
    from torchrl.envs import Compose, TransformedEnv, VecNorm, VecNormV2

    norm: Transform
    if v1:
        norm = VecNorm(in_keys=["observation"], out_keys=["observation_norm"], decay=decay, new_api=False)
    else:
        norm = VecNormV2(in_keys=["observation"], out_keys=["observation_norm"], decay=decay)
    return TransformedEnv(OffsetNoiseEnv(label), Compose(norm))


def make_batched_counters(kind: str = "serial", n: int = 3, first_label: int = 0, horizon: int = 0) -> Any:
    """A ``SerialEnv``/``ParallelEnv`` of ``n`` CounterEnvs labelled ``first_label + i``
    (their fleet env indices, when built in fleet order). ``horizon`` > 0 gives sub-env ``i``
    episodes of ``horizon + 2 * i`` steps, so sub-envs reset at different times."""
    from functools import partial

    fns = [
        partial(make_counter_env, label=first_label + i, max_steps=horizon + 2 * i if horizon else 1000)
        for i in range(n)
    ]
    return batched(kind, fns)


class NativeCounterEnv(EnvBase):
    """A natively batched CounterEnv (``batch_size=[n]``): row ``i`` observes ``[difficulty_i,
    first_label + i, step_i]`` and has episodes of ``horizon + 2 * i`` steps."""

    def __init__(self, n: int = 3, horizon: int = 1000, first_label: int = 0) -> None:
        super().__init__(batch_size=torch.Size([n]))
        self.labels = torch.arange(first_label, first_label + n, dtype=torch.float32)
        self.horizons = torch.tensor([horizon + 2 * i for i in range(n)])
        self.difficulty = torch.zeros(n)
        self.count = torch.zeros(n)
        self.observation_spec = Composite(observation=Unbounded((n, 3), dtype=torch.float32), shape=(n,))
        self.action_spec = Bounded(-1.0, 1.0, (n, 1))
        self.reward_spec = Unbounded((n, 1))
        flag = Categorical(2, (n, 1), dtype=torch.bool)
        self.done_spec = Composite(done=flag, terminated=flag.clone(), truncated=flag.clone(), shape=(n,))

    def set_difficulty(self, difficulty: torch.Tensor, env_ids: torch.Tensor) -> None:
        self.difficulty[env_ids] = difficulty.to(torch.float32)

    def set_difficulty_all(self, difficulty: torch.Tensor) -> None:
        self.difficulty[:] = difficulty.to(torch.float32)

    def _obs(self) -> torch.Tensor:
        return torch.stack([self.difficulty, self.labels, self.count], -1)

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDict:
        mask = None if tensordict is None else tensordict.get("_reset", None)
        rows = torch.ones(self.batch_size, dtype=torch.bool) if mask is None else mask.reshape(-1)
        self.count[rows] = 0
        false = torch.zeros(*self.batch_size, 1, dtype=torch.bool)
        return TensorDict(
            observation=self._obs(),
            done=false,
            terminated=false.clone(),
            truncated=false.clone(),
            batch_size=self.batch_size,
        )

    def _step(self, tensordict: TensorDictBase) -> TensorDict:
        self.count += 1
        truncated = (self.count >= self.horizons).unsqueeze(-1)
        return TensorDict(
            observation=self._obs(),
            reward=torch.ones(*self.batch_size, 1),
            done=truncated.clone(),
            terminated=torch.zeros_like(truncated),
            truncated=truncated,
            batch_size=self.batch_size,
        )

    def _set_seed(self, seed: int | None) -> None:
        return None


def make_native_counters(n: int = 3, first_label: int = 0, horizon: int = 0) -> NativeCounterEnv:
    return NativeCounterEnv(n, horizon or 1000, first_label)


def make_parallel_normed(n: int = 2) -> Any:
    """A ``ParallelEnv`` of ``n`` ObservationNorm'ed CounterEnvs labelled ``0..n-1``."""
    from functools import partial

    from torchrl.envs import ParallelEnv

    fns = [partial(make_normed_counter_env, label=i) for i in range(n)]
    return ParallelEnv(n, fns, mp_start_method=mp.get_start_method())


class SlowCounterEnv(CounterEnv):
    """A CounterEnv whose config method takes ``delay`` seconds, changing the difficulty
    first: an apply that overlaps a step shows as a frame of the new difficulty under the
    old tag."""

    def set_difficulty(self, difficulty: float, delay: float = 0.0) -> None:  # type: ignore[override]
        self.difficulty = float(difficulty)
        if delay:
            time.sleep(delay)


def make_slow_counter_env(label: int = 0) -> SlowCounterEnv:
    return SlowCounterEnv(label=label)


def batched(kind: str, fns: list[Any]) -> Any:
    """A ``SerialEnv`` (``kind="serial"``) or a ``ParallelEnv`` of the factories ``fns``."""
    from torchrl.envs import ParallelEnv, SerialEnv

    if kind == "serial":
        return SerialEnv(len(fns), fns)
    return ParallelEnv(len(fns), fns, mp_start_method=mp.get_start_method())


def make_slow_batched(kind: str = "serial", n: int = 2, first_label: int = 0) -> Any:
    """A ``SerialEnv``/``ParallelEnv`` of ``n`` SlowCounterEnvs labelled ``first_label + i``."""
    from functools import partial

    return batched(kind, [partial(make_slow_counter_env, label=first_label + i) for i in range(n)])


class SlowOffsetNoiseEnv(OffsetNoiseEnv):
    """An OffsetNoiseEnv whose config method takes ``delay`` seconds, with episodes truncated
    after ``horizon`` steps (0: never)."""

    def __init__(self, label: int = 0, horizon: int = 0) -> None:
        super().__init__(label)
        self.horizon = horizon

    def _step(self, tensordict: TensorDictBase) -> TensorDict:
        out = super()._step(tensordict)
        if self.horizon and self.count >= self.horizon:
            out["done"] = out["truncated"] = torch.ones(1, dtype=torch.bool)
        return out

    def set_difficulty(self, difficulty: float, delay: float = 0.0) -> None:  # type: ignore[override]
        self.difficulty = float(difficulty)
        if delay:
            time.sleep(delay)


def make_slow_vecnorm_env(label: int = 0, horizon: int = 0) -> Any:
    """A SlowOffsetNoiseEnv normalised by a VecNormV2 that keeps the raw observation."""
    from torchrl.envs import Compose, TransformedEnv, VecNormV2

    norm = VecNormV2(in_keys=["observation"], out_keys=["observation_norm"], decay=1.0)
    return TransformedEnv(SlowOffsetNoiseEnv(label, horizon), Compose(norm))


def make_ppo_env() -> Any:
    """The env of torchrl's PPO reference (``sota-implementations/ppo/utils_mujoco.py``), on
    Pendulum: its normaliser is a ``VecNorm`` (v1) with ``decay=0.99999``."""
    from torchrl.envs import ClipTransform, Compose, GymEnv, RewardSum, StepCounter, TransformedEnv, VecNorm

    norm = VecNorm(in_keys=["observation"], decay=0.99999)
    clip = ClipTransform(in_keys=["observation"], low=-10, high=10)
    return TransformedEnv(GymEnv("Pendulum-v1"), Compose(norm, clip, RewardSum(), StepCounter()))


def set_gravity(env: Any, config: TensorDictBase) -> None:
    """An apply callable: Pendulum-v1's gravity ``g``, read by its every step."""
    env.base_env._env.unwrapped.g = float(config["g"])


def make_outer_normed(kind: str = "serial", n: int = 2, first_label: int = 0) -> Any:
    """A ``SerialEnv``/``ParallelEnv`` of ``n`` VecNormV2'ed OffsetNoiseEnvs labelled
    ``first_label + i``, itself normalised by a VecNormV2 of its own (the batched level) that
    writes ``"outer_norm"`` and keeps the raw observation."""
    from functools import partial

    from torchrl.envs import Compose, TransformedEnv, VecNormV2

    fns = [partial(make_vecnorm_env, first_label + i) for i in range(n)]
    norm = VecNormV2(in_keys=["observation"], out_keys=["outer_norm"], decay=1.0)
    return TransformedEnv(batched(kind, fns), Compose(norm))


def make_native_normed(n: int = 3, first_label: int = 0) -> Any:
    """A NativeCounterEnv whose rows are normalised by one ObservationNorm with a row of
    loc/scale per env (``"observation_norm"`` = (observation - loc) / scale; the raw
    observation is kept)."""
    from torchrl.envs import ObservationNorm, TransformedEnv

    norm = ObservationNorm(
        loc=torch.zeros(n, 3),
        scale=torch.ones(n, 3),
        in_keys=["observation"],
        out_keys=["observation_norm"],
        standard_normal=True,
    )
    return TransformedEnv(NativeCounterEnv(n, 1000, first_label), norm)


EXIT_REPORT = """
import atexit, threading

def envsync_threads():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("envsync-"))

@atexit.register  # runs last: after the interpreter waited for its threads (and Ray shut down)
def report():
    print("threads at exit:", envsync_threads())
"""


def run_to_exit(code: str, *args: str, timeout: float = 150) -> dict[str, str]:
    """Run ``code`` in a fresh interpreter, after :data:`EXIT_REPORT` (whose
    ``envsync_threads()`` it may print), with this directory and the repository importable;
    check that it exited cleanly (code 0, no abort); return its ``name: value`` lines,
    ``"threads at exit"`` among them (the envsync threads alive once the interpreter had
    waited for its threads)."""
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    path = os.pathsep.join(p for p in (str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")) if p)
    result = subprocess.run(
        [sys.executable, "-c", EXIT_REPORT + code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tests.parent,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "terminate called" not in result.stderr
    return dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)


class Trajectories:
    """Per trajectory (``("collector", "traj_ids")``), across the batches of a simulator test: the
    versions it ran (``mixed``: how many ran more than one), and the episodes that ended."""

    def __init__(self) -> None:
        self.ran: dict[tuple[int, int], set[int]] = {}
        self.ended = 0

    def add(self, batch: TensorDictBase) -> None:
        flat = batch.reshape(-1)
        keys = zip(flat["env_index"].tolist(), flat["collector", "traj_ids"].tolist(), strict=True)
        for key, version in zip(keys, flat["next", "env_version"].tolist(), strict=True):
            self.ran.setdefault(key, set()).add(version)
        self.ended += int(flat["next", "done"].sum())

    def mixed(self) -> int:
        return sum(len(versions) > 1 for versions in self.ran.values())


Factors = dict[tuple[int, int], tuple[float, ...]]
"""Per (env_index, env_version): that world's row of each pushed config name."""


def every_frame_names_its_physics(
    collector: Any,
    sender: Any,
    mode: str,
    names: tuple[str, ...],
    draw: Any,
    check: Any,
    *,
    worlds: int,
    frames: int = 10_000,
) -> None:
    """Drive a collector of simulator worlds: after every batch, push ``draw(generator, n)``
    (one row per world of each of ``names``), waiting until applied (until received in
    ``"reset"`` mode, where each world applies at its own reset); check every batch with
    ``check(batch, factors)`` -> (mis-tagged, checked) frames, the simulator's physics against
    the rows each frame's (env_index, env_version) names (:data:`Factors`). Then assert:
    ``worlds`` envs in the fleet, no frame mis-tagged over ``frames``, several versions ran,
    worlds ended episodes (partial resets), and a version lands inside a trajectory only in
    ``"step"`` mode. Shuts the collector down."""
    n, default = sender.num_envs, sender.desired_config()
    factors: Factors = {(env, 0): tuple(float(default[name]) for name in names) for env in range(n)}
    wrong = checked = 0
    trajectories, versions = Trajectories(), set()
    generator = torch.Generator().manual_seed(0)
    try:
        assert n == worlds, n
        for batch in collector:
            bad, count = check(batch, factors)
            wrong, checked = wrong + bad, checked + count
            trajectories.add(batch)
            versions |= set(batch["next", "env_version"].flatten().tolist())
            if checked >= frames:
                break
            rows = draw(generator, n)
            version = sender.push(config=rows, wait="received" if mode == "reset" else "applied")
            columns = torch.stack([rows[name].double() for name in names], dim=-1).tolist()
            factors.update({(env, version): tuple(row) for env, row in enumerate(columns)})
    finally:
        collector.shutdown()
        sender.close()
    assert checked >= frames and wrong == 0, (wrong, checked)
    assert len(versions) >= 4, versions
    assert trajectories.ended >= 2 * n, trajectories.ended  # worlds ended episodes: partial resets ran
    if mode == "step":  # a push lands mid-episode
        assert trajectories.mixed() > 0
    else:  # at a world's own reset, or after its running episode was cut: never inside one
        assert trajectories.mixed() == 0, trajectories.mixed()


def run_adr_example(name: str, out: Any) -> tuple[dict[str, Any], str]:
    """Run ``examples/<name>.py --smoke --out out`` as a script (the simulator examples run
    in their own venvs: this interpreter's); check that it exited cleanly and that both of
    its ADR ranges, mass and friction, widened out from [1, 1]; return its JSON log and its
    standard output."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    done = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    log = json.loads((Path(out) / f"{name}.json").read_text())
    first, last = log["ranges"][0], log["ranges"][-1]
    for range_name in ("mass", "friction"):
        assert last[range_name][0] < 1.0 < last[range_name][1], (range_name, last)  # both boundaries moved out
        assert (last[range_name][1] - last[range_name][0]) > (first[range_name][1] - first[range_name][0])
    return log, done.stdout


def kill_and_wait(actor: Any) -> None:
    """Kill a Ray ``actor`` and return once its process is gone (Ray fails calls to it a
    moment before that, while its relay can still relay a push that its workers then apply)."""
    import ray

    pid = ray.get(actor.__ray_call__.remote(lambda a: os.getpid()), timeout=30)
    ray.kill(actor)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)  # the local cluster's nodes are processes of this machine
        except ProcessLookupError:
            return
        time.sleep(0.01)
    raise AssertionError(f"the killed actor's process {pid} still runs")


class FlakyStateDict(Transform):
    """A transform with one buffer whose ``state_dict()`` raises once after being armed
    (``arm_flaky_read``): a transient failure while a worker answers a gather."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("level", torch.zeros(()))
        self.armed = False

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        if self.armed:
            self.armed = False
            raise OSError("transient failure reading the transform's state")
        return super().state_dict(*args, **kwargs)


def make_flaky_env(label: int = 0) -> Any:
    from torchrl.envs import TransformedEnv

    return TransformedEnv(CounterEnv(label=label), FlakyStateDict())


def make_batched_flaky(kind: str = "serial", n: int = 2, first_label: int = 0) -> Any:
    """A ``SerialEnv``/``ParallelEnv`` of ``n`` flaky envs labelled ``first_label + i``."""
    from functools import partial

    return batched(kind, [partial(make_flaky_env, label=first_label + i) for i in range(n)])


def arm_flaky_read(env: Any, config: TensorDictBase) -> None:
    """An apply callable: sets the difficulty, and arms the next state_dict() of the env
    labelled ``config["fail_read"] - 1`` to fail (0: none)."""
    env.base_env.set_difficulty(float(config["difficulty"]))
    if float(config["fail_read"]) == env.base_env.label + 1:
        env.transform.armed = True


def _flaky_transform_class() -> Any:
    from torchrl.envs import Transform

    class Flaky(Transform):
        """A batched-level transform whose ``recount`` (a ``reinit.call`` target) counts its
        runs in a buffer and appends a line to ``log``, and raises once when the file
        ``flag`` exists (it removes the flag first)."""

        def __init__(self, log: str, flag: str) -> None:
            super().__init__()
            self.log, self.flag = log, flag
            self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

        def recount(self) -> None:
            if os.path.exists(self.flag):
                os.remove(self.flag)
                raise RuntimeError(f"flaky batched level refuses (flag {self.flag})")
            self.calls += 1
            with open(self.log, "a") as out:
                out.write(f"{int(self.calls)}\n")

    return Flaky


def make_flaky_batched(kind: str, n: int, first_label: int, folder: str) -> Any:
    """A ``SerialEnv``/``ParallelEnv`` of ``n`` CounterEnvs labelled ``first_label + i``, or a
    natively batched CounterEnv (``kind="native"``), under a batched-level ``Flaky``
    transform logging to ``folder/log-<first_label>`` and failing once while
    ``folder/flag-<first_label>`` exists."""
    from torchrl.envs import TransformedEnv

    base = make_native_counters(n, first_label) if kind == "native" else make_batched_counters(kind, n, first_label)
    flaky = _flaky_transform_class()(f"{folder}/log-{first_label}", f"{folder}/flag-{first_label}")
    return TransformedEnv(base, flaky)
