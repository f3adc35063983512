"""Genesis's sliding box (:meth:`GenesisWorlds.sliding_box`, Genesis on the CPU) for the tests:
every observation carries a ``"physics"`` entry computed by Genesis from the model its world
holds (the joint-space mass matrix's translational diagonal, its first rotational one, and the
friction ratio of the box's geom), so that a frame shows the config it ran."""

from __future__ import annotations

from typing import Any

EPISODE_STEPS = 20


def make_boxes(num_worlds: int = 8, **kwargs: Any) -> Any:
    """``num_worlds`` sliding boxes as one :class:`GenesisWorlds` (episodes of ``EPISODE_STEPS``)."""
    from envsync.integrations.torchrl.genesis import GenesisWorlds

    return GenesisWorlds.sliding_box(num_worlds, episode_steps=kwargs.pop("episode_steps", EPISODE_STEPS), **kwargs)


def make_boxes_16() -> Any:
    return make_boxes(16)


def make_boxes_32() -> Any:
    return make_boxes(32)
