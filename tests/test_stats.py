"""envsync.stats: exact merges against numpy references, and real VecNorm / VecNormV2 state."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import pytest
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Composite, Unbounded
from torchrl.envs import EnvBase, TransformedEnv, VecNorm, VecNormV2

from envsync.errors import ValidationError
from envsync.integrations.torchrl.vecnorm import (
    NestedKey,
    load_vecnorm_,
    load_vecnorm_v2_,
    vecnorm_moments,
    vecnorm_v2_moments,
    vecnorm_v2_updates,
)
from envsync.stats import Moments, delta, merge, merge_rounds

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

EXACT = 1e-10  # rtol and atol in float64
FLOAT32 = 1e-5  # what a float32 transform state holds
FEATURES = 3


def reference(x: np.ndarray, weights: np.ndarray | None = None) -> tuple[float, np.ndarray, np.ndarray]:
    """(weight, mean, m2) of the rows of ``x`` by numpy's two-pass formulas."""
    w = np.ones(len(x)) if weights is None else weights
    mean = np.average(x, axis=0, weights=w)
    return float(w.sum()), mean, (w[:, None] * (x - mean) ** 2).sum(axis=0)


def assert_moments(m: Moments, expected: tuple[float, np.ndarray, np.ndarray], tol: float) -> None:
    count, mean, m2 = expected
    np.testing.assert_allclose(m.count.numpy(), count, rtol=tol, atol=tol)
    np.testing.assert_allclose(m.mean.numpy(), mean, rtol=tol, atol=tol)
    np.testing.assert_allclose((m.m2 / m.count).numpy(), m2 / count, rtol=tol, atol=tol)


def samples(rng: np.random.Generator, n: int, offset: float = 5.0) -> np.ndarray:
    return rng.normal(offset, 2.0, size=(n, FEATURES)) * np.array([1.0, 0.1, 10.0])


def test_moments_of_samples_match_numpy_with_and_without_weights() -> None:
    rng = np.random.default_rng(0)
    x, w = samples(rng, 50), rng.uniform(0.1, 2.0, 50)
    assert_moments(Moments.from_samples(torch.from_numpy(x)), reference(x), EXACT)
    assert_moments(Moments.from_samples(torch.from_numpy(x), weights=torch.from_numpy(w)), reference(x, w), EXACT)
    by_column = Moments.from_samples(torch.from_numpy(x.T.copy()), dim=1)
    assert_moments(by_column, reference(x), EXACT)
    empty = Moments.from_samples(torch.from_numpy(x[:0]))
    assert empty.count.item() == 0 and empty.mean.abs().sum() == 0 and empty.var.abs().sum() == 0


@pytest.mark.parametrize("offset", [0.0, 1e4])
@pytest.mark.parametrize("seed", range(5))
def test_merge_of_random_partitions_equals_moments_of_concatenation(seed: int, offset: float) -> None:
    rng = np.random.default_rng(seed)
    x = samples(rng, 200, offset)
    cuts = np.sort(rng.integers(0, len(x), size=rng.integers(1, 8)))
    parts = [Moments.from_samples(torch.from_numpy(p)) for p in np.split(x, cuts)]  # some parts are empty
    order = rng.permutation(len(parts))
    assert_moments(merge(*(parts[i] for i in order)), reference(x), EXACT)


def test_merge_is_exact_for_weighted_parts() -> None:
    rng = np.random.default_rng(1)
    x, w = samples(rng, 60), rng.uniform(0.0, 3.0, 60)
    parts = [
        Moments.from_samples(torch.from_numpy(x[s]), weights=torch.from_numpy(w[s]))
        for s in np.split(np.arange(60), [7, 30])
    ]
    assert_moments(merge(*parts), reference(x, w), EXACT)


def test_delta_inverts_merge() -> None:
    rng = np.random.default_rng(2)
    x = samples(rng, 100, offset=50.0)
    old, added = Moments.from_samples(torch.from_numpy(x[:30])), Moments.from_samples(torch.from_numpy(x[30:]))
    recovered = delta(merge(old, added), old)
    assert_moments(recovered, reference(x[30:]), EXACT)
    again = merge(old, recovered)
    assert_moments(again, reference(x), EXACT)


