"""Genesis worlds: a Genesis scene built with ``n_envs=n`` as one natively batched torchrl env
whose worlds reset on their own and take their own physics through Genesis's ``envs_idx``
setters, the kind of API Isaac Lab's ``*_index`` setters also have.

torchrl's :class:`~torchrl.envs.GenesisWrapper` resets nothing when asked to (it ignores
``"_reset"``) and keeps one step count for every world, so every world ends its episode at the
same step. :class:`GenesisWorlds` resets the worlds a reset names (``scene.reset(envs_idx=)``),
counts steps per world, and gives worlds ``env_ids`` their physics with :meth:`~GenesisWorlds.set_physics`:

- **mass**: ``body.set_mass(built * factor, envs_idx=env_ids)``, which scales the inertia of
  the body's links with it (a body of the same shape made heavier). Genesis keeps it in the
  solver's link info, per world only in a scene built with ``RigidOptions(batch_links_info=True)``;
  a reset leaves it.
- **friction**: ``body.set_friction_ratio(factor, envs_idx=env_ids)`` over the body's links.
  Genesis keeps the ratio in the solver's *state* and puts it back to the scene's initial
  state when it resets a world, so the worlds keep their factor in a column and write it again
  for the worlds a reset put back (one setter call per reset).

Each returns once the simulator holds the rows (Genesis's setters write the solver's fields
before they return), so an envsync ``apply="set_physics"`` acknowledges "applied" only then.

:meth:`GenesisWorlds.sliding_box` builds the task the tests, the benchmark and the example use:
a box on a plane pushed by a horizontal force, its observation the box's planar position and
velocity, and a ``"physics"`` entry computed by Genesis from the model each world holds (the
translational and one rotational diagonal of the box's joint-space mass matrix, and its geoms'
friction ratio).
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Unbounded
from torchrl.envs import GenesisWrapper

from envsync.errors import ValidationError

SCALES = ("mass", "friction")
"""The per-world factors :meth:`GenesisWorlds.set_physics` takes."""


def _init_genesis() -> Any:
    """Genesis on the CPU, initialised once per process (Genesis refuses a second init)."""
    import genesis as gs

    if not getattr(gs, "_initialized", False):
        gs.init(backend=gs.cpu, logging_level="warning")
    return gs


class GenesisWorlds(GenesisWrapper):
    """The ``n`` worlds of a built Genesis scene as one env of batch size ``[n]``.

    Args:
        scene: a Genesis scene built with ``n_envs=n`` (and ``RigidOptions(batch_links_info=True)``
            for a mass per world).
        body: the rigid entity whose physics :meth:`set_physics` changes and whose planar
            force the action is.
        episode_steps: world ``i``'s episode ends (truncated) after ``episode_steps + i % 7``
            steps: worlds reset at different steps (partial resets).
        **kwargs: :class:`~torchrl.envs.GenesisWrapper`'s other arguments.

    Examples:
        >>> GenesisWorlds.__name__
        'GenesisWorlds'
    """

    def __init__(self, scene: Any, *, body: Any, episode_steps: int = 100, **kwargs: Any) -> None:
        n = int(getattr(scene, "n_envs", 0))
        if n < 1:
            raise ValidationError("GenesisWorlds: build the scene with n_envs= (one world or more)")
        self._body = body
        self._horizons = int(episode_steps) + torch.arange(n) % 7
        self._steps = torch.zeros(n, dtype=torch.int64)
        self._links = list(range(body.n_links))
        self._friction = torch.ones(n, len(self._links))
        super().__init__(scene, max_steps=episode_steps, **kwargs)
        self._built_mass = body.get_mass()[0].item()
        self.action_spec = Unbounded(shape=(n, 2), dtype=torch.float32, device=self.device)

    @classmethod
    def sliding_box(cls, num_worlds: int, *, episode_steps: int = 100, dt: float = 0.01) -> GenesisWorlds:
        """A box on a plane in each of ``num_worlds`` worlds, pushed by a horizontal force (the
        action, in newtons), rewarded for staying near the origin (Genesis on the CPU)."""
        gs = _init_genesis()
        scene = gs.Scene(
            show_viewer=False,
            sim_options=gs.options.SimOptions(dt=dt),
            rigid_options=gs.options.RigidOptions(batch_links_info=True),  # a mass per world
        )
        scene.add_entity(gs.morphs.Plane())
        box = scene.add_entity(gs.morphs.Box(size=(0.2, 0.2, 0.1), pos=(0.0, 0.0, 0.05)))
        scene.build(n_envs=num_worlds)
        return cls(scene, body=box, episode_steps=episode_steps)

    # ---- the task ----------------------------------------------------------------------------

    def _make_obs(self) -> dict[str, torch.Tensor]:
        body = self._body
        position, velocity = body.get_dofs_position(), body.get_dofs_velocity()
        inertia = body.get_mass_mat()
        physics = torch.stack([inertia[:, 0, 0], inertia[:, 3, 3], self.friction_ratio()[:, 0]], dim=-1)
        return {
            "observation": torch.cat([position[:, :2], velocity[:, :2]], dim=-1).float(),
            "physics": physics.float(),
        }

    def _apply_action(self, action: torch.Tensor) -> None:
        force = torch.zeros(action.shape[0], self._body.n_dofs, dtype=torch.float32)
        force[:, :2] = action[:, :2]
        self._body.control_dofs_force(force)

    def _compute_reward(self, action: torch.Tensor) -> torch.Tensor:
        return -self._body.get_dofs_position()[:, :2].norm(dim=-1)

    def _compute_done(self) -> torch.Tensor:
        return self._steps >= self._horizons

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        self._steps += 1
        return super()._step(tensordict)

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDictBase:
        mask = None if tensordict is None else tensordict.get("_reset", None)
        n = int(self.batch_size[0])
        rows = torch.arange(n) if mask is None else torch.nonzero(mask.reshape(n, -1).any(-1)).flatten()
        if len(rows):
            self._scene.reset(envs_idx=None if len(rows) == n else rows)
            self._steps[rows] = 0
            # Genesis resets the friction ratio with the state: these worlds get theirs back
            self._body.set_friction_ratio(self._friction[rows], links_idx_local=self._links, envs_idx=rows)
        return TensorDict(self._obs_as_tensordict(), batch_size=self.batch_size, device=self.device)

    # ---- per-world physics -------------------------------------------------------------------

    def set_physics(self, env_ids: torch.Tensor, **factors: Any) -> None:
        """Give worlds ``env_ids`` the body as built times ``factors`` (``mass=``, ``friction=``:
        one factor per index), through Genesis's setters with ``envs_idx``.

        Returns once the simulator holds them: the next step and reset of those worlds run
        them, the other worlds' physics is untouched.

        Raises:
            ValidationError: a name that is not one of :data:`SCALES`, or a factor that is not one
                number per index.
        """
        ids = torch.as_tensor(env_ids, dtype=torch.int64).reshape(-1)
        rows = {name: self._factor(name, value, len(ids)) for name, value in factors.items()}
        if "mass" in rows:
            self._body.set_mass(self._built_mass * rows["mass"], envs_idx=ids)
        if "friction" in rows:
            ratios = rows["friction"].float().unsqueeze(-1).expand(-1, len(self._links))
            self._friction[ids] = ratios
            self._body.set_friction_ratio(ratios, links_idx_local=self._links, envs_idx=ids)

    @staticmethod
    def _factor(name: str, value: Any, count: int) -> torch.Tensor:
        if name not in SCALES:
            raise ValidationError(f"set_physics: {name!r} is not a scale of this env ({list(SCALES)})")
        factor = torch.as_tensor(value, dtype=torch.float64)
        factor = factor.expand(count) if factor.ndim == 0 else factor.reshape(-1)
        if factor.shape != (count,):
            raise ValidationError(f"set_physics: {name!r} takes one factor per world, got shape {list(factor.shape)}")
        return factor

    def mass(self) -> torch.Tensor:
        """Each world's mass of the body, as the simulator holds it ``(n,)``."""
        return self._body.get_mass().clone()

    def friction_ratio(self) -> torch.Tensor:
        """Each world's friction ratio of the body's geoms, as the simulator holds it ``(n, geoms)``."""
        from genesis.utils.misc import qd_to_torch

        body = self._body
        geoms = slice(body.geom_start, body.geom_start + body.n_geoms)  # this body's, not every geom's
        return qd_to_torch(body.solver.dyn_state.geoms.friction_ratio, col_mask=geoms, transpose=True, copy=True)

    @property
    def model(self) -> _WorldsModel:
        """The per-world physics the worlds hold, read from the simulator as tensors of one row
        per world (``env.model.mass``; ``sender.read_attributes(["model.mass"])``)."""
        return _WorldsModel(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(worlds={int(self.batch_size[0])}, scales={list(SCALES)})"


class _WorldsModel:
    """Read-only view of a :class:`GenesisWorlds`' per-world physics: the body's mass and
    its geoms' friction ratio (first geom), one row per world."""

    def __init__(self, worlds: GenesisWorlds) -> None:
        self._worlds = worlds

    @property
    def mass(self) -> torch.Tensor:
        return self._worlds.mass().double()

    @property
    def friction(self) -> torch.Tensor:
        return self._worlds.friction_ratio()[:, 0].double()


__all__ = ["SCALES", "GenesisWorlds"]
