"""MuJoCo Playground (MJX, JAX) worlds whose physics is data: :class:`PlaygroundWorlds`.

Playground's model is an immutable JAX pytree. Its own domain randomisation builds a batched
model once, when the env is wrapped for training, and torchrl 0.14.1's
``MujocoPlaygroundWrapper`` steps ``vmap(jit(env.step))`` over the state alone: the model is
a constant of the compiled step, and every ``reset`` re-initialises the whole batch. So
neither can change one world's physics while it runs.

:class:`PlaygroundWorlds` keeps torchrl's wrapper (its specs, its observation and action
conventions) and changes three things:

* **Per-world fields are arguments.** Each field that may change (``body_mass``,
  ``body_inertia``, ``geom_friction``, ``dof_damping``, ``actuator_gear``, and the constants
  MuJoCo derives from them) is an array with a leading world axis, passed into the jitted,
  vmapped step and reset (``in_axes=0``); inside, the env's model is that world's model
  (``tree_replace``), as Playground's own ``BraxDomainRandomizationVmapWrapper`` does. New
  values of the same shapes never retrace: one compilation of the step, one of the reset.
* **Partial resets.** A reset with ``"_reset"`` resets only the masked worlds, each from its
  own key (a fixed-shape reset of every world, then a masked select: one compilation).
* **One write per push.** :meth:`PlaygroundWorlds.set_physics` takes scale factors against the
  model as built for the rows ``env_ids`` and writes every field at once, functionally: one
  jitted masked select over full-size arrays (``where(mask, new, old)``), so any number of
  rows costs the same single compilation. It returns once the new arrays are computed
  (``block_until_ready``): envsync's "applied" means the simulator holds them.

MuJoCo derives constants from the masses, inertias and gears when it compiles a model
(``mj_setConst``): ``body_subtreemass``, ``body_invweight0`` and ``dof_invweight0`` (the
constraint solver scales its regularisation by them: MJX's joint limits, contacts and
friction loss read them at every step), ``actuator_acc0`` (dampratio gains) and
``tendon_invweight0``. MJX has no ``set_const``: the constants of the changed worlds are
computed on the host for all of them at once, by
:class:`~envsync.integrations.torchrl.mjx_constants.WorldConstants` (batched float64 linear
algebra: equal to ``mj_setConst``'s to 1e-10, tested), and written with them. Friction and damping
need none.

This module is the only one that imports JAX, MuJoCo and Playground, and only when an env is
built (``pip install "envsync[playground]"``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.envs.libs.mujoco_playground import MujocoPlaygroundWrapper

from envsync.errors import ValidationError
from envsync.integrations.torchrl.mjx_constants import CONSTANTS, DERIVING, WorldConstants

SCALES: dict[str, tuple[str, ...]] = {
    "mass": ("body_mass", "body_inertia"),
    "friction": ("geom_friction",),
    "damping": ("dof_damping",),
    "gear": ("actuator_gear",),
}
"""Each scale factor :meth:`PlaygroundWorlds.set_physics` takes, and the model fields it
scales (a denser body of the same shape: its mass and its rotational inertia)."""

FREE_OF_CONSTANTS = frozenset({"geom_friction", "dof_damping", "dof_frictionloss", "geom_solref", "geom_solimp"})
"""Fields from which MuJoCo derives no constant: writing them recomputes none."""


class PlaygroundWorlds(MujocoPlaygroundWrapper):
    """``n`` worlds of a MuJoCo Playground env (``batch_size=[n]``) whose physics changes per
    world while they run, without a recompilation, and which reset per world.

    Build it with :meth:`from_name` (a registered Playground task) or from a Playground env.
    Use it with envsync as a natively batched env, ``apply="set_physics"``: every config name
    is a scale factor of :data:`SCALES` (``1.0``, the template, is the model as built).

    Args:
        env: a Playground ``MjxEnv`` (``registry.load(...)``).
        scales: the factors :meth:`set_physics` takes and the fields each scales (default
            :data:`SCALES`); every field named becomes per world.
        **kwargs: torchrl's (``batch_size=[n]``, ``device``); one batch dim.

    Examples:
        >>> sorted(PlaygroundWorlds.default_scales())
        ['damping', 'friction', 'gear', 'mass']
    """

    _current_state: Any
    _key: Any

    def __init__(self, env: Any = None, *, scales: Mapping[str, Sequence[str]] | None = None, **kwargs: Any) -> None:
        self._scales = {k: tuple(v) for k, v in (SCALES if scales is None else scales).items()}
        self.traces: Counter[str] = Counter()
        """How many times each jitted function (``"step"``, ``"reset"``, ``"write"``) was traced:
        each trace is a compilation (JAX compiles a jitted function once per trace)."""
        super().__init__(env, **kwargs)

    @staticmethod
    def default_scales() -> dict[str, tuple[str, ...]]:
        """The factors :meth:`set_physics` takes by default, and the fields each scales."""
        return dict(SCALES)

    @classmethod
    def from_name(
        cls,
        env_name: str,
        num_worlds: int,
        *,
        impl: str = "jax",
        config_overrides: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> PlaygroundWorlds:
        """``num_worlds`` worlds of the registered Playground task ``env_name``
        (``"CartpoleBalance"``: dm_control suite models ship in the package).

        Args:
            impl: MJX's backend: ``"jax"`` (the default here: on the CPU its step is ~12x
                faster than Warp's CPU device and needs no kernel compilation) or ``"warp"``.
            config_overrides: Playground's config overrides for the task.
            **kwargs: :class:`PlaygroundWorlds`'s (``scales``) and torchrl's (``device``).
        """
        from mujoco_playground import registry

        env = registry.load(env_name, config_overrides={"impl": impl, **dict(config_overrides or {})})
        return cls(env, batch_size=[num_worlds], **kwargs)

    def _init_env(self) -> None:
        super()._init_env()
        if len(self.batch_size) != 1:
            raise ValidationError(f"PlaygroundWorlds: one batch dim (the worlds), got {list(self.batch_size)}")
        if self._agent_mapping is not None:
            raise ValidationError("PlaygroundWorlds: agent_mapping is not supported")
        import jax

        n, model = int(self.batch_size[0]), self._env.unwrapped.mjx_model
        scaled = [f for fields in self._scales.values() for f in fields]
        for name in scaled:
            if not hasattr(model, name):
                raise ValidationError(f"PlaygroundWorlds: the MJX model has no field {name!r}")
            if name not in FREE_OF_CONSTANTS and name not in DERIVING:
                raise ValidationError(
                    f"PlaygroundWorlds: {name!r} cannot be per world: the constants MuJoCo derives are recomputed "
                    f"for {sorted(DERIVING)} (and {sorted(FREE_OF_CONSTANTS)} derive none)"
                )
        deriving = any(f in DERIVING for f in scaled)
        derived = [c for c in CONSTANTS if deriving and np.asarray(getattr(model, c)).size]
        self._per_world = list(dict.fromkeys(scaled + derived))
        as_built = {f: np.asarray(getattr(model, f)) for f in self._per_world}
        self._built = {f: v.astype(np.float64) for f, v in as_built.items()}  # what factors scale
        self._jax_device = jax.local_devices()[0]
        self._fields = {f: self._commit(np.repeat(v[None], n, 0)) for f, v in as_built.items()}
        self._staging = {f: np.zeros((n, *v.shape), v.dtype) for f, v in as_built.items()}  # rows of a write
        self._derive = WorldConstants(self._env.mj_model) if deriving else None
        self._jit_step = jax.jit(jax.vmap(self._world_step))
        self._jit_reset = jax.jit(self._reset_rows)
        self._jit_write = jax.jit(self._masked_write)
        self._key = None

    def _commit(self, value: Any) -> Any:
        """``value`` on the env's device, committed to it: a jitted function's outputs are, and
        inputs committed or not lower to two executables of one trace (a second compilation)."""
        import jax

        return jax.device_put(value, self._jax_device)

    def _set_seed(self, seed: int | None) -> None:
        import jax

        self._key = self._commit(jax.random.PRNGKey(int(seed or 0)))

    def _world_model(self, fields: dict[str, Any]) -> Any:
        return self._env.unwrapped.mjx_model.tree_replace(fields)

    def _with_world(self, fields: dict[str, Any], fn: Any, *args: Any) -> Any:
        """``fn(*args)`` with the env's model that of one world (traced: ``fields`` are that
        world's rows). Playground's envs read their model through ``mjx_model``, which returns
        ``_mjx_model``: the reach Playground's own ``BraxDomainRandomizationVmapWrapper`` makes."""
        env = self._env.unwrapped
        built = env._mjx_model
        env._mjx_model = self._world_model(fields)
        try:
            return fn(*args)
        finally:
            env._mjx_model = built

    def _world_step(self, fields: dict[str, Any], state: Any, action: Any) -> Any:
        self.traces["step"] += 1
        return self._with_world(fields, self._env.step, state, action)

    def _reset_rows(self, fields: dict[str, Any], key: Any, mask: Any, state: Any) -> tuple[Any, Any]:
        """Reset every world from its own key (one fixed shape), keep the new state where
        ``mask`` is set; return the next key and the state."""
        import jax

        self.traces["reset"] += 1
        key, sub = jax.random.split(key)
        keys = jax.random.split(sub, mask.shape[0])
        fresh = jax.vmap(lambda f, k: self._with_world(f, self._env.reset, k))(fields, keys)
        return key, jax.tree.map(lambda new, old: _select(mask, new, old), fresh, state)

    def _masked_write(self, fields: dict[str, Any], rows: dict[str, Any], masks: dict[str, Any]) -> dict[str, Any]:
        self.traces["write"] += 1
        return {f: _select(masks[f], rows[f], fields[f]) for f in fields}

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs: Any) -> TensorDictBase:
        import jax

        n = int(self.batch_size[0])
        if self._key is None:
            self._set_seed(getattr(self, "_seed", None))
        mask = None if tensordict is None else tensordict.get("_reset", None)
        state = self._current_state
        if state is None:  # the first reset: every world, over a state of zeros of the right shapes
            mask = None
            shapes = jax.eval_shape(lambda k: jax.vmap(self._env.reset)(jax.random.split(k, n)), self._key)
            state = jax.tree.map(lambda s: self._commit(np.zeros(s.shape, s.dtype)), shapes)
        rows = np.ones(n, bool) if mask is None else mask.reshape(n, -1).any(-1).cpu().numpy()
        self._key, self._current_state = self._jit_reset(self._fields, self._key, rows, state)
        return self._output(self._current_state, reward=False)

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        from torchrl.envs.libs.jax_utils import _tensor_to_ndarray

        action = _tensor_to_ndarray(tensordict.get("action"))
        self._current_state = self._jit_step(self._fields, self._current_state, action)
        return self._output(self._current_state, reward=True)

    def _output(self, state: Any, *, reward: bool) -> TensorDictBase:
        from torchrl.envs.libs.jax_utils import _ndarray_to_tensor

        shape = (*self.batch_size, 1)
        done = _ndarray_to_tensor(state.done).to(self.device).bool().view(shape)
        source: dict[str, Any] = {**self._extract_obs(state), "done": done, "terminated": done.clone()}
        if reward:
            source["reward"] = _ndarray_to_tensor(state.reward).to(self.device).view(shape)
        return TensorDict(source, batch_size=self.batch_size, device=self.device)

    def _make_specs(self, env: Any) -> None:
        # read once: Playground's observation_size traces the env's reset at every read, and
        # torchrl's wrapper reads it at every step
        size = env.observation_size
        self._obs_keys = list(size) if isinstance(size, Mapping) else None
        super()._make_specs(env)

    def _obs_is_dict(self) -> bool:
        return self._obs_keys is not None

    def _extract_obs(self, state: Any) -> dict[str, torch.Tensor]:
        from torchrl.envs.libs.jax_utils import _ndarray_to_tensor

        if self._obs_keys is None:
            return {"observation": _ndarray_to_tensor(state.obs).to(self.device)}
        return {key: _ndarray_to_tensor(state.obs[key]).to(self.device) for key in self._obs_keys}

    def set_physics(self, env_ids: torch.Tensor, **factors: Any) -> None:
        """Give worlds ``env_ids`` the model as built times ``factors`` (each a name of the
        env's scales, one row per index: ``(k,)`` scales a world's whole field, ``(k, nbody)``
        each body), with the constants MuJoCo derives from them, in one functional write.

        Returns once the simulator holds the new fields: the next step and reset of those
        worlds run them, the other worlds' fields are untouched.

        Raises:
            ValidationError: a name that is not a scale of this env, or a factor whose shape
                is not a leading part of its field's (per row).
        """
        ids = np.asarray(env_ids.cpu() if isinstance(env_ids, torch.Tensor) else env_ids, dtype=np.int64).reshape(-1)
        rows = self._scaled_rows(ids, factors)
        if self._derive is not None and any(f in DERIVING for f in rows):
            rows.update(self._constants(self._derive, ids, rows))
        self._write(ids, rows)

    def _scaled_rows(self, ids: np.ndarray, factors: Mapping[str, Any]) -> dict[str, np.ndarray]:
        rows: dict[str, np.ndarray] = {}
        for name, factor in factors.items():
            if name not in self._scales:
                raise ValidationError(f"set_physics: {name!r} is not a scale of this env ({sorted(self._scales)})")
            value = np.asarray(factor.cpu() if isinstance(factor, torch.Tensor) else factor, dtype=np.float64)
            value = value.reshape(ids.shape[0], *value.shape[1:]) if value.ndim else np.full(ids.shape, float(value))
            for field in self._scales[name]:
                built = self._built[field]
                if value.shape[1:] != built.shape[: value.ndim - 1]:
                    raise ValidationError(
                        f"set_physics: {name!r} scales {field!r} of shape {built.shape} per world; a factor has a "
                        f"leading part of it (() for all, {built.shape[:1]} per row), got {value.shape[1:]}"
                    )
                rows[field] = built[None] * value.reshape(value.shape + (1,) * (built.ndim + 1 - value.ndim))
        return rows

    def _constants(
        self, derive: WorldConstants, ids: np.ndarray, rows: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The derived constants of worlds ``ids`` with ``rows`` written, the fields not written
        read from what the worlds hold."""
        held = {f: np.asarray(self._fields[f])[ids] for f in self._per_world if f in DERIVING and f not in rows}
        derived = derive({f: v for f, v in rows.items() if f in DERIVING}, held)
        return {c: derived[c] for c in CONSTANTS if c in self._fields}

    def _write(self, ids: np.ndarray, rows: Mapping[str, np.ndarray]) -> None:
        """One jitted masked select over every per-world field (full-size arrays: one shape
        whatever the number of rows), then wait until it is computed."""
        import jax

        n = int(self.batch_size[0])
        masks = {f: np.zeros(n, bool) for f in self._per_world}
        for field, values in rows.items():
            self._staging[field][ids] = values
            masks[field][ids] = True
        self._fields = jax.block_until_ready(self._jit_write(self._fields, self._staging, masks))

    @property
    def worlds_state(self) -> Any:
        """The worlds' Playground state (``mjx_env.State``: data, observation, reward, done,
        with a leading world axis) after the last reset or step; ``None`` before the first reset."""
        return self._current_state

    @property
    def model(self) -> WorldsModel:
        """The per-world fields the worlds run, read from the simulator as tensors with one
        row per world (``env.model.body_mass``; ``sender.read_attributes(["model.body_mass"])``)."""
        return WorldsModel(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(worlds={int(self.batch_size[0])}, scales={sorted(self._scales)})"


class WorldsModel:
    """Read-only view of a :class:`PlaygroundWorlds`' per-world fields: each attribute is a
    tensor ``(n, ...)`` copied from the arrays the jitted step takes; a field that is not per
    world is the model's own, repeated for every world."""

    def __init__(self, worlds: PlaygroundWorlds) -> None:
        self._worlds = worlds

    def __getattr__(self, name: str) -> torch.Tensor:
        worlds = self.__dict__["_worlds"]
        if name in worlds._fields:
            return torch.from_numpy(np.array(worlds._fields[name]))
        value = getattr(worlds._env.unwrapped.mjx_model, name)
        n = int(worlds.batch_size[0])
        return torch.from_numpy(np.array(value)).unsqueeze(0).expand(n, *np.shape(value)).clone()


def _select(mask: Any, new: Any, old: Any) -> Any:
    """``new`` where ``mask`` (one bool per world) is set, else ``old`` (traced)."""
    import jax.numpy as jnp

    return jnp.where(mask.reshape(mask.shape + (1,) * (new.ndim - 1)), new, old)


__all__ = ["CONSTANTS", "SCALES", "PlaygroundWorlds", "WorldsModel"]
