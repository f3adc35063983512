"""A torchrl env as :mod:`envsync.reinit` sees it: its transform chain, and the runner of the
reinit steps bound to it.

The core's selection rules count transforms by index and pick them by class; here is how
those indices count in torchrl: nested ``Compose`` flattened, envsync's own transform left
out, each transform's ``state_dict()`` entries under the prefix torchrl gives it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torchrl.envs.transforms import Compose, Transform

from envsync.reinit import Step


def flatten(transform: Transform | None) -> Iterator[Transform]:
    """The transforms of a transform tree in order, nested ``Compose`` flattened.

    Examples:
        >>> from torchrl.envs import Compose, DoubleToFloat, StepCounter
        >>> [type(t).__name__ for t in flatten(Compose(StepCounter(), Compose(DoubleToFloat())))]
        ['StepCounter', 'DoubleToFloat']
    """
    if isinstance(transform, Compose):
        for child in transform:
            yield from flatten(child)
    elif isinstance(transform, Transform):
        yield transform


@dataclass(frozen=True)
class TransformChain:
    """A torchrl env's transforms in order, nested ``Compose`` flattened, envsync's own left
    out (an :class:`envsync.reinit.Chain`); build it with :func:`chain_of`."""

    env: Any
    transforms: tuple[Transform, ...]

    def prefixes(self) -> tuple[str, ...]:
        """The ``state_dict`` key prefix of each transform, in the same order (a lone
        transform's keys are the env's: torchrl gives them no prefix)."""
        if not isinstance(self.env.transform, Compose):
            return ("",)
        names = {id(module): name for name, module in self.env.transform.named_modules()}
        return tuple(f"{names[id(t)]}." for t in self.transforms)


def chain_of(env: Any) -> TransformChain:
    """The env's transform chain (empty for ``None`` or an env without transforms).

    Examples:
        >>> from torchrl.envs import GymEnv, StepCounter, TransformedEnv, VecNormV2
        >>> env = TransformedEnv(GymEnv("Pendulum-v1"), StepCounter())
        >>> env.append_transform(VecNormV2(in_keys=["observation"]))  # doctest: +ELLIPSIS
        TransformedEnv(...)
        >>> chain = chain_of(env)
        >>> [type(t).__name__ for t in chain.transforms], chain.prefixes()
        (['StepCounter', 'VecNormV2'], ('transforms.0.', 'transforms.1.'))
    """
    transforms = flatten(getattr(env, "transform", None))
    return TransformChain(env, tuple(t for t in transforms if not getattr(t, "envsync_internal", False)))


def runner(steps: list[Step]) -> Callable[[Any, int], None]:
    """The receiver callback: run every step in order, then drop the env's cached specs
    (a transform's new statistics may change the specs torchrl derived from them)."""

    def run(env: Any, version: int) -> None:
        for step in steps:
            step.run()
        if steps:
            env.empty_cache()

    return run
