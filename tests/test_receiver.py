"""The sender and receiver logic over the in-process link, on a real torchrl env but without
a collector: each test runs in milliseconds. (End-to-end tests with real collectors and
worker processes are in the test_e2e_* and test_guarantees modules.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import make_normed_counter_env, run_to_exit

from envsync import EnvStateSender, WorkerApplyError
from envsync.configure import config_applier, env_state_dict
from envsync.links.local import LocalLink
from envsync.protocol import ApplyAt
from envsync.spec import ApplySpec
from envsync.state import FlatConfig
from envsync.worker.receiver import EnvStateReceiver


class EnvAdapter:
    """The receiver's view of a bare env (no collector): what an integration provides."""

    has_reinit = False

    def __init__(self, env: Any, apply: Any) -> None:
        self.env = env
        self._apply = config_applier(env, apply)
        self.resets = 0

    def apply_config(self, config: FlatConfig) -> None:
        self._apply(config)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return env_state_dict(self.env, keep_vars=True)

    def note_read(self, entries: dict[str, torch.Tensor], target: int) -> None:
        return None

    def commit(self, written: dict[str, torch.Tensor], *, version: int, restore: bool = False) -> None:
        return None

    def reinit(self, version: int) -> None:
        return None

    def reset(self) -> None:
        self.resets += 1
        self.env.reset()


def refuse_label_one_negative(env: Any, config: Any) -> None:
    env.base_env.set_difficulty(float(config["difficulty"]))
    if env.base_env.label == 1 and float(config["difficulty"]) < 0:
        raise ValueError("label one refuses")


def fleet(sender: EnvStateSender, workers: int = 2, apply_at: str = "step") -> list[EnvStateReceiver]:
    """Attach ``workers`` receivers, each beside its own env, through a local link."""
    envs = [make_normed_counter_env(label=i) for i in range(workers)]
    sender.env_fn(make_normed_counter_env)  # the probe: env-state keys
    attachment = sender.port.attach(workers, lambda leaves: LocalLink(leaves, workers), detached=lambda: False)
    spec = ApplySpec(sender.spec.apply, ApplyAt(apply_at), sender.spec.reinit)
    receivers = [
        EnvStateReceiver(
            link=attachment.link.handle().open(w),
            spec=spec,
            adapter=EnvAdapter(env, sender.spec.apply),
            initial_config=None,
        )
        for w, env in enumerate(envs)
    ]
    for receiver in receivers:
        receiver.start(loop=receiver.link)
    return receivers


def test_step_mode_applies_while_idle_and_acks() -> None:
    with EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step") as sender:
        receivers = fleet(sender)
        version = sender.push(config={"difficulty": 2.0}, wait="applied", timeout=5)
        assert sender.versions() == [version, version]
        assert [r.adapter.env.base_env.difficulty for r in receivers] == [2.0, 2.0]  # type: ignore[attr-defined]


def test_reset_mode_arms_at_a_step_and_applies_at_the_reset() -> None:
    with EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty") as sender:
        receivers = fleet(sender, apply_at="reset")
        version = sender.push(config={"difficulty": 3.0}, wait=None)
        for receiver in receivers:
            with receiver.busy():
                receiver.before_step()
        sender.wait(version, until="received", timeout=5)
        assert sender.versions() == [0, 0]
        for receiver in receivers:
            with receiver.busy():
                receiver.before_reset()
        assert sender.versions() == [version, version]


def test_a_rolled_back_first_push_is_undone_where_the_env_skipped_the_rollbacks_own_version() -> None:
    """In "reset" mode worker 0 applies a version that pushes ``loc`` for the first time, worker
    1 fails it, and the sender rolls it back; a newer push lands before worker 0's next reset,
    so worker 0 never reads the rollback's version (nor its undo mark). Its ``loc`` must still
    come back: the rolled-back entry's stamp is 0 again."""
    sender = EnvStateSender(config={"difficulty": 0.0}, apply=refuse_label_one_negative, apply_at="reset")
    receivers = fleet(sender, apply_at="reset")
    live = [torch.full((3,), float(i + 1)) for i in range(2)]
    for receiver, values in zip(receivers, live, strict=True):
        receiver.adapter.env.transform.loc.copy_(values)  # type: ignore[attr-defined]
    failing = sender.push(config={"difficulty": -1.0}, env_state={"loc": torch.full((3,), 9.0)}, wait=None)
    for receiver in receivers:
        receiver.before_reset()
    assert receivers[0].adapter.env.transform.loc.tolist() == [9.0] * 3  # type: ignore[attr-defined]
    with pytest.raises(WorkerApplyError, match="label one refuses") as info:
        sender.wait(failing, until="applied", timeout=5)
    assert info.value.rollback == failing + 1
    newer = sender.push(config={"difficulty": 2.0}, wait=None)  # before worker 0's next reset
    for receiver in receivers:
        receiver.before_reset()
    sender.wait(newer, until="applied", timeout=5)
    for receiver, values in zip(receivers, live, strict=True):
        env = receiver.adapter.env  # type: ignore[attr-defined]
        assert env.transform.loc.tolist() == values.tolist() and env.base_env.difficulty == 2.0
    sender.close()


