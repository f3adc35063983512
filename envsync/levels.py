"""The two levels of a batched worker env: its sub-envs (each an env of the fleet) and the
batched env itself (the transforms of a ``TransformedEnv`` around a ``SerialEnv`` or
``ParallelEnv``, or of a natively batched env: shared by every env of the worker).

Sub-env entries and selectors keep their plain spelling (one sub-env's own ``state_dict()``
keys, ``reinit`` by class, class name or index). The batched env's own are spelled with the
prefix ``"batched."``: ``batched.<key>`` for a key of the worker env's ``state_dict()``
(torchrl's keys of the transformed batched env), ``batched.stats.<index>.*`` for its derived
moments, and ``"batched.<class name>"`` or ``"batched.<index>"`` as a ``reinit``/``sync_stats``
selector. Such state belongs to the *worker*: it is gathered once per worker (from the
worker's first env's slot), pushed to every env of the worker, and the group beside the
batched env loads it once every env of the worker has applied the version carrying it.
"""

from __future__ import annotations

from envsync.errors import ValidationError
from envsync.reinit import Policy, ReinitSpec, Selector

BATCHED = "batched"
PREFIX = f"{BATCHED}."


def is_batched(name: str) -> bool:
    """Whether an env-state name (or selector) addresses the batched env itself.

    Examples:
        >>> is_batched("batched._extra_state.loc"), is_batched("transforms.0.loc")
        (True, False)
    """
    return name == BATCHED or name.startswith(PREFIX)


def inner(name: str) -> str:
    """The name without the batched prefix: the key in the batched env's own ``state_dict()``.

    Examples:
        >>> inner("batched.transforms.0.loc")
        'transforms.0.loc'
    """
    return name[len(PREFIX) :]


def selector_level(selector: Selector) -> tuple[bool, Selector]:
    """Which level a ``reinit``/``sync_stats`` selector addresses, and its selector there
    (``"batched.2"`` is index 2 of the batched env's chain).

    Examples:
        >>> selector_level("batched.VecNormV2"), selector_level("batched.1"), selector_level(0)
        ((True, 'VecNormV2'), (True, 1), (False, 0))
    """
    if not isinstance(selector, str) or not is_batched(selector):
        return False, selector
    rest = inner(selector)
    if not rest:
        raise ValidationError(f"selector {selector!r} names no transform: use 'batched.<class name or index>'")
    return True, int(rest) if rest.isdigit() else rest


def split_reinit(spec: ReinitSpec) -> tuple[ReinitSpec, ReinitSpec]:
    """The rules for one sub-env and those for the batched env itself (prefix stripped).

    Raises:
        ValidationError: ``recompute`` on the batched env itself: it would roll out every
            sub-env at once, in the middle of their episodes (put the normaliser inside the
            sub-envs, or use ``sync_stats``).
    """
    leaf: list[tuple[Selector, Policy]] = []
    outer: list[tuple[Selector, Policy]] = []
    for selector, policy in spec.rules:
        batched, own = selector_level(selector)
        if batched and policy.kind == "recompute":
            raise ValidationError(
                f"reinit[{selector!r}]: recompute() on the batched env's own transform would step every sub-env at "
                "once, in the middle of their episodes; put the transform inside each sub-env (recompute works "
                "there), or keep its statistics in line with sync_stats"
            )
        (outer if batched else leaf).append((own, policy))
    return ReinitSpec(tuple(leaf), spec.handlers), ReinitSpec(tuple(outer), spec.handlers)
