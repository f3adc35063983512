"""Per-world physics in MuJoCo Playground (MJX, JAX on the CPU) through
:class:`~envsync.integrations.torchrl.playground.PlaygroundWorlds`: one config row per world of
the natively batched env, ``apply="set_physics"``, checked from the simulator (the dynamics,
the derived constants against ``mujoco.mj_setConst``, and an observation that carries what each
world's step computed from its masses), with the number of JAX compilations counted.

Runs in the playground venv (``make test-playground``): jax, mujoco-mjx and playground are not
in the main venv. Multi collectors start their workers by **spawn**: a process that forked
after JAX ran a computation hangs in the child at its first JAX call (JAX's runtime threads
are not forked), and this process runs JAX (the sender's probe env, the single-collector
tests) before it builds them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict, TensorDictBase

jax = pytest.importorskip("jax")
pytest.importorskip("mujoco_playground")

from helpers import Factors, every_frame_names_its_physics, run_adr_example  # noqa: E402
from playground_envs import (  # noqa: E402
    FRICTION,
    MASS,
    POLE,
    SUBTREE,
    make_cartpole,
    make_cartpoles_16,
    make_cartpoles_32,
    make_counted_cartpoles_16,
    make_counted_cartpoles_32,
)
from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector  # noqa: E402

from envsync import EnvStateSender, ValidationError  # noqa: E402
from envsync.envs import start_method  # noqa: E402

FRAMES = 10_000


def built_constants() -> tuple[float, float]:
    """The hinge's diagonal of the joint-space inertia matrix and the slider's
    ``dof_invweight0``, as MuJoCo (on the CPU) computes them for the Cartpole as built."""
    import mujoco
    from mujoco_playground import registry

    model = registry.load("CartpoleBalance", config_overrides={"impl": "jax"}).mj_model
    data = mujoco.MjData(model)
    mujoco.mj_forward(model, data)
    inertia = np.zeros((model.nv, model.nv))
    mujoco.mj_fullM(model, data, inertia)
    return float(inertia[1, 1]), float(model.dof_invweight0[0])


@contextmanager
def compilations() -> Iterator[list[str]]:
    """The names of the XLA executables JAX builds (compiled, or loaded from the persistent
    cache) while the block runs: every jit trace that reaches XLA, eager operations included."""
    seen: list[str] = []

    def listen(event: str, duration: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(str(kwargs.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def scaled_model(factor: float) -> Any:
    """The Cartpole's ``MjModel`` with every mass and inertia times ``factor``, its constants
    recomputed as compiling it would (``mj_setConst``)."""
    import mujoco
    from mujoco_playground import registry

    model = copy.copy(registry.load("CartpoleBalance", config_overrides={"impl": "jax"}).mj_model)
    model.body_mass[:] *= factor
    model.body_inertia[:] *= factor
    mujoco.mj_setConst(model, mujoco.MjData(model))
    return model


# ---- the mechanism, on one env -------------------------------------------------------------


@pytest.mark.timeout(180)
def test_one_worlds_mass_reaches_that_world_only_and_it_runs_the_model_compiled_with_it() -> None:
    """A push of mass factor 2 to world 1 of 4: world 1's fields and derived constants are
    those ``mj_setConst`` gives the model with doubled masses, the others' are as built; from
    one state, world 1 then steps exactly as MJX steps that compiled model, and the other
    three stay identical to each other (and differ from world 1)."""
    import mujoco_playground
    from mujoco import mjx

    env = make_cartpole(4)
    env.reset()
    env.set_physics(torch.tensor([1]), mass=torch.tensor([2.0]))
    reference = scaled_model(2.0)
    model = env.model
    for field in (
        "body_mass",
        "body_inertia",
        "body_subtreemass",
        "body_invweight0",
        "dof_invweight0",
        "actuator_acc0",
    ):
        rows = getattr(model, field)
        want = torch.as_tensor(np.asarray(getattr(reference, field), np.float32))
        assert torch.allclose(rows[1], want, rtol=1e-5), field
        assert torch.equal(rows[0], rows[2]) and torch.equal(rows[0], rows[3]) and not torch.equal(rows[0], rows[1])
    state = env.worlds_state  # one state in every world: world 0's
    env._current_state = jax.tree.map(lambda x: jax.numpy.broadcast_to(x[:1], x.shape), state)
    action = torch.full((4, 1), 0.5)
    for _ in range(30):
        out = env.step(TensorDict(action=action, batch_size=[4]))
    qpos = np.asarray(env.worlds_state.data.qpos)
    data = jax.tree.map(lambda x: x[0], state.data)
    compiled = mjx.put_model(reference, impl="jax")
    data = jax.jit(mujoco_playground.step, static_argnums=3)(compiled, data, jax.numpy.full((1,), 0.5), 30)
    assert np.allclose(qpos[1], np.asarray(data.qpos), atol=1e-5), (qpos[1], data.qpos)
    assert np.array_equal(qpos[0], qpos[2]) and np.array_equal(qpos[0], qpos[3])
    assert not np.allclose(qpos[0], qpos[1], atol=1e-4)
    physics = out["next", "physics"]  # computed by the step from each world's masses
    hinge, _ = built_constants()
    assert physics[:, 0].tolist() == pytest.approx([hinge, 2 * hinge, hinge, hinge], rel=1e-5)
    assert physics[:, 1].tolist() == pytest.approx([SUBTREE, 2 * SUBTREE, SUBTREE, SUBTREE], rel=1e-5)
    env.close()


@pytest.mark.timeout(180)
def test_a_partial_reset_resets_the_masked_worlds_only_each_from_its_own_key() -> None:
    env = make_cartpole(4)
    env.reset()
    for _ in range(5):
        env.step(TensorDict(action=torch.full((4, 1), 0.3), batch_size=[4]))
    before = np.asarray(env.worlds_state.data.qpos).copy()
    traces = dict(env.traces)
    env.reset(TensorDict({"_reset": torch.tensor([[True], [False], [True], [False]])}, batch_size=[4]))
    after = np.asarray(env.worlds_state.data.qpos)
    assert np.array_equal(after[[1, 3]], before[[1, 3]])  # kept their running episodes
    assert not np.allclose(after[0], before[0]) and not np.allclose(after[2], before[2])
    assert not np.allclose(after[0], after[2])  # each world its own key
    assert np.asarray(env.worlds_state.info["steps"]).tolist() == [0, 5, 0, 5]
    assert dict(env.traces) == traces  # the same compiled reset, whatever the mask
    env.close()


@pytest.mark.timeout(240)
def test_compilations_stay_the_same_over_a_thousand_pushes_of_varying_row_counts() -> None:
    """1,000 calls of the env's apply, each to 1..64 random worlds of 64 with a random subset
    of the factors, a step and a partial reset between every tenth: no function is traced
    again and JAX builds no executable; each push's rows are what the model holds after it."""
    env = make_cartpole(64)
    env.reset()
    step = TensorDict(action=torch.zeros(64, 1), batch_size=[64])
    env.set_physics(
        torch.tensor([0]),
        mass=torch.tensor([1.0]),
        friction=torch.tensor([1.0]),
        damping=torch.tensor([1.0]),
        gear=torch.tensor([1.0]),
    )
    env.step(step)
    traces = dict(env.traces)
    generator = torch.Generator().manual_seed(0)
    names = ["mass", "friction", "damping", "gear"]
    with compilations() as built:
        for i in range(1_000):
            k = 1 + i % 64
            ids = torch.randperm(64, generator=generator)[:k]
            chosen = [n for j, n in enumerate(names) if (i >> j) & 1] or ["mass"]
            factors = {n: 0.5 + torch.rand(k, generator=generator, dtype=torch.float64) for n in chosen}
            env.set_physics(ids, **factors)
            if "mass" in factors:
                held = env.model.body_mass[ids, POLE]
                assert torch.allclose(held, (MASS * factors["mass"]).float(), rtol=1e-6), i
            if i % 10 == 9:
                env.step(step)
                env.reset(TensorDict({"_reset": (torch.rand(64, 1, generator=generator) < 0.3)}, batch_size=[64]))
    assert dict(env.traces) == traces == {"reset": 1, "step": 1, "write": 1}, env.traces
    assert built == [], built
    env.close()


