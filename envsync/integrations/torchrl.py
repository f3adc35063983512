"""The only module that knows torchrl collector internals.

Three attachment points (see ``docs/concepts.md``):

* :class:`EnvSyncTransform`, appended last to every worker env by :func:`wrap_env_fn`: its
  ``_reset_env_preprocess``, ``_inv_call`` and ``_step`` are the receiver's safe points, and it
  tags every frame with ``"env_version"`` (declared in the observation spec, so the collector
  preallocates it and carries it from ``"next"`` to the root).
* :class:`EnvSyncScheme` under the key ``"env"`` of ``weight_sync_schemes``: torchrl calls
  ``init_on_sender`` in the main process (we allocate the shared memory), pickles the scheme
  into each worker, and calls ``init_on_receiver`` there (we bind a receiver to the worker's
  inner collector). ``collector.update_policy_weights_(weights=..., model_id="env")`` reaches
  :meth:`EnvSyncScheme.send`.
* The inner collector's ``rollout`` and ``reset``, wrapped per instance so that the
  receiver knows when the collector drives the env (its idle listener then keeps off).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torchrl.collectors import Collector
from torchrl.data import Composite, Unbounded
from torchrl.envs import EnvBase, TransformedEnv
from torchrl.envs.transforms import Transform
from torchrl.weight_update import SharedMemWeightSyncScheme, WeightSyncScheme

from envsync import reinit
from envsync.errors import ValidationError
from envsync.receiver import ApplySpec, EnvStateReceiver
from envsync.state import apply_config
from envsync.transports.shared_memory import SharedMemoryChannel, SharedMemoryHandle

if TYPE_CHECKING:
    from envsync.sender import Attachment, EnvStateSender

VERSION_KEY = "env_version"


class EnvSyncTransform(Transform):
    """Safe points and frame tags for one env; the receiver plugs in when the worker binds.

    Args:
        spec: how versions are applied.
        initial_config: the config the env was built with (version 0).

    Examples:
        >>> from envsync.envs import make_drift_env
        >>> from envsync.protocol import ApplyAt
        >>> env = TransformedEnv(make_drift_env(), EnvSyncTransform(ApplySpec(None, ApplyAt.RESET), None))
        >>> int(env.reset()["env_version"])
        0
    """

    envsync_internal = True
    """Left out of the transform chain that ``reinit`` selectors index."""

    def __init__(self, spec: ApplySpec, initial_config: TensorDictBase | None) -> None:
        super().__init__(in_keys=[], out_keys=[VERSION_KEY])
        self.spec = spec
        self.initial_config = initial_config
        self.receiver: EnvStateReceiver | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> EnvSyncTransform:
        return EnvSyncTransform(self.spec, self.initial_config)

    def _tag(self, batch_shape: torch.Size) -> torch.Tensor:
        # a fresh tensor per frame: the collector may later write into what the env returned
        receiver = self.receiver
        version = receiver.version if receiver is not None else 0
        return torch.full(batch_shape, version, dtype=torch.int64)

    def transform_observation_spec(self, observation_spec: Composite) -> Composite:
        observation_spec[VERSION_KEY] = Unbounded(
            shape=observation_spec.shape, dtype=torch.int64, device=observation_spec.device
        )
        return observation_spec

    def _reset_env_preprocess(self, tensordict: TensorDictBase) -> TensorDictBase:
        if self.receiver is not None:
            self.receiver.before_reset()
        return tensordict

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        tensordict_reset.set(VERSION_KEY, self._tag(tensordict_reset.batch_size))
        return tensordict_reset

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        if self.receiver is not None:
            self.receiver.before_step()
        return tensordict

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        receiver = self.receiver
        if receiver is not None and receiver.truncate_now():
            done = next_tensordict.get("done")
            truncated = next_tensordict.get("truncated", None)
            truncated = torch.zeros_like(done) if truncated is None else truncated
            next_tensordict.set("truncated", truncated | ~done)
            next_tensordict.set("done", torch.ones_like(done))
        next_tensordict.set(VERSION_KEY, self._tag(next_tensordict.batch_size))
        return next_tensordict

    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        return next_tensordict


def _finish_env(env: EnvBase, spec: ApplySpec, initial_config: TensorDictBase) -> EnvBase:
    """Append the transform last (no nesting), then apply the template config to the result,
    so an apply callable always receives the same kind of env as in the worker later."""
    transform = EnvSyncTransform(spec, initial_config)
    if isinstance(env, TransformedEnv):
        env.append_transform(transform)
    else:
        env = TransformedEnv(env, transform)
    apply_config(env, spec.apply, initial_config)
    return env


class EnvFactory:
    """A picklable env factory: builds the user's env, applies the template config, appends
    :class:`EnvSyncTransform`.

    Its attributes carry an ``envsync_`` prefix: torchrl's ``CloudpickleWrapper`` copies a
    factory's ``__dict__`` onto itself (``functools.update_wrapper``), and a plain ``fn``
    would replace the wrapper's own.

    Args:
        make_env: the user's factory.
        spec: how versions are applied.
        initial_config: the config template (version 0).
    """

    def __init__(self, make_env: Callable[..., EnvBase], spec: ApplySpec, initial_config: TensorDictBase) -> None:
        self.envsync_make_env = make_env
        self.envsync_spec = spec
        self.envsync_initial_config = initial_config

    def __call__(self, **kwargs: Any) -> EnvBase:
        env = self.envsync_make_env(**kwargs)
        if not isinstance(env, EnvBase):
            raise ValidationError(
                f"env factory {self.envsync_make_env!r} returned {type(env).__name__}, not a torchrl EnvBase"
            )
        return _finish_env(env, self.envsync_spec, self.envsync_initial_config)


def wrap_env_fn(sender: EnvStateSender, fn: Callable[..., EnvBase] | EnvBase) -> Any:
    """Implementation of :meth:`EnvStateSender.env_fn`."""
    from envsync.probe import Probe

    initial = sender.template.values.clone()
    if isinstance(fn, EnvBase):
        env = _finish_env(fn, sender.spec, initial)
        sender._remember_env(Probe(make=lambda: env, owned=False))
        return env
    if not callable(fn):
        raise ValidationError(f"env_fn expects an env factory or an EnvBase, got {type(fn).__name__}")
    factory = EnvFactory(fn, sender.spec, initial)
    sender._remember_env(Probe(make=factory, owned=True))
    return factory


def find_transform(env: EnvBase) -> EnvSyncTransform:
    """The :class:`EnvSyncTransform` of a collector's env (the outermost one if several)."""
    wrapped: Any = env
    while wrapped is not None:
        for transform in reinit.flatten(getattr(wrapped, "transform", None)):
            if isinstance(transform, EnvSyncTransform):
                return transform
        wrapped = getattr(wrapped, "base_env", None)
    raise ValidationError(
        "the collector's env has no envsync transform: build the collector with "
        f"create_env_fn=sender.env_fn(make_env); its env is {type(env).__name__}"
    )


