"""The tags' columns: every way of filling a rollout's tags gives each frame the version of
the latest change at or before it (numpy below ``LARGE`` frames, one torch call first above)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from envsync.integrations.torchrl.tags import LARGE, Columns


@pytest.mark.parametrize(("envs", "steps"), [(3, 4), (600, 20), (LARGE // 16, 16), (4096, 16)])
def test_every_frame_gets_the_version_of_the_latest_change_at_or_before_it(envs: int, steps: int) -> None:
    rng = np.random.default_rng(envs)
    for _ in range(40):
        columns = Columns(rng.integers(0, 3, envs))
        expected = np.repeat(columns.constant().reshape(-1, 1), steps, axis=1)
        frames = sorted(rng.choice(steps + 2, size=int(rng.integers(0, 4)), replace=False).tolist())
        for frame in frames:  # some past the rollout's end (a root change after its last step)
            versions = rng.integers(0, 3, envs) if rng.random() < 0.7 else np.full(envs, 7)
            columns.mark(frame, versions)
            expected[:, frame:] = versions.reshape(-1, 1)
        out = torch.full((envs, steps), -1, dtype=torch.int64)
        columns.fill(out)
        assert (out.numpy() == expected).all(), frames