@pytest.mark.timeout(240)
def test_pushes_of_a_few_rows_through_the_sender_compile_nothing_and_are_held_when_applied() -> None:
    """A ``Collector`` of 16 worlds, idle after its first batch: 200 pushes of 1 to 5 worlds'
    mass and friction (``wait="applied"``). Right after each, the model the worlds run holds
    every world's row; no function was traced again, and JAX built no executable."""
    sender = EnvStateSender(config={"mass": 1.0, "friction": 1.0}, apply="set_physics", apply_at="step")
    collector = Collector(
        sender.env_fn(make_cartpoles_16),
        None,
        frames_per_batch=32,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
    )
    generator = torch.Generator().manual_seed(1)
    mass = torch.ones(16, dtype=torch.float64)
    try:
        next(iter(collector))
        env = collector.env
        traces = dict(env.traces)
        with compilations() as built:
            for i in range(200):
                k = 1 + i % 5
                envs = torch.randperm(16, generator=generator)[:k]
                rows = 0.5 + torch.rand(k, generator=generator, dtype=torch.float64)
                mass[envs] = rows
                sender.push(
                    config=TensorDict(mass=rows, friction=rows, batch_size=[k]), envs=envs.tolist(), wait="applied"
                )
                assert env.model.body_mass[:, POLE].tolist() == pytest.approx((MASS * mass).tolist(), rel=1e-6), i
        friction = sender.read_attributes(["model.geom_friction"])["model", "geom_friction"][..., 0].sum(-1)
        assert friction.tolist() == pytest.approx((FRICTION * mass).tolist(), rel=1e-5)
        assert dict(env.traces) == traces and built == [], (env.traces, built)
    finally:
        collector.shutdown()
        sender.close()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"mass": 1.0, "stiffness": 1.0}, "'stiffness' is not a scale of this env"),
        ({"mass": torch.ones(5)}, "'mass' scales 'body_mass' of shape (3,) per world"),
    ],
)
@pytest.mark.timeout(120)
def test_a_name_or_a_factor_that_does_not_fit_is_refused_at_attach(config: dict[str, Any], message: str) -> None:
    sender = EnvStateSender(config=config, apply="set_physics", apply_at="reset")
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        sender.env_fn(make_cartpole(4))
    sender.close()