def test_a_failure_restores_config_and_env_state_and_rolls_the_fleet_back() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply=refuse_label_one_negative, apply_at="step")
    receivers = fleet(sender)
    live = [torch.full((3,), float(i + 1)) for i in range(2)]
    for receiver, values in zip(receivers, live, strict=True):
        receiver.adapter.env.transform.loc.copy_(values)  # type: ignore[attr-defined]
    with pytest.raises(WorkerApplyError, match="label one refuses") as info:
        sender.push(config={"difficulty": -1.0}, env_state={"loc": torch.full((3,), 9.0)}, wait="applied")
    assert info.value.worker == 1 and info.value.rollback == 2
    sender.wait(2, until="applied", timeout=5)
    for receiver, values in zip(receivers, live, strict=True):
        env = receiver.adapter.env  # type: ignore[attr-defined]
        assert env.transform.loc.tolist() == values.tolist() and env.base_env.difficulty == 0.0
    again = sender.push(env_state={"loc": torch.full((3,), 4.0)}, wait="applied", timeout=5)
    with pytest.raises(WorkerApplyError):
        sender.push(config={"difficulty": -2.0}, env_state={"loc": torch.full((3,), 5.0)}, wait="applied")
    sender.wait(again + 2, until="applied", timeout=5)
    assert [r.adapter.env.transform.loc.tolist() for r in receivers] == [[4.0] * 3] * 2  # type: ignore[attr-defined]
    sender.close()


def test_a_receiver_that_starts_late_catches_up_and_resets() -> None:
    with EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step") as sender:
        sender.push(config={"difficulty": 1.5})
        receivers = fleet(sender, workers=1)
        assert sender.versions() == [1]
        assert receivers[0].adapter.resets == 1  # type: ignore[attr-defined]
        assert receivers[0].adapter.env.base_env.difficulty == 1.5  # type: ignore[attr-defined]


def test_only_what_nothing_else_can_restore_is_kept() -> None:
    with EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step") as sender:
        (receiver,) = fleet(sender, workers=1)
        sender.push(env_state={"loc": torch.ones(3)}, wait="applied", timeout=5)
        # first push: only this worker knows the old values (a rollback puts them back)
        assert set(receiver._before_first) == {"loc"} and receiver._before_first["loc"].abs().sum() == 0
        sender.push(env_state={"loc": torch.full((3,), 2.0)}, wait="applied", timeout=5)
        assert not receiver._before_first and not receiver._kept  # pushed again: the sender can republish


def test_a_listener_wake_while_busy_does_not_hide_a_step_version_from_the_next_step() -> None:
    """The worker loop also wakes every half second while the collector drives the env, and
    notices (acknowledges) a pending version then. In "step" mode the next step must still
    apply it: it once took the fast path because the receiver had "seen" the version."""
    from helpers import make_counter_env

    from envsync.integrations.torchrl.adapter import EnvHooks

    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    sender.env_fn(make_counter_env)
    attachment = sender.port.attach(1, lambda leaves: LocalLink(leaves, 1), detached=lambda: False)
    env = make_counter_env()
    hooks = EnvHooks.install(env, sender.spec, sender.template.values.clone())
    receiver = EnvStateReceiver(
        link=attachment.link.handle().open(0),
        spec=sender.spec,
        adapter=EnvAdapter(env, sender.spec.apply),
        initial_config=sender.template.values,
    )
    hooks.bind(receiver, 0)
    from torchrl.envs.utils import step_mdp

    td = step_mdp(env.rand_step(env.reset()))  # settles the hooks: the next steps take the fast path
    with receiver.busy():
        version = sender.push(config={"difficulty": 3.0}, wait=None)
        receiver.on_wake()  # the worker loop's periodic wake, while busy: notices, does not apply
        assert (receiver.seen, receiver.version) == (version, 0)
        out = env.rand_step(td)
        assert receiver.version == version
        assert float(out["next", "observation"][0]) == 3.0
    sender.close()


