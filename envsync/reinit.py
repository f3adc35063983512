"""Re-initialisation policies for stateful transforms, run after every applied version.

Select transforms by class, class name, or index in the env's transform chain (nested
``Compose`` included; envsync's own transform is not counted), and give each a policy::

    EnvStateSender(..., reinit={
        "ObservationNorm": reinit.recompute(num_iter=64),   # by class name
        VecNorm: reinit.reset(),                            # by class
        2: reinit.call("reset_state"),                      # by index
    })

Every transform not selected keeps its state (:func:`keep`). A policy runs exactly once per
applied version per worker, after the config method and the env state, in transform order.
Teach envsync a new stateful transform with :func:`register`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from envsync import stats
from envsync.configure import env_state_dict
from envsync.errors import ValidationError

Selector = type | str | int


class Handler(Protocol):
    """How envsync resets or recomputes one kind of transform. Either method may be absent."""

    def reset(self, transform: Any) -> None:
        """Put the transform's running statistics back to their initial values, in place."""

    def recompute(self, transform: Any, num_iter: int) -> None:
        """Gather fresh statistics on ``transform.parent`` (the env below it), in place."""


@dataclass(frozen=True)
class Policy:
    """What happens to a transform's state when a version is applied.

    Build one with :func:`keep`, :func:`reset`, :func:`recompute` or :func:`call`.

    Examples:
        >>> recompute(num_iter=32, where="main").moves_env
        False
        >>> recompute(num_iter=32).moves_env
        True
    """

    kind: Literal["keep", "reset", "recompute", "call"]
    num_iter: int = 0
    where: Literal["worker", "main"] = "worker"
    method: str = ""
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def moves_env(self) -> bool:
        """Whether running it steps the worker's env (so a fresh episode must follow)."""
        return self.kind == "recompute" and self.where == "worker"


def keep() -> Policy:
    """Leave the transform's state as it is (the default for every transform)."""
    return Policy("keep")


def reset() -> Policy:
    """Put running statistics back to their initial values."""
    return Policy("reset")


def recompute(num_iter: int = 64, where: Literal["worker", "main"] = "worker") -> Policy:
    """Gather fresh statistics under the new config.

    Args:
        num_iter: env steps of random actions to gather them from.
        where: ``"worker"``: on each worker's env (each worker gets its own statistics; the
            env then starts a fresh episode); ``"main"``: once in the main process on a probe
            env with the new config, sent to every worker as env state (identical statistics).

    Examples:
        >>> recompute(16).num_iter
        16
    """
    if not isinstance(num_iter, int) or num_iter < 2:
        raise ValidationError(f"recompute(num_iter={num_iter!r}): num_iter must be an int >= 2")
    if where not in ("worker", "main"):
        raise ValidationError(f"recompute(where={where!r}): expected 'worker' or 'main'")
    return Policy("recompute", num_iter=num_iter, where=where)


def call(method: str, *args: Any, **kwargs: Any) -> Policy:
    """Call ``method(*args, **kwargs)`` on the selected transform(s).

    Examples:
        >>> call("reset_state").method
        'reset_state'
    """
    if not isinstance(method, str) or not method:
        raise ValidationError(f"call(method={method!r}): method must be a method name")
    return Policy("call", method=method, args=args, kwargs=dict(kwargs))


_REGISTRY: dict[type, Any] = {}
"""Transform class -> handler; ``envsync.integrations.torchrl.handlers`` fills in torchrl's."""


def register(cls: type, handler: Any) -> None:
    """Teach envsync how to ``reset`` and/or ``recompute`` a transform class.

    Register before building the sender: the handlers travel to the workers with it.

    Args:
        cls: the transform class (subclasses match too).
        handler: an object with a ``reset(transform)`` and/or a
            ``recompute(transform, num_iter)`` method.

    Examples:
        >>> class Counter:  # a torchrl Transform, say
        ...     pass
        >>> class CounterHandler:
        ...     def reset(self, transform):
        ...         transform.count = 0
        >>> register(Counter, CounterHandler())
    """
    if not isinstance(cls, type):
        raise ValidationError(f"register() takes a transform class, got {cls!r}")
    if not (callable(getattr(handler, "reset", None)) or callable(getattr(handler, "recompute", None))):
        raise ValidationError(f"handler {handler!r} has neither a reset nor a recompute method")
    _REGISTRY[cls] = handler


@dataclass(frozen=True)
class ReinitSpec:
    """The validated ``reinit=`` of a sender, with the handlers it needs (picklable)."""

    rules: tuple[tuple[Selector, Policy], ...] = ()
    handlers: Mapping[type, Any] = field(default_factory=dict)

    @classmethod
    def from_mapping(cls, reinit: Mapping[Selector, Policy] | None) -> ReinitSpec:
        """Check the selectors and policies; snapshot the registered handlers."""
        rules = []
        for selector, policy in (reinit or {}).items():
            if not isinstance(selector, type | str | int) or isinstance(selector, bool):
                raise ValidationError(f"reinit selector {selector!r} must be a class, a class name or an index")
            if not isinstance(policy, Policy):
                raise ValidationError(f"reinit[{selector!r}] must be a policy from envsync.reinit, got {policy!r}")
            rules.append((selector, policy))
        return cls(tuple(rules), dict(_REGISTRY))

    @property
    def moves_env(self) -> bool:
        return any(policy.moves_env for _, policy in self.rules)

    @functools.cached_property
    def computes_in_main(self) -> bool:  # read on every push's path
        return any(policy.kind == "recompute" and policy.where == "main" for _, policy in self.rules)


