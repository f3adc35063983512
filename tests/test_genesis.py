"""Per-world physics in Genesis (its CPU backend) through
:class:`~envsync.integrations.torchrl.genesis.GenesisWorlds`: one config row per world of the
natively batched env, ``apply="set_physics"`` through Genesis's ``envs_idx`` setters, checked
from the simulator (the mass and friction ratio each world holds, and an observation that
carries what each world's step computed from them).

Runs in the genesis venv (``make test-genesis``): genesis-world is not in the main venv. Multi
collectors start their workers by **spawn**: this process runs Genesis (the sender's probe env,
the single-collector tests) before it builds them, and Genesis's runtime threads are not forked.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict, TensorDictBase

pytest.importorskip("genesis")

from genesis_envs import EPISODE_STEPS, make_boxes, make_boxes_16, make_boxes_32  # noqa: E402
from helpers import Factors, every_frame_names_its_physics, run_adr_example  # noqa: E402
from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector  # noqa: E402

from envsync import EnvStateSender, ValidationError  # noqa: E402
from envsync.envs import start_method  # noqa: E402

FRAMES = 10_000
MASS, INERTIA = 2.4, 0.01  # the box as built: its mass, its first rotational mass-matrix diagonal


def stepped(env: Any) -> TensorDictBase:
    """One step of every world with no force; the step's output."""
    return env.step(env.reset().set("action", torch.zeros(*env.batch_size, 2)))["next"]


def reset_some(env: Any, current: TensorDictBase, worlds: list[bool]) -> TensorDictBase:
    """Reset the worlds ``worlds`` masks, as a collector does (the others keep ``current``)."""
    return env.reset(current.clone().set("_reset", torch.tensor(worlds).unsqueeze(-1)))


# ---- the mechanism, on one env -------------------------------------------------------------


@pytest.mark.timeout(300)
def test_one_worlds_mass_and_friction_reach_that_world_only_and_a_reset_keeps_them() -> None:
    env = make_boxes(4)
    env.set_physics(torch.tensor([2]), mass=torch.tensor([3.0]), friction=torch.tensor([0.25]))
    current = stepped(env)
    physics = current["physics"]
    want = torch.tensor([[MASS, INERTIA, 1.0]] * 4)
    want[2] = torch.tensor([3 * MASS, 3 * INERTIA, 0.25])
    assert torch.allclose(physics, want, rtol=1e-5), physics
    assert env.model.mass.tolist() == pytest.approx([MASS, MASS, 3 * MASS, MASS])
    # Genesis puts a world's friction ratio back to the initial state's when it resets it: the
    # worlds write theirs again
    out = reset_some(env, current, [False, False, True, True])
    assert torch.allclose(out["physics"][2], want[2], rtol=1e-5), out["physics"]
    assert env.model.friction.tolist() == pytest.approx([1.0, 1.0, 0.25, 1.0])


@pytest.mark.timeout(300)
def test_a_partial_reset_resets_the_masked_worlds_only_and_worlds_end_at_their_own_steps() -> None:
    env = make_boxes(4)
    td = env.reset()
    for _ in range(5):  # pushed along x: every box moves
        td = env.step(td.set("action", torch.tensor([[20.0, 0.0]] * 4)))["next"]
    moved = td["observation"][:, 0].clone()
    assert (moved > 0).all(), moved
    out = reset_some(env, td, [True, False, True, False])
    assert out["observation"][[0, 2], 0].tolist() == pytest.approx([0.0, 0.0], abs=1e-6)
    assert out["observation"][[1, 3], 0].tolist() == pytest.approx(moved[[1, 3]].tolist())
    rollout = make_boxes(8).rollout(EPISODE_STEPS + 8, break_when_any_done=False)
    first_done = rollout["next", "done"].squeeze(-1).int().argmax(-1)
    assert first_done.tolist() == [EPISODE_STEPS - 1 + i % 7 for i in range(8)]


@pytest.mark.parametrize(
    ("factors", "message"),
    [({"gravity": 1.0}, "not a scale"), ({"mass": torch.ones(3)}, "one factor per world")],
)
@pytest.mark.timeout(300)
def test_a_name_or_a_factor_that_does_not_fit_is_refused(factors: dict[str, Any], message: str) -> None:
    env = make_boxes(2)
    with pytest.raises(ValidationError, match=message):
        env.set_physics(torch.tensor([0, 1]), **factors)
    assert env.model.mass.tolist() == pytest.approx([MASS, MASS])