class RacingAdapter(EnvAdapter):
    """An adapter whose config method lets the sender publish a newer version each time, as a
    sender pushing faster than this env can load would (``races`` times)."""

    def __init__(self, env: Any, apply: Any, sender: EnvStateSender, races: int) -> None:
        super().__init__(env, apply)
        self.sender = sender
        self.races = races
        self.last = 0.0  # the latest loc published

    def apply_config(self, config: FlatConfig) -> None:
        super().apply_config(config)
        if self.races:
            self.races -= 1
            self.last = float(self.races)
            self.sender.push(env_state={"loc": torch.full((3,), self.last)}, wait=None)


def test_an_outpaced_receiver_acknowledges_nothing_it_did_not_load_and_loads_it_later() -> None:
    with EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step") as sender:
        env = make_normed_counter_env(label=0)
        sender.env_fn(make_normed_counter_env)
        attachment = sender.port.attach(1, lambda leaves: LocalLink(leaves, 1), detached=lambda: False)
        adapter = RacingAdapter(env, sender.spec.apply, sender, races=100)
        receiver = EnvStateReceiver(
            link=attachment.link.handle().open(0),
            spec=sender.spec,
            adapter=adapter,
            initial_config=sender.desired_config(),
        )
        receiver.start(loop=None)
        sender.push(config={"difficulty": 5.0}, env_state={"loc": torch.full((3,), 7.0)}, wait=None)
        receiver.before_step()  # every load finds a newer version: it gives up
        assert receiver.version == 0 and sender.versions() == [0]
        assert env.base_env.difficulty == 0.0  # the previous config is back
        assert env.transform.loc.tolist() != [7.0] * 3
        adapter.races = 0
        receiver.before_step()  # the next safe point applies the latest, entries included
        assert sender.versions() == [sender.version] and receiver.version == sender.version
        assert env.base_env.difficulty == 5.0
        assert env.transform.loc.tolist() == [adapter.last] * 3  # the latest value raced in


EXIT_CHECK = """
from torchrl.collectors import Collector
from envsync import EnvStateSender
from envsync.envs import make_drift_env

# neither the collector nor the sender is closed: their receivers live until the interpreter exits
sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
collector = Collector(sender.env_fn(make_drift_env), None, frames_per_batch=8, total_frames=-1,
                      weight_sync_schemes=sender.schemes())
test_env = make_drift_env()
sender.attach_env(test_env)
for i in range(50):
    sender.push(config={"difficulty": 0.01 * i}, wait=None)
print("running:", envsync_threads())
"""


@pytest.mark.timeout(120)
def test_listeners_left_running_end_before_the_interpreter_finalises() -> None:
    # a daemon thread still running at finalisation is stopped where it stands; stopped while
    # it drops the last reference to a tensor, it aborts the process (seen with torchrl-nightly:
    # "terminate called without an active exception", exit code 134, after a passing suite)
    lines = run_to_exit(EXIT_CHECK, timeout=100)
    assert lines["running"].count("envsync-loop") == 2  # one per link: the collector's and the evaluation env's
    assert lines["threads at exit"] == "[]"


BATCHED_EXIT_CHECK = """
from functools import partial
from torchrl.collectors import Collector
from envsync import EnvStateSender
from helpers import make_batched_counters, make_native_counters

# not a ParallelEnv: torchrl alone hangs at the exit of a program that never closes one
# (multiprocessing joins its worker, which waits on its pipe for ever)
builders = {"serial": partial(make_batched_counters, "serial", 2), "native": partial(make_native_counters, 2)}
kept = []
for kind, make in builders.items():  # one collector per env kind, none closed
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    collector = Collector(sender.env_fn(make), None, frames_per_batch=8, total_frames=-1,
                          weight_sync_schemes=sender.schemes())
    next(iter(collector))
    sender.push(config={"difficulty": 1.0}, wait="applied")
    kept.append((sender, collector))
print("running:", envsync_threads())
"""


@pytest.mark.timeout(120)
def test_a_collector_of_each_batched_env_kind_left_running_exits_cleanly() -> None:
    # the same promise in the batched env kinds of a Collector (the collector kind whose
    # batched env's group listens in the main process)
    lines = run_to_exit(BATCHED_EXIT_CHECK, timeout=100)
    assert "envsync-" in lines["running"]
    assert lines["threads at exit"] == "[]"
