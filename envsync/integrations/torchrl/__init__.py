"""The torchrl integration: the only package that knows torchrl's collectors and envs.

* :mod:`.factory` wraps env factories (hooks, template config);
* :mod:`.adapter` holds the hooks on an env, the receiver's view of it, and the binding
  to a collector;
* :mod:`.scheme` attaches a sender to a collector through ``weight_sync_schemes``;
* :mod:`.routing` keeps env pushes through ``update_policy_weights_`` off torchrl's
  policy-version count;
* :mod:`.handlers` teaches ``envsync.reinit`` torchrl's stateful transforms;
* :mod:`.applies` holds the built-in ``apply=`` objects (front: :mod:`envsync.apply`);
* :mod:`.rollouts` wraps a rollout's safe points once for every env kind; :mod:`.batched`,
  :mod:`.group`, :mod:`.native` and :mod:`.level` serve batched envs, :mod:`.outside` an env
  outside any collector, :mod:`.ray` a ``RayCollector``.

Where torchrl gives no public way, this package (and only it) reaches into torchrl's
protected members, each for one reason:

* ``EnvBase._step`` / ``EnvBase._reset`` (:mod:`.adapter`, :mod:`.batched`): the safe points
  are hooks on the env instance's own step and reset, the methods torchrl's ``step`` and
  ``reset`` call; torchrl has no hook API on an env (a transform appended last would add a
  layer to every step and re-key the user's ``state_dict``).
* ``SerialEnv._envs`` (:mod:`.batched`): a ``SerialEnv``'s sub-envs, which it keeps in this
  list only.
* ``GymWrapper._env`` (:mod:`.applies`, and :func:`envsync.configure.wrapper_chain` by name):
  the gymnasium env a torchrl wrapper holds; ``GymWrapper.__getattr__`` forwards attribute
  reads to it but gives no handle to the object itself (needed to reset it with a seed and
  read its ``spec`` when rebuilding, and to find attribute owners along the chain).
* ``Transform._reset`` / ``Transform._step`` (:mod:`.handlers`): ``recompute`` feeds one
  transform the way its ``TransformedEnv`` does; no public call updates a single transform.
* ``VecNorm._td`` (:mod:`.vecnorm`): whether a v1 ``VecNorm`` holds statistics yet; its
  public readers warn and ``loc``/``scale`` raise in that case.
* ``MujocoPlaygroundWrapper._env`` / ``_init_env`` / ``_make_specs`` and Playground's
  ``MjxEnv._mjx_model`` (:mod:`.playground`): the wrapper's override points and the
  Playground env it holds, and the model a Playground env steps with, swapped per world
  inside the vmapped step as Playground's own ``BraxDomainRandomizationVmapWrapper`` does
  (Playground has no public way to step one env with another model).
* ``WeightSyncScheme._init_on_sender_impl`` / ``_init_on_receiver_impl`` (:mod:`.scheme`):
  the override points torchrl's scheme API defines for subclasses (called through ``super()``);
  ``Collector._maybe_fallback_update``: the single ``Collector``'s own policy update, which a
  non-empty ``weight_sync_schemes`` otherwise turns off.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torchrl.envs import EnvBase
from torchrl.weight_update import WeightSyncScheme

from envsync.integrations.torchrl import handlers as _handlers  # noqa: F401  (registers them)
from envsync.integrations.torchrl.applies import read_config
from envsync.integrations.torchrl.factory import wrap_env_fn
from envsync.integrations.torchrl.scheme import make_schemes
from envsync.sender.sender import Sender


class EnvStateSender(Sender):
    """Publishes the desired env state to the workers of torchrl collectors.

    Takes the arguments of :class:`envsync.sender.sender.Sender` (config template, ``apply``,
    ``reinit``, ``apply_at``, ``allow_nonfinite``, ``env_state_template``) and adds what a
    torchrl collector needs: :meth:`env_fn` and :meth:`schemes`.

    Examples:
        >>> sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
        >>> sender.push(config={"difficulty": 0.5})  # no collector yet: desired state only
        1
        >>> sender.desired_config()["difficulty"].item()
        0.5
        >>> sender.close()
    """

    @classmethod
    def from_env(
        cls,
        make_env: Callable[..., EnvBase] | EnvBase,
        *,
        config: Sequence[str],
        apply: Any,
        **kwargs: Any,
    ) -> EnvStateSender:
        """A sender whose config template is read from the env: version 0 is the env as built.

        Builds the env once in this process (or reads the built env you pass; for a batched
        env, one of its sub-envs), reads each name in ``config`` where ``apply`` would set it
        (``envsync.apply.attributes()``: the attribute along the wrapper chain;
        ``envsync.apply.rebuild()``: the constructor argument; any other apply: the
        attribute), and takes its value, shape and dtype as the template (a Python float is
        a float64, an int an int64, an array keeps its dtype).

        Args:
            make_env: the env factory you will pass to :meth:`env_fn`, or a built env.
            config: the names to read.
            apply: how workers apply the config (as in the constructor).
            **kwargs: the constructor's other arguments (``reinit``, ``apply_at``, ...).

        Raises:
            ValidationError: a name the env does not have, or a value that is not a number
                or an array.

        Examples:
            >>> from torchrl.envs import GymEnv
            >>> import envsync
            >>> sender = EnvStateSender.from_env(
            ...     lambda: GymEnv("Pendulum-v1"), config=["g", "max_speed"], apply=envsync.apply.attributes()
            ... )
            >>> {k: (v.item(), v.dtype) for k, v in sender.desired_config().items()}
            {'g': (10.0, torch.float64), 'max_speed': (8, torch.int64)}
            >>> sender.close()
        """
        return cls(config=read_config(make_env, config, apply), apply=apply, **kwargs)

    def env_fn(self, fn: Callable[..., EnvBase] | EnvBase) -> Any:
        """Wrap an env factory (or a built env) so its env carries envsync's safe points.

        Args:
            fn: a callable returning an ``EnvBase``, or an ``EnvBase``.

        Returns:
            A picklable factory (or, for a built env, that env, hooked).
        """
        return wrap_env_fn(self, fn)

    def schemes(self, policy_scheme: WeightSyncScheme | None = None) -> dict[str, WeightSyncScheme]:
        """The ``weight_sync_schemes`` to pass to the collector.

        Args:
            policy_scheme: replaces the default ``"policy"`` scheme.

        Returns:
            ``{"env": <envsync scheme>, "policy": <policy scheme>}``.
        """
        return make_schemes(self, policy_scheme)

    def attach_env(self, env: EnvBase) -> int:
        """Join an env that no collector drives (an evaluation env run by ``env.rollout``)
        to the fleet, after the envs attached so far; return its fleet index.

        It applies pushes, ``reinit`` and merged statistics at its own safe points (the
        steps and resets of its rollouts; in ``"step"``/``"truncate"`` mode at once while no
        rollout runs), and every rollout carries ``"env_version"`` and ``"env_index"``, at
        the root and under ``"next"``. It only receives statistics: ``sync_stats`` does not
        count what it observes, and each merge replaces its own. Checkpoints keep no row for
        it (attach it again after resuming). ``detach_env`` or ``env.close()`` takes it out.

        Args:
            env: an unbatched ``EnvBase`` built like the collectors' envs (the same
                transforms); it is hooked in place and reset once if a lazy transform
                (``VecNorm``) has no statistics yet.

        Raises:
            ValidationError: a batched env, one already in a fleet, one that lacks the
                fleet's env-state entries, or a sender that knows no env yet
                (:meth:`env_fn` first).

        Examples:
            >>> from envsync.envs import make_drift_env
            >>> sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
            >>> make_env = sender.env_fn(make_drift_env)  # the collectors' envs
            >>> test_env = make_drift_env()
            >>> sender.attach_env(test_env)  # no collector yet: the first index
            0
            >>> version = sender.push(config={"difficulty": 0.5})
            >>> rollout = test_env.rollout(3)  # the push applies at the rollout's reset
            >>> rollout["env_version"].tolist(), rollout["next", "env_index"].tolist()
            ([1, 1, 1], [0, 0, 0])
            >>> sender.detach_env(test_env)
            >>> sender.close()
        """
        from envsync.integrations.torchrl.outside import attach_env

        return attach_env(self, env)

    def detach_env(self, env: EnvBase) -> None:
        """Take an env joined with :meth:`attach_env` out of the fleet (closing it does too);
        it keeps running as a plain env, with the state it has.

        Raises:
            ValidationError: the env was not attached to this sender with :meth:`attach_env`.
        """
        from envsync.integrations.torchrl.outside import detach_env

        detach_env(self, env)

    def ray_kwargs(
        self,
        collector_kwargs: Mapping[str, Any] | None = None,
        policy_scheme: WeightSyncScheme | None = None,
        *,
        start_method: str | None = None,
    ) -> dict[str, Any]:
        """The keyword arguments that attach this sender to a torchrl ``RayCollector``.

        Call it right before building the ``RayCollector``, after wrapping its env factories
        with :meth:`env_fn`. Needs the ``ray`` extra (``pip install "envsync[ray]"``).

        Args:
            collector_kwargs: the ``collector_kwargs`` you would pass (merged: envsync adds
                its node scheme, and a ``"policy"`` scheme unless you gave one).
            policy_scheme: replaces the default driver-level ``"policy"`` scheme (torchrl's
                Ray scheme, inert without an ``nn.Module`` policy).
            start_method: the multiprocessing start method of the collectors inside the
                actors (``None``: torchrl's default, spawn). ``"fork"`` starts workers fast.

        Returns:
            ``{"weight_sync_schemes": ..., "collector_kwargs": ...}``.
        """
        from envsync.integrations.torchrl.ray import make_ray_kwargs

        return make_ray_kwargs(self, collector_kwargs, policy_scheme, start_method)


__all__ = ["EnvStateSender"]
