"""MuJoCo's derived constants for many worlds at once: :class:`WorldConstants`.

When MuJoCo compiles a model it derives constants from the masses (``mj_setConst``):
``body_subtreemass``, and at ``qpos0`` the inverse weights the constraint solver scales its
regularisation by (``body_invweight0``, ``dof_invweight0``, ``tendon_invweight0``) and the
acceleration a unit actuator force gives (``actuator_acc0``). MJX has no ``set_const``.

Every one of them is a function of the joint-space inertia matrix at ``qpos0`` and of
quantities of the model's geometry alone (the bodies' Jacobians at their centres of mass, the
tendons' Jacobians, the actuators' moment arms, the kinematic tree). And that matrix is
linear in the fields a domain randomisation scales: ``M = M0 + sum_p theta_p M_p`` over every
body's mass and three principal inertias and every dof's armature, with ``M0`` and the ``M_p``
computed once from the model as built (one ``mj_makeM`` per parameter). The moment arms are
linear in ``actuator_gear``, the subtree masses in ``body_mass``. So the constants of ``k``
worlds are a few batched numpy operations in float64: ``k`` inverses of an ``nv x nv`` matrix
and contractions with the stored Jacobians, no per-world Python and no per-world
``mj_setConst`` (4,096 of which cost the Cartpole ~20 ms).

MuJoCo's own rules are kept: a simple body that does not rotate (a slider alone on its tree)
weighs ``1 / mass``, armature aside; a body welded to the world weighs 0. Checked against
``mj_setConst`` world by world in ``tests/test_mjx_constants.py`` (to 1e-10 relative; 1e-14
seen). The geometry must not change per world (``body_pos``, ``body_ipos``, ``qpos0``...: they
move the Jacobians); :data:`DERIVING` names the fields this module takes.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import numpy as np

DERIVING = frozenset({"body_mass", "body_inertia", "dof_armature", "actuator_gear"})
"""Fields whose new values change MuJoCo's derived constants and which :class:`WorldConstants`
recomputes them for (the inertia matrix, the subtree masses and the moment arms are linear in
them)."""

CONSTANTS = ("body_subtreemass", "body_invweight0", "dof_invweight0", "actuator_acc0", "tendon_invweight0")
"""What ``mj_setConst`` derives that MJX reads at a step."""

MINVAL = 1e-15
"""MuJoCo's ``mjMINVAL``: the smallest mass its simple-body rule divides by."""