@pytest.mark.timeout(300)
def test_pushes_of_a_few_rows_are_held_by_the_simulator_when_applied() -> None:
    """A ``Collector`` of 16 worlds, idle after its first batch: 100 pushes of 1 to 5 worlds'
    mass and friction (``wait="applied"``). Right after each, the simulator holds every
    world's row; ``read_attributes`` reads the same."""
    sender = EnvStateSender(config={"mass": 1.0, "friction": 1.0}, apply="set_physics", apply_at="step")
    collector = Collector(
        sender.env_fn(make_boxes_16), None, frames_per_batch=32, total_frames=-1, weight_sync_schemes=sender.schemes()
    )
    generator = torch.Generator().manual_seed(1)
    mass, friction = torch.ones(16, dtype=torch.float64), torch.ones(16, dtype=torch.float64)
    try:
        next(iter(collector))
        env = collector.env
        for i in range(100):
            k = 1 + i % 5
            envs = torch.randperm(16, generator=generator)[:k]
            rows = 0.5 + torch.rand(k, generator=generator, dtype=torch.float64)
            mass[envs], friction[envs] = rows, 2 * rows
            sender.push(config=TensorDict(mass=rows, friction=2 * rows, batch_size=[k]), envs=envs, wait="applied")
            assert env.model.mass.tolist() == pytest.approx((MASS * mass).tolist(), rel=1e-6), i
            assert env.model.friction.tolist() == pytest.approx(friction.tolist(), rel=1e-6), i
        read = sender.read_attributes(["model.mass", "model.friction"])
        assert read["model", "mass"].tolist() == pytest.approx((MASS * mass).tolist(), rel=1e-6)
        assert read["model", "friction"].tolist() == pytest.approx(friction.tolist(), rel=1e-6)
    finally:
        collector.shutdown()
        sender.close()


# ---- every frame of real collectors --------------------------------------------------------


def check_frames(batch: TensorDictBase, factors: Factors) -> tuple[int, int]:
    """(mis-tagged, checked) frames: what each frame's step (or reset) computed from its world's
    model (the mass matrix's diagonals, the friction ratio) against the factors its
    (env_index, env_version) names, at the root and under "next"."""
    flat = batch.reshape(-1)
    wrong = 0
    for prefix in ((), ("next",)):
        keys = zip(flat[(*prefix, "env_index")].tolist(), flat[(*prefix, "env_version")].tolist(), strict=True)
        f = torch.tensor([factors[key] for key in keys])
        want = torch.stack([MASS * f[:, 0], INERTIA * f[:, 0], f[:, 1]], dim=-1)
        seen = flat[(*prefix, "physics")]
        wrong += int((~torch.isclose(seen, want.float(), rtol=1e-4).all(-1)).sum())
    return wrong, flat.shape[0]


def draw(generator: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """A random mass and friction factor per world."""
    mass = 0.5 + 1.5 * torch.rand(n, generator=generator, dtype=torch.float64)
    return {"mass": mass, "friction": 0.2 + torch.rand(n, generator=generator, dtype=torch.float64)}


COLLECTORS: dict[str, Callable[..., Any]] = {  # 32 worlds: one env of 32, or two workers of 16 (spawned)
    "single": lambda s, **kw: Collector(s.env_fn(make_boxes_32), None, **kw),
    "multisync": lambda s, **kw: MultiSyncCollector([s.env_fn(make_boxes_16)] * 2, None, **kw),
    "multiasync": lambda s, **kw: MultiAsyncCollector([s.env_fn(make_boxes_16)] * 2, None, **kw),
}


@pytest.mark.parametrize("mode", ["reset", "step", "truncate"])
@pytest.mark.parametrize("kind", list(COLLECTORS))
@pytest.mark.timeout(400)
def test_every_frame_of_ten_thousand_names_the_physics_its_world_ran(kind: str, mode: str) -> None:
    sender = EnvStateSender(config={"mass": 1.0, "friction": 1.0}, apply="set_physics", apply_at=mode)
    with start_method("spawn"):
        collector = COLLECTORS[kind](
            sender, frames_per_batch=32 * EPISODE_STEPS, total_frames=-1, weight_sync_schemes=sender.schemes()
        )
    every_frame_names_its_physics(
        collector, sender, mode, ("mass", "friction"), draw, check_frames, worlds=32, frames=FRAMES
    )


# ---- the example ---------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_the_genesis_adr_example_widens_mass_and_friction_and_every_world_holds_its_config(tmp_path: Path) -> None:
    """``examples/genesis_adr.py --smoke`` as a script: PPO under ADR over 16 worlds; every
    episode's simulated physics is its config's, each world's physics read back holds the config
    of the version it runs, and both ranges widened."""
    log, stdout = run_adr_example("genesis_adr", tmp_path)
    assert log["failures"] == [] and log["episodes_checked"] >= 30 and log["worlds_read_back"] == 16
    assert "16 worlds read back hold the config of the version they run" in stdout