@pytest.mark.timeout(120)
def test_a_per_world_field_that_moves_the_geometry_is_refused_when_the_worlds_are_built() -> None:
    """The constants are recomputed for masses, inertias, armatures and gears: a field that
    moves the Jacobians (``body_ipos``) cannot be per world, and the error names it."""
    with pytest.raises(ValidationError, match="'body_ipos' cannot be per world"):
        make_cartpole(4, scales={"shift": ("body_ipos",)})


# ---- every frame names the physics its world ran, in collectors ------------------------------


def check_frames(batch: TensorDictBase, factors: Factors, built: tuple[float, float]) -> tuple[int, int]:
    """(mis-tagged, checked) frames: what each frame's step computed from its world's model
    (the joint-space inertia's diagonal ``M[1, 1]``, ``M[0, 0]``; the derived subtree mass and
    ``dof_invweight0``) against the factor its (env_index, env_version) names, at the root
    (the observation's own step or reset) and under "next"."""
    flat = batch.reshape(-1)
    hinge, invweight = built
    wrong = 0
    for prefix in ((), ("next",)):
        keys = zip(flat[(*prefix, "env_index")].tolist(), flat[(*prefix, "env_version")].tolist(), strict=True)
        f = torch.tensor([factors[key][0] for key in keys])  # the mass factor
        seen = flat[(*prefix, "physics")]
        want = torch.stack([hinge * f, SUBTREE * f, SUBTREE * f, invweight / f], dim=-1)
        wrong += int((~torch.isclose(seen[:, :4], want.float(), rtol=1e-5).all(-1)).sum())
    return wrong, flat.shape[0]


def draw(generator: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """A random mass factor per world."""
    return {"mass": 0.5 + 1.5 * torch.rand(n, generator=generator, dtype=torch.float64)}


COLLECTORS: dict[str, Callable[..., Any]] = {  # 32 worlds: one env of 32, or two workers of 16 (spawned)
    "single": lambda s, worlds, **kw: Collector(s.env_fn(worlds[32]), None, **kw),
    "multisync": lambda s, worlds, **kw: MultiSyncCollector([s.env_fn(worlds[16])] * 2, None, **kw),
    "multiasync": lambda s, worlds, **kw: MultiAsyncCollector([s.env_fn(worlds[16])] * 2, None, **kw),
}
WORLDS = {32: make_cartpoles_32, 16: make_cartpoles_16}
COUNTED = {32: make_counted_cartpoles_32, 16: make_counted_cartpoles_16}  # with a "truncated" entry


@pytest.mark.parametrize("mode", ["reset", "step", "truncate"])
@pytest.mark.parametrize("kind", list(COLLECTORS))
@pytest.mark.timeout(300)
def test_every_frame_of_ten_thousand_names_the_physics_its_world_ran(kind: str, mode: str) -> None:
    sender = EnvStateSender(config={"mass": 1.0}, apply="set_physics", apply_at=mode)
    with start_method("spawn"):
        collector = COLLECTORS[kind](
            sender,
            COUNTED if mode == "truncate" else WORLDS,
            frames_per_batch=32 * 25,
            total_frames=-1,
            weight_sync_schemes=sender.schemes(),
        )
    built = built_constants()

    def check(batch: TensorDictBase, factors: Factors) -> tuple[int, int]:
        return check_frames(batch, factors, built)

    every_frame_names_its_physics(collector, sender, mode, ("mass",), draw, check, worlds=32, frames=FRAMES)


# ---- the example ---------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_the_playground_adr_example_widens_mass_and_friction_and_every_world_holds_its_config(tmp_path: Path) -> None:
    """``examples/playground_adr.py --smoke`` as a script: PPO under ADR over 16 worlds; every
    episode's simulated physics is its config's, each world's model read back holds the config
    of the version it runs, both ranges widened, and pushes compiled nothing."""
    log, stdout = run_adr_example("playground_adr", tmp_path)
    assert log["failures"] == [] and log["episodes_checked"] >= 30 and log["worlds_read_back"] == 16
    assert log["traces"] == {"reset": 1, "step": 1, "write": 1}, log["traces"]
    assert "16 worlds read back hold the config of the version they run" in stdout