class Chain(Protocol):
    """An env seen as its transform chain, as an integration reads it from its env
    (``envsync.integrations.torchrl.chain.chain_of``): the transforms the selection rules
    count, in order (nested groups flattened, envsync's own left out), and where each keeps
    its entries in the env's ``state_dict()``.

    Examples:
        >>> from dataclasses import dataclass
        >>> @dataclass
        ... class Lone:  # an env with one transform, whose keys are the env's own
        ...     env: object
        ...     transforms: tuple
        ...     def prefixes(self):
        ...         return [""]
        >>> class Norm:
        ...     pass
        >>> [type(t).__name__ for t in Lone(None, (Norm(),)).transforms]
        ['Norm']
    """

    @property
    def env(self) -> Any:
        """The env (``None`` for no env: an empty chain)."""

    @property
    def transforms(self) -> Sequence[Any]:
        """Its transforms, in the order the selectors' indices count them."""

    def prefixes(self) -> Sequence[str]:
        """The ``state_dict()`` key prefix of each transform, in the same order (asked only
        where statistics are exported, so an integration may compute it lazily)."""


def _matches(selector: Selector, index: int, transform: Any) -> bool:
    if isinstance(selector, int):
        return selector == index
    if isinstance(selector, str):
        return any(c.__name__ == selector for c in type(transform).__mro__)
    return isinstance(transform, selector)


def _handler(spec: ReinitSpec, transform: Any) -> Any:
    for klass in type(transform).__mro__:
        if klass in spec.handlers:
            return spec.handlers[klass]
    return None


@dataclass
class Step:
    """One policy bound to one transform of one env."""

    transform: Any
    policy: Policy
    handler: Any

    def run(self) -> None:
        kind = self.policy.kind
        if kind == "reset":
            self.handler.reset(self.transform)
        elif kind == "recompute" and self.policy.where == "worker":
            self.handler.recompute(self.transform, self.policy.num_iter)
        elif kind == "call":
            getattr(self.transform, self.policy.method)(*self.policy.args, **self.policy.kwargs)


def plan(chain: Chain, spec: ReinitSpec) -> list[Step]:
    """Bind each rule to the chain's transforms, in transform order.

    Raises:
        ValidationError: a selector that matches nothing, or a policy a transform does not
            support; the message names the selector and the transforms that exist.

    Examples:
        >>> from types import SimpleNamespace
        >>> class Tally:
        ...     def clear(self):
        ...         print("cleared")
        >>> chain = SimpleNamespace(env=None, transforms=[Tally()], prefixes=lambda: [""])
        >>> [step.run() for step in plan(chain, ReinitSpec.from_mapping({"Tally": call("clear")}))]
        cleared
        [None]
    """
    transforms = list(chain.transforms)
    names = [f"{i}: {type(t).__name__}" for i, t in enumerate(transforms)]
    chosen: dict[int, tuple[Selector, Policy]] = {}
    for selector, policy in spec.rules:
        hits = [i for i, t in enumerate(transforms) if _matches(selector, i, t)]
        if not hits:
            raise ValidationError(f"reinit selector {selector!r} matches no transform; the env has {names}")
        for i in hits:
            chosen.setdefault(i, (selector, policy))
    steps = []
    for i in sorted(chosen):
        selector, policy = chosen[i]
        transform = transforms[i]
        handler = _handler(spec, transform)
        _check_supported(selector, policy, transform, handler)
        bind = getattr(handler, "bind", None)
        if callable(bind):
            handler = bind(transform)  # a handler that keeps per-transform state
        if policy.kind != "keep":
            steps.append(Step(transform, policy, handler))
    return steps


def _check_supported(selector: Selector, policy: Policy, transform: Any, handler: Any) -> None:
    name = type(transform).__name__
    if policy.kind == "call" and not callable(getattr(transform, policy.method, None)):
        raise ValidationError(f"reinit[{selector!r}]: {name} has no method {policy.method!r}")
    if policy.kind in ("reset", "recompute") and not callable(getattr(handler, policy.kind, None)):
        supported = sorted(k.__name__ for k, h in _REGISTRY.items() if callable(getattr(h, policy.kind, None)))
        raise ValidationError(
            f"reinit[{selector!r}]: {name} does not support {policy.kind}(); "
            f"supported: {supported}; teach it with envsync.reinit.register"
        )


