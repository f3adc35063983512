"""Property-based: random templates and pushes through validation and the transport."""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envsync import EnvStateSender, ValidationError
from envsync.links.local import LocalLink
from envsync.state import ConfigTemplate, tensor_of

NAMES = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)
FLOATS = st.floats(-1e6, 1e6, allow_nan=False, width=32)


@st.composite
def leaf(draw: st.DrawFn) -> tuple[str, Any]:
    kind = draw(st.sampled_from(["float", "int", "bool", "vector"]))
    if kind == "float":
        return kind, draw(FLOATS)
    if kind == "int":
        return kind, draw(st.integers(-(2**40), 2**40))
    if kind == "bool":
        return kind, draw(st.booleans())
    size = draw(st.integers(1, 4))
    return kind, torch.tensor(draw(st.lists(FLOATS, min_size=size, max_size=size)), dtype=torch.float32)


@st.composite
def template_and_push(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    names = draw(st.lists(NAMES, min_size=1, max_size=4, unique=True))
    kinds: dict[str, str] = {}
    template: dict[str, Any] = {}
    for name in names:
        kinds[name], template[name] = draw(leaf())
    pushed = draw(st.lists(st.sampled_from(names), min_size=1, unique=True))
    push: dict[str, Any] = {}
    for name in pushed:
        kind = kinds[name]
        if kind == "vector":
            size = template[name].numel()
            push[name] = torch.tensor(draw(st.lists(FLOATS, min_size=size, max_size=size)), dtype=torch.float32)
        else:
            while True:
                other_kind, value = draw(leaf())
                if other_kind == kind:
                    push[name] = value
                    break
    return template, push, kinds


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(template_and_push())
def test_valid_pushes_round_trip_exactly_through_a_link(
    case: tuple[dict[str, Any], dict[str, Any], Any],
) -> None:
    template, push, _ = case
    tpl = ConfigTemplate(template)
    link = LocalLink({("config", k): v for k, v in tpl.flat.items()}, 2)
    link.write(1, 7, {("config", k): v for k, v in tpl.fit(push).items()})
    expected = {**tpl.flat, **tpl.fit(push)}
    header = link.handle().open(1).read_header()
    assert header.version == 7
    for key, value in expected.items():
        got, want = tensor_of(header.config[key]), tensor_of(value)  # numpy where numpy has the dtype
        assert got.dtype == want.dtype and torch.equal(got, want)
    untouched = link.handle().open(0).read_header().config
    assert all(torch.equal(tensor_of(untouched[k]), v) for k, v in tpl.flat.items())


@st.composite
def invalid_push(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any]]:
    template, push, kinds = draw(template_and_push())
    name = draw(st.sampled_from(sorted(push)))
    kind = kinds[name]
    broken = draw(st.sampled_from(["unknown", "shape", "nonfinite", "dtype", "text"]))
    if broken == "unknown":
        push = {**push, name + "_x": 1.0}
    elif broken == "shape":
        push[name] = torch.zeros(7)
    elif broken == "nonfinite":
        push[name] = (
            draw(st.sampled_from([math.nan, math.inf, -math.inf]))
            if kind != "vector"
            else torch.full(template[name].shape, math.nan)
        )
        if kind in ("int", "bool"):
            push[name] = "not a number"
    elif broken == "dtype":
        push[name] = 1.5 if kind in ("int", "bool") else True
    else:
        push[name] = "hard"
    return template, push


@settings(max_examples=60, deadline=None)
@given(invalid_push())
def test_invalid_pushes_raise_and_change_nothing(case: tuple[dict[str, Any], dict[str, Any]]) -> None:
    template, push = case
    with EnvStateSender(config=template) as sender:
        before = sender.desired_config()
        try:
            sender.push(config=push)
        except ValidationError:
            pass
        else:
            raise AssertionError(f"accepted {push!r} for template {template!r}")
        assert sender.version == 0
        assert (sender.desired_config() == before).all()