@contextmanager
def _busy(receiver_ref: weakref.ReferenceType[EnvStateReceiver]) -> Iterator[None]:
    receiver = receiver_ref()
    if receiver is None:
        yield
        return
    with receiver.busy():
        yield


def _mark_busy(collector: Any, receiver: EnvStateReceiver) -> None:
    """Wrap this collector instance's ``rollout`` and ``reset`` so the receiver knows when the
    collector drives the env. Holds the collector by weakref (no reference cycle)."""
    collector_ref = weakref.ref(collector)
    receiver_ref = weakref.ref(receiver)
    cls = type(collector)

    def rollout() -> Any:
        with _busy(receiver_ref):
            return cls.rollout(collector_ref())

    def reset(index: Any = None, **kwargs: Any) -> None:
        with _busy(receiver_ref):
            cls.reset(collector_ref(), index, **kwargs)

    collector.rollout = rollout
    collector.reset = reset


def bind_receiver(collector: Any, handle: SharedMemoryHandle, worker: int) -> EnvStateReceiver:
    """Bind a receiver to ``collector``'s env as worker ``worker`` and catch up."""
    transform = find_transform(collector.env)
    collector_ref = weakref.ref(collector)

    def reset_env() -> None:
        target = collector_ref()
        if target is not None:
            target.reset()

    steps = reinit.plan(collector.env, transform.spec.reinit)
    receiver = EnvStateReceiver(
        end=handle.open(worker),
        spec=transform.spec,
        collector=collector,
        reset_env=reset_env,
        after_apply=[reinit.runner(steps)],
    )
    previous = transform.receiver
    if previous is not None:
        previous.close()
    _mark_busy(collector, receiver)
    transform.receiver = receiver
    receiver.start(transform.initial_config)
    return receiver


