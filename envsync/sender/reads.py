"""The sender's reading back from its workers: the versions they run, their env-state
entries (``gather``), what they hold at attribute paths (``read_attributes``), and a merge of
their running statistics (``sync_stats``). A part of :class:`~envsync.sender.sender.Sender`'s public
front; :mod:`envsync.sender.gather` decides what is asked and how answers combine, the links move
the bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
from tensordict import TensorDict

from envsync.errors import ValidationError
from envsync.indexing import Indices
from envsync.reinit import Selector
from envsync.sender import gather
from envsync.sender.core import Core
from envsync.sender.port import AttachPort
from envsync.spec import ApplySpec
from envsync.state import EnvStateTemplate


class ReadBack:
    """What a :class:`~envsync.sender.sender.Sender` reads back from its workers."""

    _core: Core
    port: AttachPort
    spec: ApplySpec
    push: Callable[..., int]

    if TYPE_CHECKING:

        def env_state_template(self) -> EnvStateTemplate: ...

    def versions(self) -> list[int]:
        """The version each attached worker's env runs now, in fleet order (empty when no
        collector is attached); for a batched worker, the oldest of its envs' versions."""
        with self._core.lock:
            self._core.prune()
            out: list[int] = []
            for attachment in self._core.fleet.attachments:  # each worker's envs: one row of a column
                link, per = attachment.link, attachment.envs_per_worker
                applied = link.counts(np.arange(link.num_workers), applied=True)[1]
                out += applied.reshape(-1, per).min(axis=1).tolist()
            return out

    def env_versions(self) -> list[int]:
        """The version each attached env runs now, in fleet env order (every sub-env of a
        batched env counts)."""
        with self._core.lock:
            self._core.prune()
            out: list[int] = []
            for attachment in self._core.fleet.attachments:  # a column per link, not a status per env
                link = attachment.link
                out += link.counts(np.arange(link.num_workers), applied=True)[1].tolist()
            return out

    def gather(
        self,
        env_state: Sequence[str | tuple[str, ...]] | None = None,
        *,
        workers: Sequence[int] | None = None,
        envs: Indices | None = None,
        timeout: float = 30.0,
    ) -> TensorDict:
        """Read env-state entries back from workers, at a safe point (a rollout's end, or at
        once while idle), through the link: tensors only.

        Args:
            env_state: entries of the env's ``state_dict()`` by torchrl's keys (or the
                derived ``stats.*`` moments): whole keys, tuple keys, or dotted prefixes
                such as ``"transforms.0"`` or ``"_extra_state"`` (default: every entry); a
                batched env's own entries as ``"batched.<key>"`` (see docs/batched.md).
            workers: fleet indices of workers (every env of each).
            envs: fleet indices of envs (default, with neither: every env).
            timeout: seconds to wait for the answers.

        Returns:
            A ``TensorDict`` with a leading dim over the targeted envs (one per worker when
            unbatched), shaped like ``env.state_dict()`` (``"loc"``; ``"_extra_state"``
            holding its entries; ``"batched"`` the batched env's own, the same for every
            env of a worker).

        Raises:
            ValidationError: an entry the env does not have, or no collector attached.
            AckTimeout: some workers did not answer in time, or died.
        """
        return gather.gather(self._core, self.env_state_template(), env_state, workers, timeout, envs)

    def read_attributes(
        self,
        paths: Sequence[str],
        *,
        workers: Sequence[int] | None = None,
        envs: Indices | None = None,
        timeout: float = 30.0,
    ) -> TensorDict:
        """Read back what each env holds at attribute paths, at a safe point (a rollout's end,
        or at once while idle): e.g. the masses a domain randomisation wrote, read from the
        simulator itself rather than from the config pushed.

        Args:
            paths: attribute paths as :func:`envsync.apply.attributes` resolves them (the
                first part found along the env's wrapper chain, e.g. ``"g"``,
                ``"unwrapped.model.body_mass"``, mjlab's ``"sim.model.body_mass"``); each
                must hold a number or an array.
            workers: fleet indices of workers (every env of each).
            envs: fleet indices of envs (default, with neither: every env).
            timeout: seconds to wait for the replies.

        Returns:
            A ``TensorDict`` with a leading dim over the targeted envs, a path's parts as
            nested keys (``out["unwrapped", "model", "body_mass"]``); a row of a natively
            batched env holds its row of a per-row array.

        Raises:
            ValidationError: ``paths`` is empty or not strings, or a path does not resolve on
                the sender's probe env (before anything is sent).
            GatherError: an env failed to read a path (its worker's traceback attached).
            AckTimeout: some envs did not reply in time, or died.
        """
        if isinstance(paths, str) or not paths or not all(isinstance(p, str) and p for p in paths):
            raise ValidationError(f"read_attributes takes a non-empty list of attribute paths (strings); got {paths!r}")
        chosen = list(dict.fromkeys(paths))
        if self.port.probe is not None:
            self.port.probe.check_paths(chosen)
        return gather.read_attributes(self._core, chosen, workers, envs, timeout)

    def sync_stats(self, selector: Selector, *, timeout: float = 30.0) -> int:
        """Merge the running statistics of the selected normalising transforms across every
        worker, exactly (counts add; means and variances combine by Chan et al.'s formulas;
        each worker contributes only what it saw since the last sync), and push the result
        to every worker as one version; a worker that joins later starts from it.

        Args:
            selector: the transforms, as in ``reinit=`` (class, class name or index; a
                batched env's own as ``"batched.<class name or index>"``, merged once per
                worker); each needs a handler with ``export``/``load`` (``VecNorm`` and
                ``VecNormV2`` have one).
            timeout: seconds for the gather and for every worker to apply the merge.

        Returns:
            The version that carries the merged statistics.

        Raises:
            ValidationError: no selected transform keeps mergeable statistics, one forgets
                (``decay < 1``) without telling its updates (``VecNorm`` and ``VecNormV2``
                do), or no collector is attached (envs of ``attach_env`` only receive).
        """
        template = self.env_state_template()
        decays = self.port.probe_or_fail().stats_indices(self.spec, selector)
        return gather.sync_stats(self._core, template, selector, decays, self.push, self.spec.apply_at, timeout)