def test_delta_of_an_unchanged_or_empty_accumulator_is_empty() -> None:
    m = Moments.from_samples(torch.arange(6.0).reshape(3, 2))
    for unchanged in (delta(m, m), delta(Moments.empty((2,)), Moments.empty((2,)))):
        assert unchanged.count.item() == 0
        assert unchanged.mean.abs().sum() == 0 and unchanged.m2.abs().sum() == 0
    assert_moments(delta(m, Moments.empty((2,))), reference(np.arange(6.0).reshape(3, 2)), EXACT)


def test_delta_rejects_an_old_snapshot_that_weighs_more() -> None:
    small, big = Moments.from_samples(torch.ones(2)), Moments.from_samples(torch.ones(5))
    with pytest.raises(ValidationError, match="earlier snapshot"):
        delta(small, big)


def test_moments_reject_a_negative_count_and_merge_needs_a_part() -> None:
    with pytest.raises(ValidationError):
        Moments(torch.tensor(-1.0), torch.zeros(1), torch.zeros(1))
    with pytest.raises(ValidationError):
        merge()


class Accumulator:
    """An exponentially weighted accumulator kept as raw weighted sums, the way a worker keeps one."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.sums = np.zeros((3, FEATURES))  # sum(w), sum(w x), sum(w x^2)

    def update(self, x: np.ndarray) -> None:
        self.sums = self.decay * self.sums + np.stack([np.ones_like(x), x, x**2])

    def moments(self) -> Moments:
        weight, total, squares = (torch.from_numpy(s) for s in self.sums)
        return Moments(weight[0], total / weight, squares - total**2 / weight)

    def load(self, m: Moments) -> None:
        mean = m.mean.numpy()
        self.sums = np.stack(
            [np.full(FEATURES, m.count.item()), m.count.item() * mean, m.m2.numpy() + m.count.item() * mean**2]
        )


@pytest.mark.parametrize("decay", [1.0, 0.9])
def test_rounds_of_deltas_count_every_sample_once(decay: float) -> None:
    rng = np.random.default_rng(3)
    workers, rounds, steps = 3, 4, 7
    accs = [Accumulator(decay) for _ in range(workers)]
    base = Moments.empty((FEATURES,))
    seen: list[tuple[int, np.ndarray]] = []  # (update index, value)
    for r in range(rounds):
        for acc in accs:
            for t in range(steps):
                x = rng.normal(r, 1.0 + r, FEATURES)
                acc.update(x)
                seen.append((r * steps + t, x))
        aged = base.scaled(decay**steps)
        base = merge_rounds(base, [delta(acc.moments(), aged) for acc in accs], base_factor=decay**steps)
        for acc in accs:
            acc.load(base)
    ages = rounds * steps - 1 - np.array([t for t, _ in seen])
    # Raw sums lose about 1e-12 of the variance to cancellation, hence not EXACT.
    assert_moments(base, reference(np.stack([x for _, x in seen]), decay**ages), 1e-9)


class Replay(EnvBase):
    """Emits known observations and rewards, and logs every value it emits."""

    def __init__(self, seed: int, reward_offset: float = 1.0) -> None:
        super().__init__(batch_size=())
        self.rng = np.random.default_rng(seed)
        self.reward_offset = reward_offset
        self.observations: list[tuple[int, np.ndarray]] = []  # (update index of the key, value)
        self.rewards: list[tuple[int, np.ndarray]] = []
        self.observation_spec = Composite(observation=Unbounded((FEATURES,)))
        self.reward_spec = Unbounded((1,))
        self.action_spec = Unbounded((1,))

    def _emit(self, log: list[tuple[int, np.ndarray]], value: np.ndarray) -> torch.Tensor:
        log.append((len(log), value))
        return torch.from_numpy(value).float()

    def _observation(self) -> torch.Tensor:
        return self._emit(self.observations, samples(self.rng, 1)[0].astype(np.float32).astype(np.float64))

    def _done(self, **entries: torch.Tensor) -> TensorDictBase:
        no = torch.zeros(1, dtype=torch.bool)
        return TensorDict(done=no, terminated=no, **entries)

    def _reset(self, tensordict: TensorDictBase | None) -> TensorDictBase:
        return self._done(observation=self._observation())

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        value = self.rng.normal(self.reward_offset, 0.5, 1).astype(np.float32).astype(np.float64)
        return self._done(observation=self._observation(), reward=self._emit(self.rewards, value))

    def _set_seed(self, seed: int | None) -> None:
        self.rng = np.random.default_rng(seed)


def v2_env(seed: int, decay: float) -> TransformedEnv:
    return TransformedEnv(
        Replay(seed), VecNormV2(in_keys=["observation", "reward"], out_keys=["obs_n", "rew_n"], decay=decay)
    )


def v1_env(seed: int, decay: float) -> TransformedEnv:
    # VecNorm v1 cannot rename the reward (its spec check fails), so it normalises in place; the env logs raw values.
    return TransformedEnv(Replay(seed), VecNorm(in_keys=["observation", "reward"], decay=decay))


Reader = Callable[..., dict[NestedKey, Moments]]
Loader = Callable[..., dict[NestedKey, Moments]]
KINDS: dict[str, tuple[Callable[[int, float], TransformedEnv], Reader, Loader]] = {
    "v1": (v1_env, vecnorm_moments, load_vecnorm_),
    "v2": (v2_env, vecnorm_v2_moments, load_vecnorm_v2_),
}


def logged(envs: Sequence[TransformedEnv], key: str, decay: float = 1.0) -> tuple[float, np.ndarray, np.ndarray]:
    """Reference moments of every value the envs emitted for ``key``, weighing ``decay ** age``."""
    logs = [env.base_env.observations if key == "observation" else env.base_env.rewards for env in envs]
    values = np.stack([x for log in logs for _, x in log])
    ages = np.concatenate([len(log) - 1 - np.array([t for t, _ in log]) for log in logs])
    return reference(values, decay**ages)


def test_vecnorm_v2_moments_match_the_observations_it_saw() -> None:
    env = v2_env(0, decay=1.0)
    for steps in (40, 25, 60):  # every rollout resets: observations count resets, rewards do not
        env.rollout(steps)
    moments = vecnorm_v2_moments(env.transform)
    assert vecnorm_v2_updates(env.transform) == {"observation": 128, "reward": 125}
    for key in ("observation", "reward"):
        assert_moments(moments[key], logged([env], key), FLOAT32)


def test_vecnorm_moments_match_the_observations_it_saw() -> None:
    env = v1_env(0, decay=1.0)
    for steps in (40, 25, 60):
        env.rollout(steps)
    moments = vecnorm_moments(env.transform)
    for key in ("observation", "reward"):
        assert_moments(moments[key], logged([env], key), FLOAT32)


@pytest.mark.parametrize("decay", [0.95, 0.999])
@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_decayed_transforms_hold_the_documented_weighted_moments(kind: str, decay: float) -> None:
    make, read, _ = KINDS[kind]
    env = make(1, decay)
    env.rollout(30)
    env.rollout(50)
    for key, m in read(env.transform).items():
        assert_moments(m, logged([env], str(key), decay), FLOAT32)


@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_load_writes_in_place_and_round_trips(kind: str) -> None:
    make, read, load = KINDS[kind]
    env = make(2, 1.0)
    env.rollout(10)
    stats = env.transform._loc if kind == "v2" else env.transform._td
    before = [v.data_ptr() for v in stats.values(True, True)]
    target = Moments(torch.tensor(37.0), torch.tensor([1.0, -2.0, 3.5]), torch.tensor([3.0, 4.0, 5.0]))
    stored = load(env.transform, {"observation": target})["observation"]
    for m in (stored, read(env.transform)["observation"]):
        assert_moments(m, (37.0, target.mean.numpy(), target.m2.numpy()), FLOAT32)
    assert [v.data_ptr() for v in stats.values(True, True)] == before
    env.rollout(5)  # the transform keeps running from the loaded statistics: a reset and 5 steps
    assert read(env.transform)["observation"].count.item() == 37 + 6


def test_load_vecnorm_v2_with_decay_rounds_and_caps_the_weight_but_keeps_mean_and_variance() -> None:
    decay = 0.9
    env = v2_env(3, decay)
    env.rollout(5)
    mean, m2 = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 3.0])
    # 4.0 is the weight of 4.85 updates ((1 - 0.9**c) / 0.1 = 4), stored as 5; 100 is above the cap 1 / (1 - 0.9).
    for weight, updates in ((4.0, 5), (100.0, None)):
        stored = load_vecnorm_v2_(env.transform, {"observation": Moments(torch.tensor(weight), mean, m2 * weight)})
        m = stored["observation"]
        np.testing.assert_allclose(m.mean.numpy(), mean.numpy(), rtol=FLOAT32, atol=FLOAT32)
        np.testing.assert_allclose(m.var.numpy(), m2.numpy(), rtol=FLOAT32, atol=FLOAT32)
        if updates is None:
            assert m.count.item() == pytest.approx(1 / (1 - decay))
        else:
            assert vecnorm_v2_updates(env.transform)["observation"] == updates
            assert m.count.item() == pytest.approx((1 - decay**updates) / (1 - decay))


def test_load_rejects_unknown_keys_misfit_shapes_and_several_counts() -> None:
    env = v2_env(4, 1.0)
    env.rollout(3)
    fine = Moments(torch.tensor(2.0), torch.zeros(FEATURES), torch.ones(FEATURES))
    with pytest.raises(ValidationError, match="not normalised"):
        load_vecnorm_v2_(env.transform, {"nope": fine})
    with pytest.raises(ValidationError, match="does not fit"):
        load_vecnorm_v2_(env.transform, {"observation": Moments(torch.tensor(2.0), torch.zeros(4), torch.ones(4))})
    with pytest.raises(ValidationError, match="one count per key"):
        load_vecnorm_v2_(env.transform, {"observation": Moments(torch.arange(1.0, 4.0), torch.zeros(3), torch.ones(3))})
    with pytest.raises(ValidationError, match="no statistics"):
        vecnorm_moments(VecNorm(in_keys=["observation"]))


def sync_round(
    envs: Sequence[TransformedEnv], base: Mapping[NestedKey, Moments], kind: str, factors: Mapping[NestedKey, float]
) -> dict[NestedKey, Moments]:
    """One sync: read every worker, subtract the (aged) base it was given, merge, load into every worker."""
    _, read, load = KINDS[kind]
    current = [read(env.transform) for env in envs]
    merged = {
        key: merge_rounds(b, [delta(c[key], b.scaled(factors[key])) for c in current], base_factor=factors[key])
        for key, b in base.items()
    }
    stored = [load(env.transform, merged) for env in envs]
    return stored[0]


@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_syncing_real_transforms_over_rounds_equals_statistics_of_every_observation(kind: str) -> None:
    envs = [KINDS[kind][0](10 + i, 1.0) for i in range(3)]
    base: Mapping[NestedKey, Moments] = {"observation": Moments.empty((FEATURES,)), "reward": Moments.empty((1,))}
    for steps in ((20, 35, 5), (40, 10, 30), (15, 15, 15)):  # workers progress at different speeds
        for env, n in zip(envs, steps, strict=True):
            env.rollout(n)
        base = sync_round(envs, base, kind, {"observation": 1.0, "reward": 1.0})
        for key in ("observation", "reward"):
            assert_moments(base[key], logged(envs, key), FLOAT32)


def test_syncing_decayed_vecnorm_in_lockstep_weighs_each_value_by_its_age() -> None:
    decay, steps = 0.97, 12
    envs = [v1_env(20 + i, decay) for i in range(3)]
    base: Mapping[NestedKey, Moments] = {"observation": Moments.empty((FEATURES,)), "reward": Moments.empty((1,))}
    for _ in range(4):
        for env in envs:
            env.rollout(steps)  # a reset and `steps` steps: steps + 1 observation updates, `steps` reward updates
        base = sync_round(envs, base, "v1", {"observation": decay ** (steps + 1), "reward": decay**steps})
        for key in ("observation", "reward"):
            assert_moments(base[key], logged(envs, key, decay), FLOAT32)
