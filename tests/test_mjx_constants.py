"""MuJoCo's derived constants for many worlds at once
(:class:`~envsync.integrations.torchrl.mjx_constants.WorldConstants`, what
``PlaygroundWorlds.set_physics`` writes with the masses) against ``mujoco.mj_setConst`` run
world by world: every joint kind, tendons, site and tendon transmissions, armature, a body
welded to the world, a "simple" body, and per-body rows of every field it takes.

Needs MuJoCo alone (the main venv's ``mujoco`` extra); no JAX.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

mujoco = pytest.importorskip("mujoco")

from envsync.integrations.torchrl.mjx_constants import CONSTANTS, DERIVING, WorldConstants  # noqa: E402

MODEL = """
<mujoco>
  <worldbody>
    <body name="fixed" pos="0 0 1"><geom size=".1" mass="3"/></body>
    <body name="slider" pos="1 0 0"><joint type="slide" axis="0 0 1"/><geom size=".1" mass="2"/></body>
    <body name="torso" pos="0 0 2">
      <freejoint/>
      <geom type="box" size=".3 .2 .1" mass="5"/>
      <site name="thrust" pos=".3 0 0"/>
      <body name="arm" pos=".3 0 0">
        <joint name="shoulder" type="ball" armature=".02"/>
        <geom type="capsule" fromto="0 0 0 .4 0 0" size=".05" mass="1"/>
        <site name="s1" pos=".2 0 .05"/>
        <body name="forearm" pos=".4 0 0">
          <joint name="elbow" type="hinge" axis="0 1 0" armature=".01"/>
          <geom type="capsule" fromto="0 0 0 .3 0 0" size=".04" mass=".7"/>
          <site name="s2" pos=".1 0 .05"/>
          <body name="hand" pos=".3 0 0">
            <joint name="wrist" type="slide" axis="1 0 0"/>
            <geom size=".05" mass=".2"/>
          </body>
        </body>
      </body>
    </body>
  </worldbody>
  <tendon>
    <fixed name="coupled"><joint joint="elbow" coef="1"/><joint joint="wrist" coef="-.5"/></fixed>
    <spatial name="cable"><site site="s1"/><site site="s2"/></spatial>
  </tendon>
  <actuator>
    <motor joint="elbow" gear="3"/>
    <motor joint="shoulder" gear="1 2 .5 0 0 0"/>
    <motor site="thrust" gear="1 0 .3 0 .2 0"/>
    <motor tendon="coupled" gear="2"/>
    <position joint="wrist" kp="10"/>
  </actuator>
</mujoco>
"""


def _reference(model: object, rows: dict[str, np.ndarray], world: int) -> object:
    """A copy of ``model`` holding world ``world``'s rows, its constants by ``mj_setConst``."""
    held = copy.copy(model)
    for field, values in rows.items():
        getattr(held, field)[...] = values[world]
    mujoco.mj_setConst(held, mujoco.MjData(held))
    return held


def _random_rows(model: object, k: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``k`` worlds of every field :class:`WorldConstants` takes, each body, dof and actuator
    scaled by its own factor (the inertias per axis)."""
    return {
        "body_mass": model.body_mass[None] * rng.uniform(0.3, 3.0, (k, model.nbody)),
        "body_inertia": model.body_inertia[None] * rng.uniform(0.3, 3.0, (k, model.nbody, 3)),
        "dof_armature": model.dof_armature[None] * rng.uniform(0.5, 2.0, (k, model.nv))
        + rng.uniform(0, 0.05, (k, model.nv)),
        "actuator_gear": model.actuator_gear[None] * rng.uniform(0.5, 2.0, (k, model.nu, 1)),
    }


def _assert_constants(model: object, got: dict[str, np.ndarray], rows: dict[str, np.ndarray]) -> None:
    for world in range(next(iter(rows.values())).shape[0]):
        want = _reference(model, rows, world)
        for name in CONSTANTS:
            expected = np.asarray(getattr(want, name))
            assert got[name][world].shape == expected.shape, name
            np.testing.assert_allclose(got[name][world], expected, rtol=1e-10, atol=1e-14, err_msg=name)


def test_every_constant_of_every_world_is_what_mj_setconst_gives_that_worlds_model() -> None:
    model = mujoco.MjModel.from_xml_string(MODEL)
    assert model.ntendon == 2 and model.body_weldid[1] == 0  # a tendon model with a welded body
    assert model.body_simple[2]  # and a simple body (MuJoCo's M for it: a diagonal stored at compilation)
    rows = _random_rows(model, 6, np.random.default_rng(0))
    _assert_constants(model, WorldConstants(model)(rows, {}), rows)


def test_fields_not_written_are_read_from_held_rows_then_from_the_model_as_built() -> None:
    model = mujoco.MjModel.from_xml_string(MODEL)
    all_rows = _random_rows(model, 4, np.random.default_rng(1))
    constants = WorldConstants(model)
    got = constants({"body_mass": all_rows["body_mass"]}, {"actuator_gear": all_rows["actuator_gear"]})
    expected = {f: all_rows[f] for f in ("body_mass", "actuator_gear")}
    _assert_constants(model, got, expected)
    assert set(DERIVING) == set(all_rows)


def test_a_gymnasium_model_as_built_gives_its_own_constants() -> None:
    """HalfCheetah's model as gymnasium ships it: the constants of its own fields are the ones
    it was compiled with."""
    gymnasium = pytest.importorskip("gymnasium")
    assets = Path(gymnasium.__file__).parent / "envs" / "mujoco" / "assets" / "half_cheetah.xml"
    model = mujoco.MjModel.from_xml_path(str(assets))
    rows = {f: np.asarray(getattr(model, f), np.float64)[None] for f in DERIVING}
    got = WorldConstants(model)(rows, {})
    for name in CONSTANTS:
        np.testing.assert_allclose(got[name][0], getattr(model, name), rtol=1e-10, atol=1e-14, err_msg=name)
