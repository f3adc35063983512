"""The attach port: which link an integration attaches each collector through, and what it
exposes (sender.port.links()) for tests and benchmarks."""

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
        assert isinstance(sender.port.links()[0], LocalLink)
        version = sender.push(config={"difficulty": 2.0}, wait="applied")
        assert set(next(iter(collector))["next", "observation"][:, 0].tolist()) == {2.0}
        assert sender.versions() == [version]
    finally:
        collector.shutdown()
        sender.close()
