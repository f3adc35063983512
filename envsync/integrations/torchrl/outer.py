"""The batched env's own transforms (:mod:`envsync.levels`), served by its group.

A ``TransformedEnv`` around a ``SerialEnv``/``ParallelEnv`` (or a natively batched env's
transforms) is shared by every env of the worker, so it has no receiver of its own: the
worker's envs carry its entries in their slots (``batched.<key>``, pushed to every env of the
worker), and :class:`OuterState`, beside the batched env in the process that drives it,
reads them from the worker's first slot. It loads an entry once every env of the worker has
applied the version that pushed it (so no frame tagged with an older version of every env
sees it), at the batched env's next step, or before answering a gather; then it runs the
batched-level ``reinit`` policies once per version the whole worker reached. It answers the
gather requests that ask for ``batched.*`` entries (the sub-envs' receivers leave those).
Everything runs under the group's exclusion, never while the collector drives the env.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
from torchrl.envs import EnvBase, TransformedEnv

from envsync.integrations.torchrl.adapter import CollectorAdapter
from envsync.levels import PREFIX, inner, is_batched, split_reinit
from envsync.links.base import End
from envsync.protocol import Kind
from envsync.receiver import answer
from envsync.spec import ApplySpec


def outer_env(env: Any) -> TransformedEnv | None:
    """The env whose own transforms are the batched level: ``env`` (a collector's env, or a
    natively batched env as hooked) when it is a ``TransformedEnv``. torchrl folds nested
    ``TransformedEnv`` layers into one, so it holds every transform above the batched env."""
    return env if isinstance(env, TransformedEnv) else None


def outer_spec(spec: ApplySpec) -> ApplySpec:
    """How the group treats the batched env's own transforms: no config method, the
    batched-level ``reinit`` rules only."""
    return ApplySpec(apply=None, apply_at=spec.apply_at, reinit=split_reinit(spec.reinit)[1])


class OuterState:
    """The batched env's own entries, loaded and read beside it (see the module docstring).

    The worker's envs record the versions they applied as *reached* (their ends are gated,
    :meth:`~envsync.links.base.Marks.gated`); this level acknowledges them as
    *applied* once it holds them too, or reports their failure: "applied" covers both levels.

    Args:
        env: the env that holds the batched-level transforms.
        spec: the sender's apply spec (its batched-level ``reinit`` rules are used).
        ends: the (ungated) ends of every env of the worker, the first one's slot read for
            the batched entries (every env of the worker carries the same).
    """

    def __init__(self, env: EnvBase, spec: ApplySpec, ends: list[End]) -> None:
        self._adapter = CollectorAdapter(None, env, outer_spec(spec))
        self._ends = ends
        self._end = first = ends[0]
        count = len(ends)
        self._targets, self._reached = first.counters("target", count), first.counters("reached", count)
        self._applied = first.counters("applied", count)
        self._loaded: dict[str, int] = {}  # name -> stamp of the value in the env
        self._snapshot: dict[str, torch.Tensor] = {}  # first-time loads, for an undo
        self.version = 0  # the latest version this level holds (see gate)

    def gate(self) -> int:
        """The newest version this level may hold: every env of the worker holds everything
        pushed to it up to there (an env still applying, or one that failed its latest
        version and waits for the rollback, holds up the level at what it holds)."""
        targets, reached = self._targets.copy(), self._reached.copy()
        waiting = reached != targets
        if waiting.any():
            return min(int(reached[waiting].min()), int(targets.max()))
        return int(targets.max())

    def behind(self) -> bool:
        """Whether the worker's envs reached a version this level has not acknowledged."""
        return bool((self._applied != self._reached).any()) or self.gate() > self.version

    def catch_up(self) -> None:
        """Load the batched-level entries of every version the worker's envs all reached,
        run the batched-level ``reinit`` policies, and acknowledge the envs' versions as
        applied; on a failure report it for each of them instead (caller holds the group's
        exclusion)."""
        reached = self.gate()
        if reached > self.version:
            failure = self._apply(reached)
            if failure is None:
                return  # not in place yet (a newer push, or a lazy transform): the next safe point
            self.version = reached
            if failure:
                self._report(reached, failure)
                return
        self._acknowledge()

    def _apply(self, reached: int) -> str | None:
        """Bring this level to ``reached``: ``""`` when done, the traceback when it failed,
        ``None`` when it must wait for the next safe point."""
        header = self._end.read_header()
        try:
            # an entry first pushed by a version since rolled back is "never pushed" again
            # (stamp 0): put its earlier value back, even when this level skipped the
            # rollback's own version (its undo mark gone with a newer push)
            undone = [n for n, stamp in self._loaded.items() if stamp and not header.stamps.get(n, 0)]
            if undone:
                self._put_back(undone)
            live = self._adapter.state_tensors()
            due = [
                n for n, stamp in header.stamps.items() if is_batched(n) and self._loaded.get(n, 0) < stamp <= reached
            ]
            ready = [n for n in due if inner(n) in live]
            if ready and not self._load(header.version, ready, live, header.stamps):
                return None  # a newer version came meanwhile: the next safe point loads it
            if len(ready) < len(due):
                return None  # a lazy transform's state appears at its first reset: the next safe point
            self._adapter.reinit(reached)
        except Exception:
            return traceback.format_exc()
        return ""

    def _acknowledge(self) -> None:
        """Every env whose reached version this level holds: applied."""
        reached, applied = self._reached.copy(), self._applied.copy()
        for i, end in enumerate(self._ends):
            if applied[i] != reached[i] and reached[i] <= self.version:
                end.ack_applied(int(reached[i]))

    def _report(self, version: int, text: str) -> None:
        """The level failed ``version``: each env that reached that very version fails it
        (there is one: the gate is some env's reached version). An env waiting on an older
        one stays unacknowledged until this level holds a version again (the rollback's)."""
        reached = self._reached.copy()
        text = f"the batched env's own transforms failed to apply version {version}:\n{text}"
        for i, end in enumerate(self._ends):
            if reached[i] == version:
                end.report_failure(version, text)

    def _load(self, version: int, names: list[str], live: dict[str, torch.Tensor], stamps: dict[str, int]) -> bool:
        first_time = {n for n in names if not self._loaded.get(n)}

        def load(name: str, view: torch.Tensor) -> None:
            target = live[inner(name)]
            if name in first_time:
                self._snapshot[name] = target.detach().clone()
            target.data.copy_(view)

        if not self._end.load_entries(version, names, load):
            return False
        self._adapter.commit({inner(n): live[inner(n)] for n in names}, version=max(stamps[n] for n in names))
        self._loaded.update({n: stamps[n] for n in names})
        return True

    def _put_back(self, names: list[str]) -> None:
        """Entries whose first push was rolled back: their values from before it."""
        live = self._adapter.state_tensors()
        restored = [n for n in names if n in self._snapshot]
        for name in restored:
            live[inner(name)].data.copy_(self._snapshot.pop(name))
        for name in names:
            self._loaded[name] = 0
        self._adapter.commit({inner(n): live[inner(n)] for n in restored}, version=0, restore=True)

    def serve(self) -> None:
        """Answer a request for the batched env's own entries, after catching up (caller holds
        the group's exclusion, with the collector idle or at a rollout's end); a request of
        any other kind is the first sub-env's receiver's."""
        request = self._end.request()
        if request is None or request.kind is not Kind.BATCHED_STATE:
            return
        self.catch_up()
        answer(self._end, request, lambda payload: self._read(payload["names"]))

    def _read(self, names: list[str]) -> dict[str, torch.Tensor]:
        live = self._adapter.state_tensors()
        out = {inner(name): live[inner(name)] for name in names}
        self._adapter.note_read(out, self._end.target())
        return {f"{PREFIX}{key}": value for key, value in out.items()}
