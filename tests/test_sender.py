"""envsync.sender.sender without a collector: validation, versions, desired state, checkpoints."""

from __future__ import annotations

import pytest
import torch

import envsync
import envsync.errors
from envsync import EnvStateSender, EnvSyncError, ValidationError
from envsync.envs import make_drift_env


def defined_public_names() -> set[str]:
    """What envsync really offers at its top level: every class its lazy import table resolves
    (``envsync.__getattr__``), and every error ``envsync.errors`` defines."""
    table = {name for name in envsync._HOMES if not name.startswith("_")}
    errors = {
        name
        for name, value in vars(envsync.errors).items()
        if isinstance(value, type) and issubclass(value, EnvSyncError) and value.__module__ == "envsync.errors"
    }
    return table | errors


def test_public_names_are_exported_and_sorted() -> None:
    assert envsync.__all__ == sorted(set(envsync.__all__))
    assert set(envsync.__all__) == defined_public_names()
    for name in envsync.__all__:
        value = getattr(envsync, name)  # importable through the lazy table
        assert value.__name__ == name and value.__doc__, name
    assert set(envsync.__all__) <= set(dir(envsync))


def test_versions_count_pushes_from_zero() -> None:
    with EnvStateSender(config={"difficulty": 0.0}) as sender:
        assert sender.version == 0
        assert [sender.push(config={"difficulty": 0.1 * i}) for i in range(3)] == [1, 2, 3]
        assert sender.desired_config()["difficulty"].item() == pytest.approx(0.2)
        assert sender.versions() == [] and sender.num_workers is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"apply_at": "episode"}, "apply_at='episode'"),
        ({"apply": 3}, "apply must be a method name"),
        ({"config": {"difficulty": float("nan")}}, "NaN or inf"),
    ],
)
def test_bad_construction_is_rejected(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        EnvStateSender(**kwargs)  # type: ignore[arg-type]


def test_bad_pushes_change_nothing() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0})
    for call, message in [
        (lambda: sender.push(config={"dificulty": 1.0}), "unknown config name 'dificulty'"),
        (lambda: sender.push(config={"difficulty": 1.0}, wait="done"), "wait='done'"),
        (lambda: sender.push(config={"difficulty": 1.0}, workers=[0]), "workers= needs an attached collector"),
        (lambda: sender.push_each({0: {"difficulty": 1.0}}), "workers= needs an attached collector"),
        (lambda: sender.push(env_state={"transforms.0.loc": torch.zeros(2)}), "wrap your env factory"),
    ]:
        with pytest.raises(ValidationError, match=message):
            call()
        assert sender.version == 0 and sender.desired_config()["difficulty"].item() == 0.0
    sender.close()
    with pytest.raises(ValidationError, match="closed"):
        sender.push(config={"difficulty": 1.0})


def test_env_state_is_validated_against_a_probe_env() -> None:
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
    sender.env_fn(make_drift_env)
    with pytest.raises(ValidationError, match="'transforms.0.loc' is not in the env's state_dict; known: \\[\\]"):
        sender.push(env_state={"transforms.0.loc": torch.zeros(2)})
    sender.close()


def test_truncate_needs_a_truncated_key() -> None:
    from helpers import NoTruncationEnv

    sender = EnvStateSender(config={"difficulty": 0.0}, apply_at="truncate")
    sender.env_fn(make_drift_env)
    assert sender.env_state_template().keys == []
    sender.close()
    sender = EnvStateSender(config={}, apply_at="truncate")
    sender.env_fn(NoTruncationEnv)
    with pytest.raises(ValidationError, match="needs a 'truncated' done key"):
        sender.env_state_template()
    sender.close()


def test_checkpoint_round_trips_before_attach() -> None:
    source = EnvStateSender(config={"difficulty": 0.0, "level": 1})
    source.push(config={"level": 4})
    source.push(config={"difficulty": 0.5})
    target = EnvStateSender(config={"difficulty": 0.0, "level": 1})
    assert target.load_state_dict(source.state_dict()) == 2
    assert target.desired_config().to_dict() == source.desired_config().to_dict()
    with pytest.raises(ValidationError, match="'version' and 'config'"):
        target.load_state_dict({"config": {}})
    bad = source.state_dict()
    bad["config"]["level"] = torch.tensor(1.5)
    with pytest.raises(ValidationError, match="level"):
        target.load_state_dict(bad)