class WorldConstants:
    """The constants ``mj_setConst`` derives, for rows of per-world ``body_mass``,
    ``body_inertia``, ``dof_armature`` and ``actuator_gear`` (float64, as MuJoCo computes).

    Args:
        model: the ``mujoco.MjModel`` as built (copied; not changed).

    Examples:
        >>> import mujoco
        >>> model = mujoco.MjModel.from_xml_string(
        ...     '<mujoco><worldbody><body><joint type="slide"/><geom size=".1" mass="2"/></body>'
        ...     '</worldbody></mujoco>')
        >>> constants = WorldConstants(model)
        >>> out = constants({"body_mass": np.array([[0.0, 4.0]])}, held={})
        >>> float(out["dof_invweight0"][0, 0]), float(out["body_subtreemass"][0, 0])
        (0.25, 4.0)
    """

    def __init__(self, model: Any) -> None:
        import mujoco

        model = copy.copy(model)
        data = mujoco.MjData(model)
        nv, nbody = model.nv, model.nbody
        self._built = {f: np.asarray(getattr(model, f), np.float64).copy() for f in DERIVING}
        # subtree masses: body b's own mass counts in b and in each of its ancestors
        self._subtree = np.zeros((nbody, nbody))
        for body in range(nbody):
            at = body
            while True:
                self._subtree[body, at] = 1.0
                if at == 0:
                    break
                at = int(model.body_parentid[at])
        # MuJoCo's rule for a simple body that does not rotate (body_simple 2): its weights are
        # 1 / its mass (armature and the general formula aside), kept here as MuJoCo has it
        self._simple = np.flatnonzero(np.asarray(model.body_simple) == 2)
        self._simple_dofs = np.flatnonzero(np.isin(np.asarray(model.dof_bodyid), self._simple))
        self._simple_dof_bodies = np.asarray(model.dof_bodyid)[self._simple_dofs]
        # joint-space inertia at qpos0: M0 with every parameter at zero, then one per parameter;
        # every body "not simple", so that MuJoCo computes M from the masses (as MJX does), not
        # from the diagonal it stored at compilation for a simple body (``dof_M0``)
        model.body_simple[:] = 0
        model.dof_simplenum[:] = 0
        model.body_mass[:] = 0
        model.body_inertia[:] = 0
        model.dof_armature[:] = 0
        data.qpos[:] = model.qpos0
        mujoco.mj_kinematics(model, data)
        mujoco.mj_comPos(model, data)
        mujoco.mj_tendon(model, data)
        mujoco.mj_transmission(model, data)
        self._m0 = self._inertia(model, data)
        basis = []
        for field, count in (("body_mass", nbody), ("body_inertia", nbody * 3), ("dof_armature", nv)):
            flat = getattr(model, field).reshape(-1)
            for p in range(count):
                flat[p] = 1.0
                basis.append(self._inertia(model, data) - self._m0)
                flat[p] = 0.0
        self._basis = np.stack(basis).reshape(len(basis), nv * nv)
        # geometry at qpos0: the bodies' Jacobians at their centres of mass (zero for a body
        # welded to the world: its weights are 0, as MuJoCo's), tendons', moment arms
        jacobians = np.zeros((nbody, 6, nv))
        for body in range(1, nbody):
            mujoco.mj_jacBodyCom(model, data, jacobians[body, :3], jacobians[body, 3:], body)
        tendons = _dense(model.ntendon, nv, data.ten_J, model.ten_J_rownnz, model.ten_J_rowadr, model.ten_J_colind)
        rows = np.concatenate([jacobians.reshape(-1, nv), tendons])
        self._rows = nbody * 6
        self._outer = np.einsum("rv,rw->vwr", rows, rows).reshape(nv * nv, len(rows))  # vec(r r^T) by columns
        moments = np.zeros((6, model.nu, nv))  # the moment arms of a unit gear in each component
        for c in range(6):
            model.actuator_gear[:] = 0
            model.actuator_gear[:, c] = 1
            mujoco.mj_transmission(model, data)
            moments[c] = _dense(
                model.nu, nv, data.actuator_moment, data.moment_rownnz, data.moment_rowadr, data.moment_colind
            )
        self._components = [c for c in range(6) if moments[c].any()]  # a hinge's: the first alone
        self._arms = moments[self._components].transpose(2, 0, 1).reshape(nv, -1)  # (nv, c * nu)
        # each dof's inverse weight averages its joint's: a ball's three, a free joint's three and three
        self._average = np.zeros((nv, nv))
        for dof in range(nv):
            joint = int(model.dof_jntid[dof])
            start, kind = int(model.jnt_dofadr[joint]), int(model.jnt_type[joint])
            group = (
                range(start + 3 * ((dof - start) // 3), start + 3 * ((dof - start) // 3) + 3)
                if kind in (mujoco.mjtJoint.mjJNT_FREE, mujoco.mjtJoint.mjJNT_BALL)
                else range(dof, dof + 1)
            )
            self._average[list(group), dof] = 1.0 / len(group)
        self._nv, self._nu = nv, model.nu

    @staticmethod
    def _inertia(model: Any, data: Any) -> np.ndarray:
        import mujoco

        mujoco.mj_comPos(model, data)  # the bodies' spatial inertias, from their masses
        mujoco.mj_makeM(model, data)
        full = np.zeros((model.nv, model.nv))
        mujoco.mj_fullM(model, data, full)
        return full

    def __call__(self, rows: Mapping[str, np.ndarray], held: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The constants of ``k`` worlds whose fields of :data:`DERIVING` are ``rows`` (each
        ``(k, *field shape)``), else ``held`` (the worlds' current rows), else as built."""
        k = next(iter(rows.values())).shape[0]

        def field(name: str) -> np.ndarray:
            value = rows.get(name, held.get(name))
            return np.broadcast_to(self._built[name], (k, *self._built[name].shape)) if value is None else value

        mass = np.asarray(field("body_mass"), np.float64)
        theta = np.concatenate(
            [
                mass,
                np.asarray(field("body_inertia"), np.float64).reshape(k, -1),
                np.asarray(field("dof_armature"), np.float64),
            ],
            axis=1,
        )
        out = {"body_subtreemass": mass @ self._subtree}
        nv = self._nv
        if nv == 0:
            return out
        inverse = np.linalg.inv((self._m0.reshape(1, -1) + theta @ self._basis).reshape(k, nv, nv))
        flat = inverse.reshape(k, nv * nv)
        out["dof_invweight0"] = flat[:, :: nv + 1] @ self._average
        weights = flat @ self._outer  # every diag(r M^-1 r^T) of the Jacobians' rows, one product
        body = weights[:, : self._rows].reshape(k, -1, 6)
        body = np.stack([body[..., :3].mean(-1), body[..., 3:].mean(-1)], axis=-1)
        if self._simple.size:
            body[:, self._simple] = 0.0
            body[:, self._simple, 0] = 1 / np.maximum(MINVAL, mass[:, self._simple])
            out["dof_invweight0"][:, self._simple_dofs] = 1 / np.maximum(MINVAL, mass[:, self._simple_dof_bodies])
        out["body_invweight0"] = body
        out["tendon_invweight0"] = weights[:, self._rows :]
        # M^-1 times each unit gear's moment arms, then summed by the worlds' gears
        gear = np.asarray(field("actuator_gear"), np.float64)[:, :, self._components]  # (k, nu, c)
        arms = (inverse.reshape(k * nv, nv) @ self._arms).reshape(k, nv, len(self._components), self._nu)
        out["actuator_acc0"] = np.linalg.norm(np.einsum("kvca,kac->kav", arms, gear), axis=-1)
        return out


def _dense(rows: int, cols: int, values: Any, rownnz: Any, rowadr: Any, colind: Any) -> np.ndarray:
    """A MuJoCo sparse matrix (``rownnz``/``rowadr``/``colind``) as a dense ``(rows, cols)``."""
    import mujoco

    dense = np.zeros((rows, cols))
    if rows and cols:
        mujoco.mju_sparse2dense(
            dense,
            np.asarray(values, np.float64),
            np.asarray(rownnz, np.int32),
            np.asarray(rowadr, np.int32),
            np.asarray(colind, np.int32),
        )
    return dense


__all__ = ["CONSTANTS", "DERIVING", "WorldConstants"]
