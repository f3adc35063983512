"""Where the single ``Collector``'s worker gets its link: the in-process one. This test reads the
sender's private attachments; it moves to the module of the public API that replaces them (see
tests/test_fleet.py, tests/test_acks.py, tests/test_adapter.py, tests/test_probe.py and
tests/test_slots.py for the tests that were here)."""

from __future__ import annotations

from helpers import make_counter_env
from torchrl.collectors import Collector

from envsync import EnvStateSender
from envsync.links.local import LocalLink


def test_single_collector_uses_an_in_process_link() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = Collector(
        sender.env_fn(make_counter_env), None, frames_per_batch=8, total_frames=-1, weight_sync_schemes=sender.schemes()
    )
    try:
        assert isinstance(sender._fleet.attachments[0].link, LocalLink)
        version = sender.push(config={"difficulty": 2.0}, wait="applied")
        assert set(next(iter(collector))["next", "observation"][:, 0].tolist()) == {2.0}
        assert sender.versions() == [version]
    finally:
        collector.shutdown()
        sender.close()
