"""Per-world physics in mjlab (MuJoCo Warp) through torchrl's ``MJLabEnv``, on Warp's CPU
device: ``attributes()``/``scales()`` paths into ``sim.model`` fields, one config row per world
of the natively batched env, checked from the simulator (a read of the model, the dynamics,
and an observation that carries each world's pole mass and derived subtree mass).

Runs in the mjlab venv (``make test-mjlab``): mjlab pins mujoco 3.11, the main venv has 4.0.
The first test of a fresh machine compiles Warp's kernels (about a minute here).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import run_adr_example, start_method
from tensordict import TensorDictBase

pytest.importorskip("mjlab")

from mjlab_envs import CART, EPISODE_STEPS, FALL, POLE, make_cartpole, make_cartpoles_32, make_cartpoles_64  # noqa: E402
from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector  # noqa: E402

import envsync  # noqa: E402
from envsync import EnvStateSender, ValidationError, curriculum  # noqa: E402
from envsync.configure import wrapper_chain  # noqa: E402

MASS = 0.1  # the pole's mass as built
SUBTREE = 1.1  # the cart's subtree mass as built (cart 1.0 + pole 0.1)
FRAMES = 10_000


def sim_of(env: Any) -> Any:
    """The mjlab ``Simulation`` of a torchrl env (for reading the model in checks)."""
    return wrapper_chain(env)[-1].sim


def mass_scales() -> Any:
    return envsync.apply.scales(
        {"mass": ["sim.model.body_mass", "sim.model.body_inertia"]}, finish=envsync.apply.recompute_constants()
    )


# ---- the mechanism, on one env -------------------------------------------------------------


@pytest.mark.timeout(300)  # the first test of a fresh machine compiles Warp's kernels
def test_one_worlds_mass_reaches_that_world_only_and_its_dynamics_follow() -> None:
    env = make_cartpole(4)
    sim = sim_of(env)
    assert sim.model.body_mass.stride(0) == 0  # as built, one copy shared by every world
    env.reset()
    apply = envsync.apply.attributes(finish=envsync.apply.recompute_constants()).bind(env)
    built = sim.model.body_mass[...].clone()
    heavier = built[1:2].clone()
    heavier[0, POLE] = 1.0
    apply({"sim.model.body_mass": heavier}, env_ids=torch.tensor([1]))
    assert "body_mass" in sim.expanded_fields and "body_subtreemass" in sim.expanded_fields
    mass = sim.model.body_mass[...]
    assert mass[:, POLE].tolist() == pytest.approx([MASS, 1.0, MASS, MASS])
    assert torch.equal(mass[[0, 2, 3]], built[[0, 2, 3]])
    assert sim.model.body_subtreemass[:, CART].tolist() == pytest.approx([SUBTREE, 2.0, SUBTREE, SUBTREE])
    data = sim.data  # the same state in every world, then the same physics steps
    data.qpos[:] = 0.0
    data.qvel[:] = 0.0
    data.qpos[:, 1] = 0.15
    data.ctrl[:] = 0.5
    sim.forward()
    for _ in range(30):
        sim.step()
    qpos = data.qpos[...]
    assert torch.equal(qpos[0], qpos[2]) and torch.equal(qpos[0], qpos[3])
    assert not torch.allclose(qpos[0], qpos[1], atol=1e-4)  # only the heavier pole moved otherwise
    env.close()


@pytest.mark.timeout(120)
def test_a_push_to_every_world_is_one_indexed_write_per_field_and_one_finish() -> None:
    from mjlab.sim.sim_data import TorchArray

    writes: list[Any] = []
    finishes: list[Any] = []
    original = TorchArray.__setitem__

    def counted(self: Any, index: Any, value: Any) -> None:
        writes.append(self)
        original(self, index, value)

    apply = mass_scales()
    finish = apply.finish
    apply.finish = lambda inner: (finishes.append(inner), finish(inner))
    sender = EnvStateSender(config={"mass": 1.0}, apply=apply, apply_at="reset")
    collector = Collector(
        sender.env_fn(lambda: make_cartpole(16)),
        None,
        frames_per_batch=32,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
    )
    try:
        next(iter(collector))
        version = sender.push(config={"mass": torch.linspace(0.5, 2.0, 16)})  # every world, at its reset
        finishes.clear()  # those of the binds (the sender's probe env, the collector's)
        TorchArray.__setitem__ = counted  # type: ignore[method-assign]
        try:
            collector.reset()  # every world resets at once: one safe point for all 16
        finally:
            TorchArray.__setitem__ = original  # type: ignore[method-assign]
        sender.wait(version, until="applied")
        model = sim_of(collector.env).model
        fields = [f for f in writes if f is model.body_mass or f is model.body_inertia]  # not the reset's state writes
        assert len(fields) == 2 and len(finishes) == 1  # body_mass and body_inertia, each once for 16 worlds
        assert model.body_mass[:, POLE].tolist() == pytest.approx((MASS * torch.linspace(0.5, 2.0, 16)).tolist())
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"sim": {"model": {"body_mass": torch.ones(3)}}}, "'sim.model.body_mass' is a float32 array of shape (8, 5)"),
        ({"sim": {"model": {"geom_contype": torch.ones(6)}}}, "'sim.model.geom_contype' is a int32 array"),
        ({"sim": {"model": {"body_masses": torch.ones(5)}}}, "'sim.model' (WarpBridge) has no attribute 'body_masses'"),
        ({"shared": torch.ones(3)}, "'shared' is a float32 array of shape (8, 3) whose rows share one memory"),
    ],
)
@pytest.mark.timeout(120)
def test_a_path_a_value_or_a_shared_array_that_does_not_fit_is_refused_at_attach_naming_the_path(
    config: dict[str, Any], message: str
) -> None:
    env = make_cartpole(8)
    wrapper_chain(env)[-1].shared = torch.zeros(1, 3).expand(8, 3)  # stride 0 and no simulator to expand it
    sender = EnvStateSender(config=config, apply=envsync.apply.attributes(), apply_at="step")
    with pytest.raises(ValidationError, match=re.escape(message)):
        sender.env_fn(env)
    sender.close()
    env.close()


@pytest.mark.timeout(120)
def test_from_env_reads_one_world_so_version_0_is_the_model_as_built() -> None:
    sender = EnvStateSender.from_env(
        lambda: make_cartpole(4),
        config=["sim.model.body_mass", "sim.model.geom_friction"],
        apply=envsync.apply.attributes(),
    )
    config = sender.desired_config()
    assert config["sim", "model", "body_mass"].shape == (5,) and config["sim", "model", "body_mass"][POLE] == MASS
    assert config["sim", "model", "geom_friction"].shape == (6, 3)
    sender.close()


# ---- every frame names the physics its world ran, in collectors ------------------------------


def check_frames(batch: TensorDictBase, factors: dict[tuple[int, int], float]) -> tuple[int, int]:
    """(mis-tagged, checked) frames: a frame's pole mass and subtree mass, read from the
    simulator with its observation, against the factor its (env_index, env_version) names,
    at the root and under "next"."""
    flat = batch.reshape(-1)
    wrong = 0
    for prefix in ((), ("next",)):
        keys = zip(flat[(*prefix, "env_index")].tolist(), flat[(*prefix, "env_version")].tolist(), strict=True)
        want = torch.tensor([factors[key] for key in keys])
        seen = flat[(*prefix, "physics")]
        ok = torch.isclose(seen[:, 0], MASS * want, rtol=1e-5) & torch.isclose(seen[:, 1], SUBTREE * want, rtol=1e-5)
        wrong += int((~ok).sum())
    return wrong, flat.shape[0]


class Episodes:
    """Per trajectory (torchrl's ``("collector", "traj_ids")`` per world: an episode, or its part
    since a reset between batches), across batches: the versions it ran, its length, and how
    many episodes ended with the pole up before mjlab's time-out (only a ``"truncate"``
    version ends them so). Read from ``done`` and the pole's angle, not from ``truncated``:
    torchrl 0.14.1's ``MJLabWrapper`` returns mjlab's own termination buffers, which later
    steps overwrite in the collected batch."""

    def __init__(self) -> None:
        self.ran: dict[tuple[int, int], set[int]] = {}
        self.steps: dict[tuple[int, int], int] = {}
        self.cut = 0

    def add(self, batch: TensorDictBase) -> None:
        flat = batch.reshape(-1)
        keys = zip(flat["env_index"].tolist(), flat["collector", "traj_ids"].tolist(), strict=True)
        up = flat["next", "done"].flatten() & (flat["next", "physics"][:, 2].abs() <= FALL)
        for key, version, cut in zip(keys, flat["next", "env_version"].tolist(), up.tolist(), strict=True):
            self.ran.setdefault(key, set()).add(version)
            self.steps[key] = self.steps.get(key, 0) + 1
            self.cut += cut and self.steps[key] < EPISODE_STEPS

    def mixed(self) -> int:
        """How many trajectories ran more than one version."""
        return sum(len(versions) > 1 for versions in self.ran.values())


def drive(
    collector: Any, sender: EnvStateSender, mode: str, frames: int = FRAMES
) -> tuple[int, int, set[int], Episodes]:
    """Push a random mass factor per world before every batch (waiting until it is applied,
    except in ``"reset"`` mode); return (mis-tagged frames, frames checked, versions seen under
    "next", the trajectories)."""
    factors = {(env, 0): 1.0 for env in range(sender.num_envs)}
    wrong = checked = 0
    episodes = Episodes()
    versions: set[int] = set()
    generator = torch.Generator().manual_seed(0)
    for batch in collector:
        bad, count = check_frames(batch, factors)
        wrong, checked = wrong + bad, checked + count
        episodes.add(batch)
        versions |= set(batch["next", "env_version"].flatten().tolist())
        if checked >= frames:
            break
        rows = 0.5 + 1.5 * torch.rand(sender.num_envs, generator=generator)
        version = sender.push(config={"mass": rows}, wait="received" if mode == "reset" else "applied")
        factors.update({(env, version): float(rows[env]) for env in range(sender.num_envs)})
    return wrong, checked, versions, episodes


COLLECTORS: dict[str, Callable[..., Any]] = {  # 64 worlds: one env of 64, or two workers of 32
    "single": lambda s, **kw: Collector(s.env_fn(make_cartpoles_64), None, **kw),
    "multisync": lambda s, **kw: MultiSyncCollector([s.env_fn(make_cartpoles_32)] * 2, None, **kw),
    "multiasync": lambda s, **kw: MultiAsyncCollector([s.env_fn(make_cartpoles_32)] * 2, None, **kw),
}


@pytest.mark.parametrize("mode", ["reset", "step", "truncate"])
@pytest.mark.parametrize("kind", list(COLLECTORS))
@pytest.mark.timeout(420)
def test_every_frame_of_ten_thousand_names_the_mass_its_world_ran(kind: str, mode: str) -> None:
    sender = EnvStateSender(config={"mass": 1.0}, apply=mass_scales(), apply_at=mode)
    with start_method("fork"):
        collector = COLLECTORS[kind](
            sender, frames_per_batch=64 * 16, total_frames=-1, weight_sync_schemes=sender.schemes()
        )
    try:
        assert sender.num_envs == 64
        wrong, checked, versions, episodes = drive(collector, sender, mode)
    finally:
        collector.shutdown()
        sender.close()
    assert checked >= FRAMES and wrong == 0, (wrong, checked)
    assert len(versions) >= 4, versions  # the worlds ran many pushes, each at its own safe point
    if mode == "step":  # a push lands mid-episode
        assert episodes.mixed() > 0
    else:  # at a world's own reset, or after its running episode was cut: never inside one
        assert episodes.mixed() == 0, episodes.mixed()
    # only a "truncate" version ends an episode with the pole up before the time-out: mid-rollout where a push
    # lands while the worker collects (MultiAsyncCollector); the other collectors are idle at a push, and it
    # resets the worlds between batches (a new trajectory id, no frame ends)
    if mode == "truncate" and kind == "multiasync":
        assert episodes.cut > 0
    if mode != "truncate":
        assert episodes.cut == 0, episodes.cut


# ---- curricula over worlds: each episode credited to the physics the simulator ran -----------


def with_pole_mass(batch: TensorDictBase) -> TensorDictBase:
    """The batch with the simulator's pole and subtree masses as one number per frame each
    (the ledger's measures take one number per frame)."""
    physics = batch["next", "physics"]
    batch.set(("next", "pole_mass"), physics[..., 0])
    batch.set(("next", "subtree_mass"), physics[..., 1])
    return batch


PHYSICS = {  # what the simulator reported over each episode's steps
    "pole_min": curriculum.Measure(("next", "pole_mass"), "min"),
    "pole_max": curriculum.Measure(("next", "pole_mass"), "max"),
    "subtree_min": curriculum.Measure(("next", "subtree_mass"), "min"),
    "subtree_max": curriculum.Measure(("next", "subtree_mass"), "max"),
    "pole_mass": curriculum.Measure(("next", "pole_mass"), "mean"),
}


def ran(episode: curriculum.Episode, factor: float) -> bool:
    """Whether every step of the episode, as the simulator reported it, ran ``factor`` times
    the masses as built (pole and cart subtree)."""
    m = episode.measures
    return all(
        abs(m[f"{name}_{end}"] - built * factor) <= 1e-5 * built * factor
        for name, built in (("pole", MASS), ("subtree", SUBTREE))
        for end in ("min", "max")
    )


@pytest.mark.parametrize("kind", list(COLLECTORS))
@pytest.mark.timeout(300)
def test_adr_over_the_mass_per_world_credits_each_episode_to_the_mass_the_simulator_ran(kind: str) -> None:
    """ADR's objective is the pole mass the simulator reported over the episode, and its
    thresholds sit at 0.75 of the mass as built: the upper boundary widens to its bound, the
    lower one steps down until it evaluates 0.7 (below the threshold), then back up, and so
    settles at 0.7/0.8, which it can do only if each boundary's results are those of the
    worlds that ran it."""
    sender = EnvStateSender(config={"mass": 1.0}, apply=mass_scales(), apply_at="reset")
    with start_method("fork"):
        collector = COLLECTORS[kind](
            sender, frames_per_batch=64 * 4, total_frames=-1, weight_sync_schemes=sender.schemes()
        )
    adr = curriculum.ADR(
        sender,
        ranges={"mass": (1.0, 1.0)},
        bounds={"mass": (0.5, 1.5)},
        delta=0.1,
        boundary_fraction=0.5,
        queue=4,
        thresholds=(0.75 * MASS, 0.75 * MASS),
        objective="pole_mass",
        measures=PHYSICS,
        seed=0,
    )
    episodes = wrong = credited = 0
    try:
        for index, batch in enumerate(collector):
            assigned = dict(adr.assigned)  # (env, version) -> (boundary, value), as ADR will credit them
            for episode in adr.observe(with_pole_mass(batch)):
                episodes += 1
                wrong += not ran(episode, episode.config["mass"].item())
                if (episode.env, episode.version) in assigned:
                    credited += 1
                    wrong += not ran(episode, assigned[episode.env, episode.version][1])
            if index == 40:
                break
        versions, held = settled_masses(sender)
        runs = [MASS * sender.config_at(env, v)["mass"].item() for env, v in enumerate(versions)]
    finally:
        collector.shutdown()
        sender.close()
    assert episodes >= 500 and credited >= 200 and wrong == 0, (episodes, credited, wrong)
    assert held.tolist() == pytest.approx(runs, rel=1e-5)  # each world holds the row of the version it runs
    lows = [record["mass.low"] for record in adr.history()]
    assert min(lows) == pytest.approx(0.7) and adr.range["mass"][0] in (pytest.approx(0.7), pytest.approx(0.8))
    shrank = any(later > earlier for earlier, later in zip(lows[:-1], lows[1:], strict=True))
    assert shrank, f"the lower boundary never moved back up: {lows}"
    assert adr.range["mass"][1] == pytest.approx(1.5), adr.range


def settled_masses(sender: EnvStateSender, tries: int = 100) -> tuple[list[int], torch.Tensor]:
    """Each world's version and the pole mass its model holds, read while no world changed
    version: a ``MultiAsyncCollector``'s worker goes on collecting after the loop breaks, and a
    world that resets between the read and ``env_versions`` takes its pending row (failed 1 of
    ~9 runs, and once in CI, comparing a read with versions taken after it)."""
    for _ in range(tries):
        before = sender.env_versions()
        held = sender.read_attributes(["sim.model.body_mass"])["sim", "model", "body_mass"][:, POLE]
        if sender.env_versions() == before:
            return before, held
        time.sleep(0.05)
    raise AssertionError(f"the worlds' versions kept changing over {tries} reads")


MASSES = (0.5, 1.0, 1.5)  # the mass factors the levels, lessons and arms set


def plr(sender: EnvStateSender) -> curriculum.PLR:
    """Scores a level by its episodes' simulated pole mass: each level's score ends as minus
    its own mass."""
    return curriculum.PLR(
        sender, [{"mass": m} for m in MASSES], score=lambda e: -e.measures["pole_mass"], measures=PHYSICS, seed=0
    )


def lessons(sender: EnvStateSender) -> curriculum.Lessons:
    """Moves on when the simulated pole mass of its episodes passes each lesson's threshold."""
    steps = [
        curriculum.Lesson(
            {"mass": m}, measure="pole_mass", threshold=0.9 * MASS * m, min_lesson_length=30, signal_smoothing=False
        )
        for m in (1.0, 1.5)
    ]
    return curriculum.Lessons(sender, [*steps, curriculum.Lesson({"mass": 0.5})], measures=PHYSICS)


def bandit(sender: EnvStateSender) -> curriculum.Bandit:
    """Rewards an arm by its episodes' simulated pole mass: the heaviest arm pays 1."""
    return curriculum.Bandit(
        sender,
        [{"mass": m} for m in MASSES],
        reward=lambda e: e.measures["pole_mass"],
        reward_range=(0.0, MASS * MASSES[-1]),
        measures=PHYSICS,
    )


def choices(strategy: Any) -> dict[tuple[int, int], float]:
    """The mass factor the strategy chose for each (env, version) it still tracks."""
    if isinstance(strategy, curriculum.PLR):
        return {key: MASSES[level] for key, level in strategy.assigned.items()}
    if isinstance(strategy, curriculum.Bandit):
        return {key: MASSES[arm] for key, (arm, _) in strategy.pulls.items()}
    factor = float(strategy.lessons[strategy.lesson].config["mass"])
    return {(env, strategy.since): factor for env in range(strategy.sender.num_envs)}


@pytest.mark.parametrize("make", [plr, lessons, bandit], ids=["plr", "lessons", "bandit"])
@pytest.mark.timeout(180)
def test_plr_lessons_and_bandit_drive_worlds_and_each_world_runs_its_choice(
    make: Callable[[EnvStateSender], Any],
) -> None:
    """Each strategy drives the 64 worlds of one env as it drives sub-envs: a row per world
    (a fleet-wide push for Lessons, which each world takes at its own reset); every episode
    ran, by the simulator's account, the mass the strategy chose for its (env, version)."""
    sender = EnvStateSender(config={"mass": 1.0}, apply=mass_scales(), apply_at="reset")
    with start_method("fork"):
        collector = COLLECTORS["single"](
            sender, frames_per_batch=64 * 4, total_frames=-1, weight_sync_schemes=sender.schemes()
        )
    strategy = make(sender)
    chosen = {(env, 0): 1.0 for env in range(64)} | choices(strategy)
    episodes: list[curriculum.Episode] = []
    wrong = mixed = 0
    try:
        for index, batch in enumerate(collector):
            for episode in strategy.observe(with_pole_mass(batch)):
                episodes.append(episode)
                wrong += not ran(episode, chosen[episode.env, episode.version])
            chosen |= choices(strategy)
            mixed += len(set(batch["next", "physics"][..., 0].flatten().tolist())) > 1
            if index == 25:
                break
        held = sender.read_attributes(["sim.model.body_mass"])["sim", "model", "body_mass"][:, POLE]
        runs = [MASS * chosen[env, v] for env, v in enumerate(sender.env_versions())]
    finally:
        collector.shutdown()
        sender.close()
    assert len(episodes) >= 300 and wrong == 0, (len(episodes), wrong)
    assert held.tolist() == pytest.approx(runs, rel=1e-5)  # each world holds the choice of the version it runs
    # worlds of one batch ran different masses: each takes its own row (or the new lesson) at its own reset
    # (PLR keeps sampling levels: nearly every batch mixes; UCB1 settles on the heavy arm and a lesson
    # change passes once, so a few of their batches do: 8 to 19 of 26 for the bandit over 15 runs)
    assert mixed >= (10 if isinstance(strategy, curriculum.PLR) else 2), mixed
    if isinstance(strategy, curriculum.PLR):  # every level scored by its own simulated mass, nothing else
        assert strategy.seen.all() and strategy.scores.tolist() == pytest.approx([-MASS * m for m in MASSES], rel=1e-5)
    elif isinstance(strategy, curriculum.Bandit):  # each arm's mean reward is its own mass's
        means = (strategy.sums / strategy.counts).tolist()
        assert means == pytest.approx([m / MASSES[-1] for m in MASSES], rel=1e-5)
        assert int(strategy.counts.argmax()) == len(MASSES) - 1, strategy.counts  # UCB1 favours the heavy arm
    else:
        assert strategy.lesson == 2 and {round(e.measures["pole_mass"] / MASS, 3) for e in episodes} == {1.0, 1.5, 0.5}


# ---- a batched level does not hold back what each world applied ----------------------------


def transformed_cartpoles() -> Any:
    from torchrl.envs import Compose, TransformedEnv

    return TransformedEnv(make_cartpole(8), Compose())  # the worlds get a batched level (no transforms in it)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: make_cartpole(8), id="plain"),
        # a version that asks nothing of the batched level is applied as soon as the world holds it
        # (fails on 1090c66: the level waited for every world that waits for its reset)
        pytest.param(transformed_cartpoles, id="transformed"),
    ],
)
@pytest.mark.timeout(120)
def test_a_world_that_applied_its_row_at_its_own_reset_is_acknowledged_while_another_waits(
    make: Callable[[], Any],
) -> None:
    """World 0 resets and applies its row; world 1, given a row by the same push, has not reset
    yet. World 0 runs the new version (read from its model), and the sender says so."""
    sender = EnvStateSender(config={"mass": 1.0}, apply=mass_scales(), apply_at="reset")
    collector = Collector(
        sender.env_fn(make), None, frames_per_batch=8, total_frames=-1, weight_sync_schemes=sender.schemes()
    )
    try:
        next(iter(collector))
        version = sender.push(config={"mass": torch.tensor([2.0, 3.0])}, envs=[0, 1], wait="received")
        collector.reset(index=[0])  # world 0's own reset; world 1 keeps running version 0
        held = sender.read_attributes(["sim.model.body_mass"])["sim", "model", "body_mass"][:, POLE]
        assert held[:2].tolist() == pytest.approx([2.0 * MASS, MASS])
        deadline = time.monotonic() + 3.0  # the worker loop acknowledges within half a second
        while sender.env_versions()[0] != version and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sender.env_versions()[:2] == [version, 0]
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.timeout(180)
def test_applied_means_every_world_of_the_model_holds_its_row_and_a_later_user_write_stays() -> None:
    """A ``Collector`` of 16 worlds, idle after its first batch (the worker loop applies), 30
    rounds: right after each ``wait="applied"`` every world's model holds its pushed mass and
    the derived subtree mass (the write and ``recompute_constants`` ran); a mass the user
    writes then is still there a moment later (no deferred write of that push comes after).
    Fails on 1090c66: 15 worlds still held the previous mass, and 448 of 480 user rows were
    overwritten."""
    sender = EnvStateSender(config={"mass": 1.0}, apply=mass_scales(), apply_at="step")
    collector = Collector(
        sender.env_fn(lambda: make_cartpole(16)),
        None,
        frames_per_batch=32,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
    )
    try:
        next(iter(collector))
        model = sim_of(collector.env).model
        for round_ in range(30):
            scale = torch.linspace(0.5, 2.0, 16) + 0.01 * round_
            sender.push(config={"mass": scale}, wait="applied")
            assert model.body_mass[:, POLE].tolist() == pytest.approx((MASS * scale).tolist()), round_
            subtree = model.body_subtreemass[:, CART].tolist()
            assert subtree == pytest.approx((SUBTREE * scale).tolist()), round_  # every body scaled
            mine = model.body_mass[...].clone()
            mine[:, POLE] = 0.7
            model.body_mass[...] = mine
            time.sleep(0.01)
            assert model.body_mass[:, POLE].tolist() == pytest.approx([0.7] * 16), round_
    finally:
        collector.shutdown()
        sender.close()


# ---- the example ---------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_the_mjlab_adr_example_widens_mass_and_friction_and_every_world_holds_its_config(tmp_path: Path) -> None:
    """``examples/mjlab_adr.py --smoke`` as a script: PPO under ADR over 16 worlds; every
    episode's simulated pole mass, subtree mass and friction are its config's, each world's
    model read back holds the config of the version it runs, and both ranges widened."""
    log, stdout = run_adr_example("mjlab_adr", tmp_path)
    assert log["failures"] == [] and log["episodes_checked"] >= 50 and log["worlds_read_back"] == 16
    assert log["built"]["pole_mass"] == pytest.approx(MASS) and log["built"]["subtree_mass"] == pytest.approx(SUBTREE)
    assert "16 worlds read back hold the config of the version they run" in stdout
