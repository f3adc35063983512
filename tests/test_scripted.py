"""The sender's rules (acknowledgements, rollback, gather answers, checkpoints) over a scripted
link: workers are functions, so each test runs in milliseconds without processes or envs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import cast

import pytest
import torch

from envsync import AckTimeout, GatherError, ValidationError, WorkerApplyError
from envsync.links.scripted import Script, ScriptedLink, answers, applies, refuses
from envsync.links.slot_reader import SlotReader
from envsync.sender.sender import Sender

STATE = {"loc": torch.zeros(2)}


@pytest.fixture
def sender() -> Iterator[Sender]:
    out = Sender(config={"difficulty": 0.0}, env_state_template=STATE)
    yield out
    out.close()


def attach(
    sender: Sender, script: Script, workers: int = 3, *, alive: Callable[[int], bool] = lambda w: True
) -> ScriptedLink:
    attachment = sender.port.attach(
        workers, lambda leaves: ScriptedLink(leaves, workers, script, alive=alive), detached=lambda: False
    )
    return cast(ScriptedLink, attachment.link)


def failing_on(worker: int, below: float) -> Script:
    """Worker ``worker`` refuses difficulties below ``below``; every other applies."""

    def script(end: SlotReader) -> None:
        target = end.target()
        difficulty = float(end.read_header().config["difficulty"])
        if end.worker == worker and difficulty < below:
            end.report_failure(target, f"Traceback (most recent call last):\nValueError: {difficulty} < {below}")
        else:
            end.ack_applied(target)
        answers(end)

    return script


def test_a_push_is_applied_by_every_worker_and_versions_count_up(sender: Sender) -> None:
    attach(sender, applies)
    assert sender.push(config={"difficulty": 0.5}, wait="applied") == 1
    assert sender.push_each({0: {"difficulty": 0.1}, 2: {"difficulty": 0.9}}, wait="applied") == 2
    assert sender.versions() == [2, 1, 2]
    assert [sender.desired_config(w)["difficulty"].item() for w in range(3)] == pytest.approx([0.1, 0.5, 0.9])


def test_a_failed_apply_raises_once_names_the_worker_and_rolls_the_push_back(sender: Sender) -> None:
    link = attach(sender, failing_on(1, 0.0))
    sender.push(config={"difficulty": 0.5}, wait="applied")
    with pytest.raises(WorkerApplyError) as caught:
        sender.push(config={"difficulty": -1.0}, wait="applied")
    err = caught.value
    assert (err.worker, err.version, err.rollback) == (1, 2, 3)
    assert "ValueError: -1.0 < 0.0" in err.remote_traceback
    # the rollback gives every worker the config before the failed push again
    assert all(float(end.read_header().config["difficulty"]) == 0.5 for end in link.ends)
    assert sender.desired_config()["difficulty"].item() == 0.5
    # raised once: the next push goes on
    assert sender.push(config={"difficulty": 2.0}, wait="applied") == 4
    assert sender.versions() == [4, 4, 4]


def test_a_failure_after_the_push_returned_is_raised_by_the_next_push(sender: Sender) -> None:
    attach(sender, failing_on(2, 0.0))
    assert sender.push(config={"difficulty": -1.0}, wait=None) == 1
    with pytest.raises(WorkerApplyError) as caught:
        sender.push(config={"difficulty": 1.0}, wait=None)
    assert (caught.value.worker, caught.value.version) == (2, 1)


def test_a_silent_worker_times_out_and_a_dead_one_is_reported_at_once(sender: Sender) -> None:
    dead: set[int] = set()

    def script(end: SlotReader) -> None:
        if end.worker != 1:
            end.ack_applied(end.target())

    attach(sender, script, alive=lambda w: w not in dead)
    with pytest.raises(AckTimeout) as caught:
        sender.push(config={"difficulty": 1.0}, wait="applied", timeout=0.2)
    assert (caught.value.workers, caught.value.dead) == ([1], [])
    dead.add(1)
    with pytest.raises(AckTimeout) as caught:
        sender.push(config={"difficulty": 2.0}, wait="applied", timeout=30.0)
    assert caught.value.dead == [1]


def test_gather_reads_each_worker_and_a_refusal_raises_without_failing_a_version(sender: Sender) -> None:
    attach(sender, applies)
    sender.push(env_state={"loc": torch.tensor([1.0, 2.0])}, wait="applied")
    assert sender.gather(["loc"])["loc"].tolist() == [[1.0, 2.0]] * 3
    other = Sender(config={"difficulty": 0.0}, env_state_template=STATE)
    try:
        attach(other, refuses(OSError("disk")))
        version = other.push(config={"difficulty": 1.0}, wait="applied")
        with pytest.raises(GatherError) as caught:
            other.gather(["loc"])
        assert caught.value.worker == 0 and "OSError: disk" in caught.value.remote_traceback
        assert other.versions() == [version] * 3
        assert other.push(config={"difficulty": 2.0}, wait="applied") == version + 1  # no rollback in between
    finally:
        other.close()


def test_a_checkpoint_with_per_worker_rows_resumes_each_worker_from_its_row(sender: Sender) -> None:
    attach(sender, applies)
    sender.push_each({0: {"difficulty": 0.1}, 1: {"difficulty": 0.2}, 2: {"difficulty": 0.3}}, wait="applied")
    sender.push(env_state={"loc": torch.tensor([4.0, 5.0])}, workers=[1], wait="applied")
    state = sender.state_dict()
    resumed = Sender(config={"difficulty": 0.0}, env_state_template=STATE)
    try:
        assert resumed.load_state_dict(state) >= state["version"]
        link = attach(resumed, applies)
        rows = [float(end.read_header().config["difficulty"]) for end in link.ends]
        assert rows == pytest.approx([0.1, 0.2, 0.3])
        assert resumed.gather(["loc"])["loc"].tolist() == [[0.0, 0.0], [4.0, 5.0], [0.0, 0.0]]
        with pytest.raises(ValidationError, match="3 worker configs; the collector has 2 workers"):
            again = Sender(config={"difficulty": 0.0}, env_state_template=STATE)
            try:
                again.load_state_dict(state)
                attach(again, applies, workers=2)
            finally:
                again.close()
    finally:
        resumed.close()


def test_a_checkpoint_that_does_not_fit_the_running_fleet_changes_nothing(sender: Sender) -> None:
    attach(sender, applies)
    sender.push(config={"difficulty": 0.5}, wait="applied")
    other = Sender(config={"difficulty": 0.0}, env_state_template=STATE)
    try:
        attach(other, applies, workers=2)
        other.push_each({0: {"difficulty": 0.1}, 1: {"difficulty": 0.2}}, wait="applied")
        state = other.state_dict()
    finally:
        other.close()
    state["stats"] = {"merged": {}, "given": [{}, {}]}  # a restore that also carries books
    before = (sender.version, sender.state_dict())
    with pytest.raises(ValidationError, match="2 worker configs; the collector has 3 workers"):
        sender.load_state_dict(state)
    assert sender.version == before[0]
    assert "stats" not in sender.state_dict()  # the checkpoint's books were not taken
    assert [sender.desired_config(w)["difficulty"].item() for w in range(3)] == [0.5, 0.5, 0.5]
