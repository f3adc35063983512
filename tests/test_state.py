"""envsync.state: template, validation, applying config and env state."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchrl.envs import ObservationNorm, TransformedEnv

from envsync import ValidationError
from envsync.configure import apply_config, config_kwargs, env_state_dict, find_config_method
from envsync.envs import make_drift_env
from envsync.state import ConfigTemplate, EnvStateTemplate


def test_template_fixes_names_shapes_and_dtypes() -> None:
    template = ConfigTemplate({"difficulty": 0.0, "level": 3, "gravity": torch.zeros(3), "task": {"id": 1}})
    assert template.names == ["difficulty", "gravity", "level", "task.id"]
    assert template.values["difficulty"].dtype == torch.float32
    assert template.values["level"].dtype == torch.int64
    out = template.validate({"gravity": torch.ones(3, dtype=torch.float64), "task": {"id": 2}})
    assert out["gravity"].dtype == torch.float32 and out["task", "id"].item() == 2
    assert set(out.keys(include_nested=True, leaves_only=True)) == {"gravity", ("task", "id")}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"colour": 1.0}, "unknown config name 'colour'"),
        ({"gravity": torch.ones(2)}, "'gravity' has shape \\(3,\\), got \\(2,\\)"),
        ({"level": 1.5}, "'level' has dtype torch.int64, got float 1.5"),
        ({"level": torch.tensor(1.0)}, "'level' has dtype torch.int64, got torch.float32"),
        ({"difficulty": "hard"}, "'difficulty' must be a number or a tensor"),
        ({"difficulty": float("nan")}, "'difficulty' holds NaN or inf"),
        ({"gravity": torch.tensor([0.0, float("inf"), 0.0])}, "'gravity' holds NaN or inf"),
        ({"difficulty": True}, "'difficulty' has dtype torch.float32, got bool"),
        ({"task": 3}, "unknown config name 'task'"),
        ({"level": {"x": 1}}, "unknown config name 'level.x'"),
        ([("difficulty", 1.0)], "config must be a mapping"),
        ({"difficulty": 1e300}, "'difficulty' overflows dtype torch.float32"),
        ({"level": 2**70}, "'level' does not fit dtype torch.int64"),
    ],
)
def test_bad_values_are_rejected_with_the_offending_name(values: object, message: str) -> None:
    template = ConfigTemplate({"difficulty": 0.0, "level": 3, "gravity": torch.zeros(3), "task": {"id": 1}})
    with pytest.raises(ValidationError, match=message):
        template.validate(values)  # type: ignore[arg-type]


def test_nonfinite_values_pass_when_allowed() -> None:
    template = ConfigTemplate({"difficulty": 0.0}, allow_nonfinite=True)
    assert torch.isinf(template.validate({"difficulty": float("inf")})["difficulty"])
    with pytest.raises(ValidationError, match="NaN or inf"):
        ConfigTemplate({"difficulty": float("nan")})


def test_config_kwargs_turns_scalars_into_numbers() -> None:
    kwargs = config_kwargs(TensorDict(a=torch.tensor(1.5), b=torch.tensor(2), c=torch.ones(2)))
    assert kwargs["a"] == 1.5 and isinstance(kwargs["a"], float)
    assert kwargs["b"] == 2 and isinstance(kwargs["b"], int)
    assert kwargs["c"].tolist() == [1.0, 1.0]


def test_config_method_is_found_on_the_unwrapped_gym_env() -> None:
    env = TransformedEnv(make_drift_env(), ObservationNorm(loc=0.0, scale=1.0, in_keys=["observation"]))
    apply_config(env, "set_difficulty", TensorDict(difficulty=torch.tensor(0.75)))
    assert env.base_env._env.unwrapped.difficulty == 0.75
    with pytest.raises(ValidationError, match="apply='set_gravity': no such method"):
        find_config_method(env, "set_gravity")


def test_env_state_loads_in_place_and_reads_back() -> None:
    norm = ObservationNorm(loc=torch.zeros(2), scale=torch.ones(2), in_keys=["observation"])
    env = TransformedEnv(make_drift_env(), norm)
    env.append_transform(ObservationNorm(loc=torch.zeros(2), scale=torch.ones(2), in_keys=["observation"]))
    template = EnvStateTemplate(env.state_dict())
    storage = env.transform[0].loc.data_ptr()
    state = template.fit({"transforms.0.loc": torch.tensor([1.0, 2.0])})
    live = env_state_dict(env, keep_vars=True)
    for key, value in state.items():
        live[key].data.copy_(value)
    assert env.transform[0].loc.tolist() == [1.0, 2.0] and env.transform[0].loc.data_ptr() == storage
    assert env_state_dict(env)["transforms.0.loc"].tolist() == [1.0, 2.0]
    with pytest.raises(ValidationError, match="'transforms.5.loc' is not in the env's state_dict"):
        template.validate({"transforms.5.loc": torch.zeros(2)})


def test_env_state_accepts_flat_nested_and_tensordict_forms() -> None:
    template = EnvStateTemplate({"transforms.0.loc": torch.zeros(2), "transforms.0.scale": torch.ones(2)})
    forms = [
        {"transforms.0.loc": torch.ones(2)},
        {"transforms": {"0": {"loc": torch.ones(2)}}},
        TensorDict({"transforms": {"0": {"loc": torch.ones(2)}}}),
    ]
    for form in forms:
        out = template.validate(form)  # type: ignore[arg-type]
        assert list(out.keys()) == ["transforms.0.loc"]  # shaped like the state_dict it came from
    with pytest.raises(ValidationError, match="env_state must be a mapping"):
        template.validate([1, 2])  # type: ignore[arg-type]


def test_an_apply_callable_sees_the_same_env_at_build_time_as_in_a_worker() -> None:
    from torchrl.envs import GymEnv

    from envsync import EnvStateSender

    seen: list[str] = []
    sender = EnvStateSender(config={"g": 10.0}, apply=lambda env, config: seen.append(type(env).__name__))
    env = sender.env_fn(lambda: GymEnv("Pendulum-v1"))()
    # the user's own env, in a worker as at build time: envsync adds no wrapper layer
    assert seen == ["GymEnv"] and type(env).__name__ == "GymEnv"
    sender.close()


def test_large_pushed_copies_reuse_only_buffers_nothing_holds() -> None:
    """A large pushed tensor is copied into an earlier push's buffer once nothing references
    it (no allocation per push of a fixed-shape payload), and never into one that something
    still holds: a reference, a view of its storage, a numpy array of it."""
    from envsync.buffers import Buffers

    buffers = Buffers()
    n = Buffers.MIN_BYTES // 4
    first = buffers.copy(torch.ones(n), torch.float32)
    address = first.data_ptr()
    held = buffers.copy(torch.full((n,), 2.0), torch.float32)  # `first` is still referenced
    assert held.data_ptr() != address and float(first[0]) == 1.0
    del first
    again = buffers.copy(torch.full((n,), 3.0), torch.float32)
    assert again.data_ptr() == address and float(again[0]) == 3.0  # reused, no allocation
    view, numpy_view = again[1:], held.numpy()
    reused = {again.data_ptr(), held.data_ptr()}
    del again, held
    fresh = buffers.copy(torch.full((n,), 4.0), torch.float32)
    assert fresh.data_ptr() not in reused  # a view and a numpy array keep theirs alive
    assert float(view[0]) == 3.0 and float(numpy_view[0]) == 2.0
    caller = torch.full((n,), 5.0, dtype=torch.float64)
    converted = buffers.copy(caller, torch.float32)
    assert converted.dtype == torch.float32 and converted.data_ptr() != caller.data_ptr()
    small = torch.ones(4)
    assert buffers.copy(small, torch.float32).data_ptr() != small.data_ptr()