class EnvSyncScheme(WeightSyncScheme):
    """The ``"env"`` weight-sync scheme: attaches an :class:`~envsync.EnvStateSender` to a
    collector and binds a receiver in each worker.

    Args:
        sender: the sender to attach (kept in the main process only).
    """

    def __init__(self, sender: EnvStateSender) -> None:
        super().__init__()
        self._sender: EnvStateSender | None = sender
        self._handle: SharedMemoryHandle | None = None
        self._owner_pid = os.getpid()
        self._receiver: EnvStateReceiver | None = None

    @property
    def initialized_on_sender(self) -> bool:
        # Under fork the worker inherits the main process's copy: it is no sender there.
        return bool(getattr(self, "_initialized_on_sender", False)) and os.getpid() == self._owner_pid

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_sender"] = None
        state["_receiver"] = None
        return state

    def _init_on_sender_impl(self, *, model_id: str, context: Any = None, ctx: Any = None, **kwargs: Any) -> None:
        if self._sender is None:
            raise ValidationError("this envsync scheme was not made by sender.schemes()")
        self.model_id = model_id
        self.context = context
        collector_ref = weakref.ref(context)
        if isinstance(context, Collector):
            self._sender._attach(lambda payload: self._attach_in_process(context, payload))
            return
        num_workers = context.num_workers
        semaphores = [ctx.Semaphore(0) for _ in range(num_workers)]

        def alive(worker: int) -> bool:
            collector = collector_ref()
            procs = getattr(collector, "procs", [])
            return worker >= len(procs) or procs[worker].is_alive()

        def make(payload: TensorDict) -> Attachment:
            from envsync.sender import Attachment

            channel = SharedMemoryChannel(payload, num_workers, semaphores=semaphores)
            self._handle = channel.handle()
            return Attachment(channel=channel, alive=alive, detached=lambda: _detached(collector_ref))

        self._sender._attach(make)

    def _attach_in_process(self, collector: Collector, payload: TensorDict) -> Attachment:
        from envsync.sender import Attachment

        channel = SharedMemoryChannel(payload, 1, semaphores=[threading.Semaphore(0)])
        collector_ref = weakref.ref(collector)
        self._receiver = receiver = bind_receiver(collector, channel.handle(), 0)
        return Attachment(
            channel=channel,
            alive=lambda worker: True,
            detached=lambda: _detached(collector_ref),
            on_close=receiver.close,
        )

    def _init_on_receiver_impl(
        self, *, model_id: str, context: Any = None, worker_idx: int | None = None, **kwargs: Any
    ) -> None:
        if self._handle is None or worker_idx is None:
            raise ValidationError("envsync scheme reached a worker without a channel or worker index")
        self.model_id = model_id
        self.context = context
        self._receiver = bind_receiver(context, self._handle, worker_idx)

    def create_transport(self, **kwargs: Any) -> Any:
        raise ValidationError("envsync moves env state through its own transport, not torchrl's")

    def connect(self, *, worker_idx: int | None = None, weights: Any | None = None) -> None:
        if self.initialized_on_sender:
            self.synchronized_on_sender = True
        else:
            self.synchronized_on_receiver = True

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> None:
        """Route ``update_policy_weights_(weights=..., model_id="env")`` to a push."""
        if self._sender is None:
            raise ValidationError("this envsync scheme has no sender in this process")
        if weights is None:
            raise ValidationError("update_policy_weights_(model_id='env') needs weights=TensorDict(config=...)")
        if not isinstance(weights, TensorDictBase | dict):
            raise ValidationError(f"env weights must be a TensorDict or dict, got {type(weights).__name__}")
        unknown = set(weights.keys()) - {"config", "env_state"}
        if unknown:
            raise ValidationError(f"env weights take the keys 'config' and 'env_state', got {sorted(unknown)}")
        workers = [worker_ids] if isinstance(worker_ids, int) else worker_ids
        self._sender.push(
            config=weights.get("config", None),
            env_state=weights.get("env_state", None),
            workers=workers,
            wait="received",
        )

    def shutdown(self) -> None:
        if self._receiver is not None:
            self._receiver.close()


