"""Attaching a sender to a torchrl ``RayCollector`` (imported only by ``sender.ray_kwargs``).

Two schemes, one per level of the hierarchy:

* :class:`RayEnvScheme` is the driver's ``"env"`` scheme. ``RayCollector`` calls its
  ``init_on_sender`` after the remote collectors exist: it attaches one
  :class:`~envsync.links.ray.RayLink` over every remote worker to the sender (fleet:
  collector by collector, then worker), which listens for the relays' connections (and
  starts the mailbox actor when a node runs several remote collectors). ``RayCollector``
  then pickles the scheme into each actor, whose ``init_on_receiver`` starts that
  collector's :class:`~envsync.links.ray_relay.Relay`; it connects to the main process.
* :class:`NodeScheme` goes into ``collector_kwargs["weight_sync_schemes"]["env"]``: the
  collector inside each actor calls its ``init_on_sender`` and builds the node's own link
  (shared memory to its worker processes, or in process for a ``Collector``); its workers
  bind receivers through it, as on one machine.

:class:`RayPolicyScheme` keeps torchrl's Ray policy sync and does nothing without an
``nn.Module`` policy (torchrl's default scheme crashes on ``policy=None``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import ray
from torch import nn
from torchrl.collectors import Collector
from torchrl.weight_update import RayWeightSyncScheme, WeightSyncScheme

from envsync.errors import ValidationError
from envsync.integrations.torchrl.scheme import (
    EnvSchemeBase,
    InertWithoutModule,
    PolicySyncScheme,
    bind,
    env_weights,
    in_process_link,
    worker_link,
)
from envsync.links.base import Flat, LinkHandle, SenderLink
from envsync.links.mailbox import start_mailbox
from envsync.links.ray import RayLink
from envsync.links.ray_relay import Relay, RelayHandle
from envsync.links.ray_wire import Traffic
from envsync.links.shared_memory import sweep_until_gone
from envsync.links.slots import SlotWriter
from envsync.sender.fleet import Attachment

if TYPE_CHECKING:
    from envsync.sender.sender import Sender


class NodeScheme(EnvSchemeBase):
    """The ``"env"`` scheme of the collector inside each Ray actor: builds the node's link.

    Args:
        leaves: the starting leaves (the sender's desired state when ``ray_kwargs`` ran).
        version: the sender's version then.
        offset: the fleet index of the first remote worker.
        start_method: if given, the actor's multiprocessing start method (set when the
            scheme is unpickled in the actor, before its collector starts workers).
        rows: each remote env's own leaves on top of ``leaves`` (a loaded per-env
            checkpoint's, in fleet order from ``offset``): the envs start from them, before
            the relay runs.
        envs: how many envs each remote worker drives (a batched env's sub-envs).
        group: how many of a worker's envs are rows of one natively batched env (they share
            a slot lock and a wake-up on the node's link).
    """

    def __init__(
        self,
        leaves: Flat,
        version: int,
        offset: int,
        start_method: str | None = None,
        *,
        rows: list[Flat] | None = None,
        envs: int = 1,
        group: int = 1,
    ) -> None:
        super().__init__()
        self._leaves = leaves
        self._rows = rows
        self._envs = envs
        self._group = group
        self._version = version
        self._offset = offset
        self._start_method = start_method
        self._handle: LinkHandle | None = None
        self._first = offset
        self.link: SlotWriter | None = None
        self._receiver: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["link"] = None
        state["_receiver"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        method = self._start_method
        if method is not None and self._handle is None and mp.get_start_method(allow_none=True) != method:
            mp.set_start_method(method, force=True)

    def _init_on_sender_impl(self, *, model_id: str, context: Any = None, ctx: Any = None, **kwargs: Any) -> None:
        self.model_id = model_id
        self.context = context
        self._owner_pid = os.getpid()
        first = self._offset + int(context.worker_idx or 0) * _count_workers(context) * self._envs
        if isinstance(context, Collector):
            link: Any = in_process_link(context, self._leaves)
            self._write_version(link, first)
            self._receiver = bind(context, link.handle(), 0, first, self._envs)
        else:
            link = worker_link(context, self._leaves, self._envs, self._group)
            self._write_version(link, first)
            self._handle = link.handle()
        self.link = link
        self._first = first

    def _write_version(self, link: SenderLink, first: int) -> None:
        """Give each env its version and its own row (if any) before it starts: the relay
        later writes the same at the same version, which a started env would not notice."""
        rows = self._rows or []
        for slot in range(link.num_workers):
            index = first - self._offset + slot
            link.write(slot, self._version, rows[index] if index < len(rows) else {})

    def _init_on_receiver_impl(
        self, *, model_id: str, context: Any = None, worker_idx: int | None = None, **kwargs: Any
    ) -> None:
        if self._handle is None or worker_idx is None:
            raise ValidationError("envsync node scheme reached a worker without a link or worker index")
        self.model_id = model_id
        self.context = context
        slot = worker_idx * self._envs
        self._receiver = bind(context, self._handle, slot, self._first + slot, self._envs)

    def shutdown(self) -> None:
        if self._receiver is not None:
            self._receiver.close()


class RayEnvScheme(EnvSchemeBase):
    """The driver's ``"env"`` scheme for a ``RayCollector`` (see the module docstring).

    Args:
        sender: the sender to attach (kept in the main process only).
        offset: the fleet index the remote workers were numbered from by ``ray_kwargs``.
    """

    def __init__(self, sender: Sender, offset: int, envs: int = 1) -> None:
        super().__init__()
        self._sender: Sender | None = sender
        self._offset = offset
        self._envs = envs
        self._handle: RelayHandle | None = None
        self._attachment: Attachment | None = None
        self._relay: Relay | None = None
        self._counts: list[int] = []
        self._files: list[str] = []

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_sender"] = None
        state["_attachment"] = None
        state["_relay"] = None
        return state

    @property
    def link(self) -> RayLink | None:
        """The driver's link (``None`` outside the main process or before attaching)."""
        return self._attachment.link if self._attachment is not None else None  # type: ignore[return-value]

    def _init_on_sender_impl(
        self, *, model_id: str, context: Any = None, remote_collectors: Any = None, **kwargs: Any
    ) -> None:
        sender = self._sender
        if sender is None:
            raise ValidationError("this envsync scheme was not made by sender.ray_kwargs()")
        self.model_id = model_id
        self.context = context
        self._owner_pid = os.getpid()
        actors = list(remote_collectors if remote_collectors is not None else context.remote_collectors)
        nodes = ray.get([actor.__ray_call__.remote(_node_info) for actor in actors])
        self._counts = counts = [count for count, _, _ in nodes]
        self._files = [path for _, path, _ in nodes if path]
        node_ids = [node for _, _, node in nodes]
        # only the relays of a node with several remote collectors take shares from a mailbox
        mailbox = start_mailbox() if len(set(node_ids)) < len(node_ids) else None
        collector_ref = weakref.ref(context)
        made: list[RayLink] = []

        def make(leaves: Flat) -> SenderLink:  # one slot per remote env
            made.append(RayLink(leaves, [c * self._envs for c in counts], mailbox, actors, node_ids))
            return made[-1]

        try:
            # the remote workers tag their frames with the indices ray_kwargs() gave them
            attachment = sender.port.attach(
                sum(counts),
                make,
                detached=lambda: _ray_detached(collector_ref),
                collectors=counts,
                envs_per_worker=self._envs,
                first_env=self._offset,
            )
        except BaseException as err:
            for made_link in made:
                made_link.close()
            if mailbox is not None:
                ray.kill(mailbox)
            for actor in actors:
                ray.kill(actor)
            if isinstance(err, ValidationError) and sender.port.next_env_index() > self._offset:
                raise ValidationError(f"{err}; call ray_kwargs() right before building the RayCollector") from err
            raise
        link: Any = attachment.link
        link.flush(sender.version)  # every worker's starting state, sent to each relay as it connects
        self._attachment = attachment
        self._handle = attachment.link.handle()  # type: ignore[assignment]

    def _init_on_receiver_impl(
        self, *, model_id: str, context: Any = None, worker_idx: int | None = None, **kwargs: Any
    ) -> None:
        node = getattr(context, "_weight_sync_schemes", None) or {}
        inner = node.get("env")
        if self._handle is None or worker_idx is None or not isinstance(inner, NodeScheme) or inner.link is None:
            raise ValidationError(
                "the remote collector has no envsync node scheme: pass **sender.ray_kwargs() to RayCollector"
            )
        self.model_id = model_id
        self.context = context
        self._relay = self._handle.relay(worker_idx, inner.link)
        self._relay.start()

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> None:
        """Route ``update_policy_weights_(weights=..., model_id="env")`` to a push;
        ``worker_ids`` are remote collector indices."""
        sender = self._sender
        if sender is None:
            raise ValidationError("this envsync scheme has no sender in this process")
        config, env_state = env_weights(weights)
        workers = None
        if worker_ids is not None:
            if self._attachment is None:
                raise ValidationError("worker_ids= needs the RayCollector attached; it was shut down")
            chosen = [worker_ids] if isinstance(worker_ids, int) else worker_ids
            first = self._attachment.worker_offset
            starts = [first + sum(self._counts[:c]) for c in range(len(self._counts))]
            workers = [starts[c] + w for c in chosen for w in range(self._counts[c])]
        sender.push(config=config, env_state=env_state, workers=workers)

    def shutdown(self) -> None:
        if self._relay is not None:
            self._relay.stop()
        if self._attachment is not None and self._sender is not None:
            self._sender.port.detach(self._attachment)
            self._attachment = None
            # torchrl has just killed the actors (ray.kill returns at once), so nothing in
            # them cleaned up: sweep their files here once their processes let go
            sweep_until_gone(self._files, timeout=5.0)


class RayPolicyScheme(InertWithoutModule, RayWeightSyncScheme):
    """torchrl's Ray policy sync, inert when the ``RayCollector`` has no ``nn.Module`` policy."""

    def _activate(self, context: Any, kwargs: dict[str, Any]) -> bool:
        return isinstance(kwargs.get("model"), nn.Module)


def _count_workers(collector: Any) -> int:
    """How many envsync workers a collector has."""
    return 1 if isinstance(collector, Collector) else int(collector.num_workers)


def _node_info(collector: Any) -> tuple[int, str, str]:
    """A remote collector's worker count, its link's file (if any) and its Ray node (run
    inside each actor by ``__ray_call__``)."""
    node = getattr(collector, "_weight_sync_schemes", None) or {}
    link = getattr(node.get("env"), "link", None)
    return _count_workers(collector), str(getattr(link, "path", "")), ray.get_runtime_context().get_node_id()


def relay_traffic(collector: Any) -> tuple[str, Traffic]:
    """The Ray node of a remote collector and what its relay fetched and decoded so far
    (run inside its actor: ``ray.get(actor.__ray_call__.remote(relay_traffic))``; read by
    tests and ``bench_ray.py``).

    Examples:
        >>> relay_traffic.__name__
        'relay_traffic'
    """
    scheme = getattr(collector, "_receiver_schemes", {}).get("env")
    relay = getattr(scheme, "_relay", None)
    if relay is None:
        raise ValidationError("this collector has no envsync relay: was it built with **sender.ray_kwargs()?")
    return ray.get_runtime_context().get_node_id(), relay.traffic


def _ray_detached(collector_ref: weakref.ReferenceType[Any]) -> bool:
    collector = collector_ref()
    return collector is None or not getattr(collector, "_remote_collectors", None)


def make_ray_kwargs(
    sender: Sender,
    collector_kwargs: Mapping[str, Any] | None = None,
    policy_scheme: WeightSyncScheme | None = None,
    start_method: str | None = None,
) -> dict[str, Any]:
    """Implementation of :meth:`envsync.EnvStateSender.ray_kwargs`."""
    kwargs = dict(collector_kwargs or {})
    inner = dict(kwargs.get("weight_sync_schemes") or {})
    if "env" in inner:
        raise ValidationError("collector_kwargs['weight_sync_schemes'] already has an 'env' scheme")
    envs = sender.port.envs_per_worker()
    offset = sender.port.next_env_index()  # the RayCollector attaches there (RayEnvScheme)
    leaves, rows = sender.port.start_state()
    inner["env"] = NodeScheme(
        leaves, sender.version, offset, start_method, rows=rows, envs=envs, group=sender.port.rows_per_worker()
    )
    inner.setdefault("policy", PolicySyncScheme())
    kwargs["weight_sync_schemes"] = inner
    schemes: dict[str, WeightSyncScheme] = {
        "env": RayEnvScheme(sender, offset, envs),
        "policy": policy_scheme or RayPolicyScheme(),
    }
    return {"weight_sync_schemes": schemes, "collector_kwargs": kwargs}
