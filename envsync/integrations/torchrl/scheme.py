"""The weight-sync schemes that attach a sender to a torchrl collector.

:class:`EnvSyncScheme` goes under the key ``"env"`` of ``weight_sync_schemes``: torchrl
calls ``init_on_sender`` in the main process (we attach the collector to the sender, which
builds a shared-memory link), pickles the scheme into each worker, and calls
``init_on_receiver`` there (we bind a receiver to the worker's inner collector). A
single-process ``Collector`` gets an in-process link and its receiver at once.
``collector.update_policy_weights_(weights=..., model_id="env")`` reaches
:meth:`EnvSyncScheme.send` around torchrl's policy-version count
(:mod:`.routing`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import weakref
from typing import TYPE_CHECKING, Any

from tensordict import TensorDictBase
from torch import nn
from torchrl.collectors import Collector
from torchrl.envs import ParallelEnv
from torchrl.weight_update import SharedMemWeightSyncScheme, WeightSyncScheme

from envsync.errors import ValidationError
from envsync.integrations.torchrl.adapter import bind_env
from envsync.integrations.torchrl.batched import BatchedHooks
from envsync.integrations.torchrl.group import bind_batched
from envsync.integrations.torchrl.native import NativeHooks
from envsync.integrations.torchrl.routing import route_env_pushes
from envsync.links.base import Flat, LinkHandle
from envsync.links.local import LocalLink
from envsync.links.shared_memory import SharedMemoryLink

if TYPE_CHECKING:
    from envsync.sender.sender import Sender


def _detached(collector_ref: weakref.ReferenceType[Any]) -> bool:
    collector = collector_ref()
    return collector is None or bool(getattr(collector, "closed", False))


def _worker_alive(collector_ref: weakref.ReferenceType[Any], worker: int) -> bool:
    collector = collector_ref()
    procs = getattr(collector, "procs", None) or []
    return worker >= len(procs) or procs[worker].is_alive()


def worker_link(collector: Any, leaves: Flat, envs_per_worker: int = 1, rows: int = 1) -> SharedMemoryLink:
    """The shared-memory link to a multi-process collector's workers, one slot per env
    (named semaphores, so a ``ParallelEnv``'s sub-processes can open it later; liveness
    from the workers' processes, by weakref); ``rows``: the envs of a worker are rows of one
    natively batched env, sharing one lock and one wake-up."""
    collector_ref = weakref.ref(collector)
    return SharedMemoryLink(
        leaves,
        collector.num_workers * envs_per_worker,
        ctx=mp.get_context("spawn"),
        alive=lambda slot: _worker_alive(collector_ref, slot // envs_per_worker),
        group=rows,
    )


def in_process_link(collector: Collector, leaves: Flat) -> LocalLink | SharedMemoryLink:
    """The link to a single-process collector's env, one slot per env: in process, or shared
    memory when the env is a ``ParallelEnv`` (its sub-processes open the link too)."""
    found = BatchedHooks.of(collector.env)
    if found is None:
        return LocalLink(leaves, 1)
    if isinstance(found[0], ParallelEnv):
        return SharedMemoryLink(leaves, found[1].num_envs, ctx=mp.get_context("spawn"))
    rows = found[1].num_envs if isinstance(found[1], NativeHooks) else 1  # one lock and wake-up for a native env's rows
    return LocalLink(leaves, found[1].num_envs, group=rows)


def bind(collector: Any, handle: LinkHandle, slot: int, env_index: int, envs: int = 1) -> Any:
    """Bind ``collector``'s env to link ``slot`` as fleet env ``env_index`` (a batched env's
    ``envs`` sub-envs to the slots from there), and catch up. Returns the receiver, or a
    batched env's :class:`~.group.EnvGroup`.

    Raises:
        ValidationError: the env was not built by an envsync factory, or holds another
            number of envs than the sender expects per worker.
    """
    if BatchedHooks.of(collector.env) is not None:
        return bind_batched(collector, handle, slot, env_index, envs)
    if envs != 1:
        raise ValidationError(f"this worker's env is not batched; the sender expects {envs} envs per worker")
    return bind_env(collector, handle, slot, env_index)


def env_weights(weights: Any) -> tuple[Any, Any]:
    """``(config, env_state)`` of ``update_policy_weights_(weights=..., model_id="env")``.

    Raises:
        ValidationError: no weights, not a mapping, or keys other than those two.
    """
    if weights is None:
        raise ValidationError("update_policy_weights_(model_id='env') needs weights=TensorDict(config=...)")
    if not isinstance(weights, TensorDictBase | dict):
        raise ValidationError(f"env weights must be a TensorDict or dict, got {type(weights).__name__}")
    unknown = set(weights.keys()) - {"config", "env_state"}
    if unknown:
        raise ValidationError(f"env weights take the keys 'config' and 'env_state', got {sorted(unknown)}")
    return weights.get("config", None), weights.get("env_state", None)


class EnvSchemeBase(WeightSyncScheme):
    """What envsync's ``"env"`` schemes share: flags keyed on the process (a forked child
    inherits the parent's copy: it is no sender there), no torchrl transport, and nothing to
    receive from a policy push (env state comes through envsync's links)."""

    _owner_pid = 0

    @property
    def initialized_on_sender(self) -> bool:
        return bool(getattr(self, "_initialized_on_sender", False)) and os.getpid() == self._owner_pid

    def create_transport(self, **kwargs: Any) -> Any:
        raise ValidationError("envsync moves env state through its own link, not torchrl's transports")

    def connect(self, *, worker_idx: int | None = None, weights: Any | None = None) -> None:
        if self.initialized_on_sender:
            self.synchronized_on_sender = True
        else:
            self.synchronized_on_receiver = True

    def receive(self, *args: Any, **kwargs: Any) -> None:
        return None


class EnvSyncScheme(EnvSchemeBase):
    """The ``"env"`` weight-sync scheme: attaches a sender to a collector and binds a
    receiver in each worker.

    Args:
        sender: the sender to attach (kept in the main process only).
    """

    def __init__(self, sender: Sender) -> None:
        super().__init__()
        self._sender: Sender | None = sender
        self._handle: LinkHandle | None = None
        self._offset = 0
        self._envs = 1
        self._owner_pid = os.getpid()
        self._receiver: Any = None  # the receiver, or a batched env's EnvGroup

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
        route_env_pushes(context, self.send, model_id)  # an env push moves no policy version
        collector_ref = weakref.ref(context)
        if isinstance(context, Collector):
            self._attach_in_process(self._sender, context)
            return

        envs = self._envs = self._sender.port.envs_per_worker()
        rows = self._sender.port.rows_per_worker()

        def make(leaves: Flat) -> SharedMemoryLink:
            link = worker_link(context, leaves, envs, rows)
            self._handle = link.handle()
            return link

        scheme_ref = weakref.ref(self)

        def forget() -> None:  # the collector may outlive the sender: let go of the semaphores
            scheme = scheme_ref()
            if scheme is not None:
                scheme.forget_link()

        attachment = self._sender.port.attach(
            context.num_workers, make, detached=lambda: _detached(collector_ref), on_close=forget, envs_per_worker=envs
        )
        self._offset = attachment.offset

    def _attach_in_process(self, sender: Sender, collector: Collector) -> None:
        collector_ref = weakref.ref(collector)
        found = BatchedHooks.of(collector.env)
        envs = 1 if found is None else found[1].num_envs
        attachment = sender.port.attach(
            1,
            lambda leaves: in_process_link(collector, leaves),
            detached=lambda: _detached(collector_ref),
            envs_per_worker=envs,
        )
        try:
            self._receiver = receiver = bind(collector, attachment.link.handle(), 0, attachment.offset, envs)
        except BaseException:
            sender.port.detach(attachment)
            raise
        attachment.on_close = receiver.close

    def forget_link(self) -> None:
        """Let go of the link's handle (and so of its semaphores) once the sender releases it."""
        self._handle = None

    def _init_on_receiver_impl(
        self, *, model_id: str, context: Any = None, worker_idx: int | None = None, **kwargs: Any
    ) -> None:
        if self._handle is None or worker_idx is None:
            raise ValidationError("envsync scheme reached a worker without a link or worker index")
        self.model_id = model_id
        self.context = context
        first = worker_idx * self._envs
        self._receiver = bind(context, self._handle, first, self._offset + first, self._envs)

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> None:
        """Route ``update_policy_weights_(weights=..., model_id="env")`` to a push."""
        if self._sender is None:
            raise ValidationError("this envsync scheme has no sender in this process")
        config, env_state = env_weights(weights)
        workers = [worker_ids] if isinstance(worker_ids, int) else worker_ids
        envs = None
        if workers is not None:
            envs = [self._offset + w * self._envs + e for w in workers for e in range(self._envs)]
        self._sender.push(config=config, env_state=env_state, envs=envs, wait="received")

    def shutdown(self) -> None:
        if self._receiver is not None:
            self._receiver.close()


class InertWithoutModule(WeightSyncScheme):
    """Mixed in before a torchrl weight-sync scheme: the scheme works as usual when there is
    an ``nn.Module`` policy to sync (:meth:`_activate`, decided on the sender side), and does
    nothing otherwise (torchrl's stock schemes fail without one)."""

    _active = True

    def _activate(self, context: Any, kwargs: dict[str, Any]) -> bool:
        """Whether there is an ``nn.Module`` policy to sync."""
        return isinstance(kwargs.get("model", getattr(context, "policy", None)), nn.Module)

    def _init_on_sender_impl(self, *, model_id: str, context: Any = None, **kwargs: Any) -> None:
        self._active = self._activate(context, kwargs)
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

    def receive(self, *args: Any, **kwargs: Any) -> Any:
        return super().receive(*args, **kwargs) if self._active else None

    def shutdown(self) -> None:
        if self._active:
            super().shutdown()


class PolicySyncScheme(InertWithoutModule, SharedMemWeightSyncScheme):
    """torchrl's shared-memory policy sync, inert when there is no ``nn.Module`` policy.

    A multi-process collector with an ``nn.Module`` policy needs a ``"policy"`` scheme once
    any scheme is given (its workers receive the policy on the meta device). With
    ``policy=None`` or a plain callable, or on a single-process ``Collector``, the stock scheme
    fails; this one then does nothing, or falls back to the collector's local update.
    """

    def _activate(self, context: Any, kwargs: dict[str, Any]) -> bool:
        return not isinstance(context, Collector) and isinstance(getattr(context, "policy", None), nn.Module)


def make_schemes(sender: Sender, policy_scheme: WeightSyncScheme | None = None) -> dict[str, WeightSyncScheme]:
    """Implementation of :meth:`envsync.EnvStateSender.schemes`."""
    return {"env": EnvSyncScheme(sender), "policy": policy_scheme or PolicySyncScheme()}