def _detached(collector_ref: weakref.ReferenceType[Any]) -> bool:
    collector = collector_ref()
    return collector is None or bool(getattr(collector, "closed", False))


class PolicySyncScheme(SharedMemWeightSyncScheme):
    """torchrl's shared-memory policy sync, inert when there is no ``nn.Module`` policy.

    A multi-process collector with an ``nn.Module`` policy needs a ``"policy"`` scheme once
    any scheme is given (its workers receive the policy on the meta device). With
    ``policy=None`` or a plain callable, or on a single-process ``Collector``, the stock scheme
    fails; this one then does nothing, or falls back to the collector's local update.
    """

    _active = True

    def _init_on_sender_impl(self, *, model_id: str, context: Any = None, **kwargs: Any) -> None:
        policy = getattr(context, "policy", None)
        self._active = not isinstance(context, Collector) and isinstance(policy, nn.Module)
        if self._active:
            super()._init_on_sender_impl(model_id=model_id, context=context, **kwargs)
            return
        self.model_id = model_id
        self.context = context

    def _init_on_receiver_impl(self, *, model_id: str, context: Any = None, **kwargs: Any) -> None:
        if self._active:
            super()._init_on_receiver_impl(model_id=model_id, context=context, **kwargs)
            return
        self.model_id = model_id
        self.context = context
        model = kwargs.get("model")
        if model is not None:
            self.model = model

    @property
    def model(self) -> Any | None:
        if self._active:
            return WeightSyncScheme.model.fget(self)
        return self._model_ref() if self._model_ref is not None else None

    @model.setter
    def model(self, model: Any) -> None:
        self._model_ref = weakref.ref(model) if model is not None else None

    def connect(self, *, worker_idx: int | None = None, weights: Any | None = None) -> None:
        if self._active:
            super().connect(worker_idx=worker_idx, weights=weights)
        elif self.initialized_on_sender:
            self.synchronized_on_sender = True
        else:
            self.synchronized_on_receiver = True

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> None:
        if self._active:
            super().send(weights=weights, worker_ids=worker_ids)
            return
        context = self.context
        if isinstance(context, Collector):
            context._maybe_fallback_update(weights, model_id="policy")

    def shutdown(self) -> None:
        if self._active:
            super().shutdown()


def make_schemes(sender: EnvStateSender, policy_scheme: WeightSyncScheme | None = None) -> dict[str, WeightSyncScheme]:
    """Implementation of :meth:`EnvStateSender.schemes`."""
    return {"env": EnvSyncScheme(sender), "policy": policy_scheme or PolicySyncScheme()}