def compute_in_main(chain: Chain, spec: ReinitSpec) -> dict[str, torch.Tensor]:
    """Run the ``where="main"`` recomputes on a probe env's chain; return their state_dict entries."""
    transforms = list(chain.transforms)
    keys = []
    for step in plan(chain, spec):
        if step.policy.kind == "recompute" and step.policy.where == "main":
            step.handler.recompute(step.transform, step.policy.num_iter)
            keys.append(transforms.index(step.transform))
    state = env_state_dict(chain.env)
    prefixes = chain.prefixes()
    return {k: v.detach().clone() for k, v in state.items() if any(k.startswith(prefixes[i]) for i in keys)}


STATS = "stats"
"""The env-state namespace of a *derived* view of running statistics:
``stats.<transform index>.<name>``, the moments (count, mean, m2) a handler's ``export`` gives,
by the transform's index in its :class:`Chain`. They are not ``state_dict`` entries (those keep
the framework's keys: ``_extra_state.*`` for torchrl's ``VecNormV2``); ``sync_stats`` merges
through them."""


def _stats_handlers(chain: Chain, spec: ReinitSpec) -> list[tuple[int, Any, Any]]:
    found = []
    for index, transform in enumerate(chain.transforms):
        handler = _handler(spec, transform)
        if callable(getattr(handler, "export", None)) and callable(getattr(handler, "load", None)):
            found.append((index, transform, handler))
    return found


def _stats_prefixes(chain: Chain, spec: ReinitSpec) -> dict[int, str]:
    """Per chain index of a transform with exported statistics, the ``state_dict`` key prefix
    of its own entries (none without such a transform: then the env need not be transformed)."""
    handlers = _stats_handlers(chain, spec)
    if not handlers:
        return {}
    prefixes = chain.prefixes()
    return {index: prefixes[index] for index, _, _ in handlers}


def stats_sources(chain: Chain, spec: ReinitSpec) -> dict[str, list[str]]:
    """Per exported-statistics prefix (``stats.<index>``), the env's own ``state_dict``
    entries that hold the same statistics (its transform's entries): a push of the prefix
    supersedes them."""
    owned = _stats_prefixes(chain, spec)
    keys = list(env_state_dict(chain.env)) if owned else []
    return {f"{STATS}.{index}": [k for k in keys if k.startswith(prefix)] for index, prefix in owned.items()}


def replaced_stats(chain: Chain, spec: ReinitSpec, keys: Iterable[str]) -> set[int]:
    """The chain indices of the transforms with exported statistics whose own ``state_dict``
    entries are among ``keys``: writing those entries replaced their statistics (a checkpoint
    row holds them under the framework's keys beside their ``stats.*`` view)."""
    raw = [k for k in keys if not k.startswith(f"{STATS}.")]
    if not raw:
        return set()
    return {index for index, prefix in _stats_prefixes(chain, spec).items() if any(k.startswith(prefix) for k in raw)}


def stats_indices(chain: Chain, spec: ReinitSpec, selector: Selector) -> dict[int, float]:
    """The chain indices of the transforms ``selector`` matches whose handler can export and
    load statistics, with each one's forgetting factor (``handler.decay``; 1 without one)."""
    return {
        index: _decay(handler, transform)
        for index, transform, handler in _stats_handlers(chain, spec)
        if _matches(selector, index, transform)
    }


def stats_entries(chain: Chain, spec: ReinitSpec) -> dict[str, torch.Tensor]:
    """The running statistics of every transform whose handler exports them, by name
    (``stats.<index>.<name>``); fresh tensors."""
    out = {}
    for index, transform, handler in _stats_handlers(chain, spec):
        try:
            exported = handler.export(transform)
        except ValidationError:  # no statistics yet (a transform that initialises lazily)
            continue
        out.update({f"{STATS}.{index}.{name}": value for name, value in exported.items()})
    return out


def load_stats(chain: Chain, spec: ReinitSpec, values: dict[str, torch.Tensor]) -> None:
    """Load ``stats.*`` entries into their transforms (every entry of a transform at once)."""
    for index, transform, handler in _stats_handlers(chain, spec):
        prefix = f"{STATS}.{index}."
        mine = {k[len(prefix) :]: v for k, v in values.items() if k.startswith(prefix)}
        if mine:
            handler.load(transform, {**handler.export(transform), **mine})


def on_top_of_own(
    chain: Chain, spec: ReinitSpec, pushed: dict[str, torch.Tensor], read: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``pushed`` statistics (a merge computed from ``read``, what a gather read from this
    env) plus what the env's transforms have seen since that read, aged by their decay: a
    merge applied later than it was gathered (at the next reset, say) loses nothing the env
    saw meanwhile. Without a read of every pushed entry, ``pushed`` as it is."""
    if not read or any(k not in read for k in pushed):
        return pushed
    now = stats_entries(chain, spec)
    decays = {index: _decay(handler, transform) for index, transform, handler in _stats_handlers(chain, spec)}
    by_prefix = {k.rsplit(".", 1)[0]: decays.get(int(k.split(".")[1]), 1.0) for k in pushed}
    own = {k: read[k] for k in pushed}
    return stats.sync_round(pushed, {0: own}, {0: {k: now[k] for k in pushed}}, by_prefix)


def _decay(handler: Any, transform: Any) -> float:
    return float(handler.decay(transform)) if callable(getattr(handler, "decay", None)) else 1.0
