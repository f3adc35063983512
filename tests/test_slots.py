"""envsync.links.slots: the slot table both links lay out (the in-process link here; both
links alike in test_links.py)."""

from __future__ import annotations

import pytest
import torch

from envsync.links.local import LocalLink


def test_a_write_that_fails_half_way_is_never_seen_and_reads_never_spin() -> None:
    link = LocalLink({("config", "a"): torch.zeros(2), ("config", "b"): torch.zeros(2)}, 1)
    with pytest.raises(ValueError, match="does not fit"):
        link.write(0, 1, {("config", "a"): torch.ones(2), ("config", "b"): torch.ones(5)})
    header = link.handle().open(0).read_header()
    assert header.version == 0 and header.config["a"].tolist() == [0.0, 0.0]
