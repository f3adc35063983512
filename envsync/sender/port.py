"""The attach port: what an integration needs from a sender, and nothing users need.

An integration (``envsync.integrations.torchrl``) gives the sender the env that stands for
the workers' envs (:meth:`AttachPort.use_probe`), learns how many envs a worker holds, and
attaches and detaches collectors. Users reach none of this: they call the sender's push,
wait, gather and checkpoint methods. Call order: ``use_probe`` (when the user's factory is
wrapped) -> ``attach`` (when the collector binds its scheme) -> ``detach`` (when it shuts down).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from envsync.errors import ValidationError
from envsync.links.base import Flat, SenderLink
from envsync.sender.core import Core
from envsync.sender.desired import Update
from envsync.sender.fleet import Attachment
from envsync.sender.probe import Probe
from envsync.spec import ApplySpec
from envsync.state import ConfigTemplate, EnvStateTemplate


class AttachPort:
    """The sender's side facing integrations: its probe env, its env-state template, and
    the collectors attached to its fleet.

    Args:
        core: the sender's records, fleet and lock.
        template: the config template.
        spec: how workers apply versions.
        env_state_template: a declared env-state template (no env is ever built in this
            process to learn one), or ``None``.
        envs_per_worker: how many envs each worker holds, when declared.
        allow_nonfinite: accept NaN and inf in env state read from the probe.

    Examples:
        >>> from envsync.sender.sender import Sender
        >>> sender = Sender(config={"x": 0.0})
        >>> leaves, rows = sender.port.start_state()
        >>> float(leaves["config", "x"]), rows
        (0.0, None)
        >>> sender.close()
    """

    def __init__(
        self,
        core: Core,
        template: ConfigTemplate,
        spec: ApplySpec,
        *,
        env_state_template: EnvStateTemplate | None,
        envs_per_worker: int | None,
        allow_nonfinite: bool,
    ) -> None:
        self._core = core
        self._template = template
        self._spec = spec
        self._declared = env_state_template
        self._learned: EnvStateTemplate | None = None
        self._envs_per_worker = envs_per_worker
        self._allow_nonfinite = allow_nonfinite
        self.probe: Probe | None = None

    # ---- the env the workers run -----------------------------------------------------------

    def use_probe(self, probe: Probe) -> None:
        """Take ``probe`` as the env that stands for the workers' envs (replaces any earlier)."""
        if self.probe is not None:
            self.probe.close()
        self.probe = probe
        self._learned = None

    def probe_or_fail(self) -> Probe:
        """The probe env.

        Raises:
            ValidationError: no env factory was wrapped yet.
        """
        if self.probe is None:
            raise ValidationError("envsync needs an env: wrap your env factory with sender.env_fn first")
        return self.probe

    @property
    def declared(self) -> bool:
        """Whether the env-state template was declared (then no env is built in this process)."""
        return self._declared is not None

    def envs_per_worker(self) -> int:
        """How many envs each worker holds: as given, else counted on the probe env (1 with a
        declared env-state template)."""
        if self._envs_per_worker is not None:
            return self._envs_per_worker
        if self._declared is not None:
            return 1
        return self.probe_or_fail().num_envs()

    def rows_per_worker(self) -> int:
        """How many consecutive envs of a worker are rows of one natively batched env (one
        process, one worker loop: a link gives them one lock and one wake-up); 1 otherwise,
        and when nothing was built in this process to tell."""
        if self._envs_per_worker is not None or self._declared is not None:
            return 1
        layout = self.probe_or_fail().layout()
        return layout.num_envs if layout.rows else 1

    def env_state_template(self) -> EnvStateTemplate:
        """The env-state keys a push may carry: declared, or read once from the probe env
        (which also checks the sender's settings against the env before any worker starts)."""
        if self._declared is not None:
            return self._declared
        if self._learned is None:
            self._learned = self.probe_or_fail().describe(self._spec, self._allow_nonfinite)
        return self._learned

    def close(self) -> None:
        """Close the probe env."""
        if self.probe is not None:
            self.probe.close()
            self.probe = None

    # ---- attaching ---------------------------------------------------------------------------

    def attach(
        self,
        num_workers: int,
        make_link: Callable[[Flat], SenderLink],
        *,
        detached: Callable[[], bool],
        on_close: Callable[[], None] = lambda: None,
        envs_per_worker: int = 1,
        collectors: Sequence[int] | None = None,
        first_env: int | None = None,
        outside: bool = False,
    ) -> Attachment:
        """Attach a collector's ``num_workers`` workers, of ``envs_per_worker`` envs each,
        after the fleet's others.

        ``make_link`` builds the link (one slot per env) from the leaves every env starts
        from; then each env is given the latest version (and its own checkpointed row, if
        any). ``collectors`` splits the workers among several collectors behind one link
        (their worker counts, in order). ``first_env``: the index its workers were numbered
        from before attaching (see :meth:`next_env_index`). ``outside``: one env outside any
        collector; it starts from the fleet-wide desired state (a checkpoint's rows wait for
        the collector they belong to).

        Raises:
            ValidationError: a loaded per-env checkpoint has another number of envs, or
                ``first_env`` was given to a collector attached since.
        """
        num_envs = num_workers * envs_per_worker
        core = self._core
        with core.lock:
            core.check_open()
            core.prune()
            start = self._start_leaves()
            rows = None if outside else core.desired.rows_for(num_envs, envs_per_worker)
            link = make_link(start)
            if link.num_workers != num_envs:
                raise ValidationError(f"the link has {link.num_workers} slots for {num_envs} envs")
            attachment = Attachment(link, detached, on_close, envs_per_worker, collectors, outside)
            core.fleet.add(attachment, start, first_env)
            version = core.desired.version
            slots = np.arange(num_envs, dtype=np.int64)
            parts = rows if rows is not None else [Update(slots)]  # a restored row per env: positions are slots
            for part in parts:
                attachment.link.write_rows(part.targets, version, part.shared, part.rows)
                attachment.mirror.set(part.targets, part.shared, part.rows)
            attachment.link.flush(version)
            core.record_history(version, attachment, slots, pruning=False)
            if not outside:
                core.desired.restored = None
            return attachment

    def next_env_index(self) -> int:
        """The fleet index the next attached collector's first env gets (for integrations
        that number remote workers before they attach, then pass it as ``first_env``)."""
        with self._core.lock:
            self._core.prune()
            return self._core.fleet.next_env()

    def start_state(self) -> tuple[Flat, list[Flat] | None]:
        """What the next attached collector starts from: the leaves every env starts from,
        and each env's own on top of them (the rows of a loaded per-env checkpoint; ``None``:
        none). For integrations whose workers start before they attach (Ray)."""
        with self._core.lock:
            leaves = self._start_leaves()
            return leaves, self._core.desired.restored_row_list()

    def _start_leaves(self) -> Flat:
        known = self.probe is not None or self._declared is not None
        template = self.env_state_template().flat if known else {}
        return self._core.desired.start_leaves(self._template.flat, template, self._fit)

    def _fit(self, values: Any) -> dict[str, torch.Tensor]:
        return self.env_state_template().fit(values)

    def links(self) -> list[SenderLink]:
        """The link of each live attachment, in attach order (for tests and benchmarks that
        look at what moved)."""
        with self._core.lock:
            self._core.prune()
            return [attachment.link for attachment in self._core.fleet.attachments]

    def detach(self, attachment: Attachment) -> None:
        """Take a collector out of the fleet and release its link; idempotent."""
        with self._core.lock:
            self._core.detach(attachment)
