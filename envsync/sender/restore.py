"""Carrying out a checkpoint's :class:`~envsync.sender.checkpoint.RestorePlan`: with no collector
attached, the plan becomes what the next one starts from; with running envs, it is pushed as
new versions, and the statistics books learn at which version each env holds the
checkpoint's statistics (it runs on meanwhile)."""

from __future__ import annotations

from typing import Any, Protocol

from envsync.levels import is_batched
from envsync.sender.checkpoint import RestorePlan
from envsync.sender.core import Core
from envsync.state import nest


class Push(Protocol):
    """The sender's push, as a restore uses it."""

    def __call__(
        self, config: Any = None, env_state: Any = None, *, workers: Any = None, envs: Any = None, wait: str | None
    ) -> int: ...


def carry_out(core: Core, plan: RestorePlan, push: Push) -> int:
    """Restore ``plan`` into ``core`` (call under the core's lock); return the version now desired."""
    for whole, book in plan.books.items():
        core.books.put(whole, book)
    if not plan.indices:
        kept = core.desired.keep_for_attach
        return kept(plan.version, plan.first, plan.columns, plan.count, plan.env_state, plan.own)
    indices = plan.indices
    # the version at which each env (and each worker's batched env) holds the checkpoint's
    # statistics: its statistics book counts from there
    at: dict[int, int] = {}
    at_whole: dict[int, int] = {}
    if plan.env_state:
        version = push(env_state=plan.env_state, wait=None)
        at = dict.fromkeys(indices, version)
        at_whole = {core.head(index): version for index in indices}
    for index, entries in zip(indices, plan.own or [{} for _ in indices], strict=True):
        mine = {k: v for k, v in entries.items() if not is_batched(k)}
        if mine:
            at[index] = push(env_state=mine, envs=[index], wait=None)
        outer = {k: v for k, v in entries.items() if is_batched(k)}
        if outer and core.head(index) == index:  # a batched env's own: its worker's
            at_whole[index] = push(env_state=outer, workers=[core.fleet.worker_of(index)], wait=None)
    if False in plan.books:
        plan.books[False].loaded_into_running(at, indices, plan.before[False])
    if True in plan.books:
        heads = sorted({core.head(index) for index in indices})
        plan.books[True].loaded_into_running(at_whole, heads, plan.before[True])
    if plan.columns is not None:  # a row per env, as columns
        rows = nest(plan.columns, batch_size=[plan.count])
        return push(config=rows, envs=indices, wait=None)
    return push(config=plan.first, wait=None)
