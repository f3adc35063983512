"""Measure 8 of ``bench_worlds.py``: a per-world mass push to MuJoCo Playground's Cartpole
(envsync's ``PlaygroundWorlds``, MJX's JAX backend on the CPU) of n worlds, three ways:

* **push -> applied**: ``sender.push(config=TensorDict(mass=rows, batch_size=[n]),
  wait="applied")`` to an idle ``Collector`` (``apply="set_physics"``, ``apply_at="step"``);
* **the env's own apply**: ``env.set_physics(ids, mass=rows)`` called directly (the masked
  write of ``body_mass`` and ``body_inertia`` and the constants MuJoCo derives, computed for
  every changed world at once); and the **write alone**: ``env.set_physics(ids, friction=rows)`` (``geom_friction``
  derives nothing: one jitted masked select, nothing else);
* **friction push -> applied**: the same push of a friction factor per world to a second
  ``Collector`` (``config={"friction": 1.0}``): envsync's cost over the write alone, with
  nothing derived on either side;
* **rebuild**: what a Playground user does today to give the worlds new masses: a
  randomisation function returning the batched model and its ``in_axes`` (Playground's own
  form), ``wrap_for_brax_training(env, randomization_fn=...)``, ``jit`` of its reset and step,
  and the first reset and step, compilation included (the batched model is a constant of the
  jitted step: new values are a new program).

Every push and apply is followed by a check that the model holds the rows, and the JAX traces
of the env are counted before and after (a trace is a compilation).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from bench_common import median
from bench_envs import make_playground_cartpole
from tensordict import TensorDict

from envsync import EnvStateSender

POLE = 2  # Cartpole's bodies: world, cart, pole_1


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rebuild_seconds(n: int, factors: torch.Tensor) -> float:
    """Playground's way: randomise (a batched model and its in_axes), wrap for training, jit,
    first reset and step (compiled); the env itself is loaded before the clock starts."""
    import jax
    from mujoco_playground import registry, wrapper

    env = registry.load("CartpoleBalance", config_overrides={"impl": "jax"})
    rows = jax.numpy.asarray(factors.float().numpy())

    def randomize(model: Any) -> tuple[Any, Any]:
        axes = jax.tree_util.tree_map(lambda _: None, model).tree_replace({"body_mass": 0, "body_inertia": 0})
        batched = model.tree_replace(
            {
                "body_mass": model.body_mass[None] * rows[:, None],
                "body_inertia": model.body_inertia[None] * rows[:, None, None],
            }
        )
        return batched, axes

    start = time.perf_counter()
    wrapped = wrapper.wrap_for_brax_training(env, randomization_fn=randomize)
    state = jax.jit(wrapped.reset)(jax.random.split(jax.random.PRNGKey(0), n))
    state = jax.jit(wrapped.step)(state, jax.numpy.zeros((n, env.action_size)))
    jax.block_until_ready(state)
    return time.perf_counter() - start


def measure(n: int, pushes: int, generator: torch.Generator, rebuilds: int = 1) -> dict[str, Any]:
    """Medians in seconds of each way, the checks, and the traces added by the pushes."""
    from torchrl.collectors import Collector

    sender = EnvStateSender(config={"mass": 1.0}, apply="set_physics", apply_at="step")
    friction_sender = EnvStateSender(config={"friction": 1.0}, apply="set_physics", apply_at="step")
    direct = make_playground_cartpole(n)
    direct.reset()
    ids = torch.arange(n)
    built = direct.model.body_mass[0, POLE].item()
    built_friction = direct.model.geom_friction[0].double()
    collectors: list[Any] = []
    times: dict[str, list[float]] = {"push": [], "apply": [], "write": [], "friction_push": []}
    exact: list[bool] = []
    try:
        start = time.perf_counter()
        for of in (sender, friction_sender):
            collectors.append(
                Collector(
                    of.env_fn(lambda: make_playground_cartpole(n)),
                    None,
                    frames_per_batch=n,
                    total_frames=-1,
                    weight_sync_schemes=of.schemes(),
                )
            )
            next(iter(collectors[-1]))
            if of is sender:
                attach = time.perf_counter() - start
        env, friction_env = (c.env for c in collectors)
        for warm in (True, *([False] * pushes)):  # the first of each: warm-up, not counted
            rows = 0.5 + torch.rand(n, generator=generator, dtype=torch.float64)
            config = TensorDict(mass=rows, batch_size=[n])
            took = {
                "push": _timed(partial(sender.push, config=config, wait="applied")),
                "apply": _timed(partial(direct.set_physics, ids, mass=rows)),
                "write": _timed(partial(direct.set_physics, ids, friction=rows)),
                "friction_push": _timed(
                    partial(friction_sender.push, config=TensorDict(friction=rows, batch_size=[n]), wait="applied")
                ),
            }
            held = [env.model.body_mass[:, POLE], direct.model.body_mass[:, POLE]]
            exact.append(all(torch.allclose(h.double(), built * rows, rtol=1e-6) for h in held))
            friction = friction_env.model.geom_friction.double()
            exact.append(torch.allclose(friction, built_friction[None] * rows[:, None, None], rtol=1e-6))
            if warm:
                traces = Counter(env.traces), Counter(direct.traces), Counter(friction_env.traces)
                continue
            for key, value in took.items():
                times[key].append(value)
        now = (env.traces, direct.traces, friction_env.traces)
        added = sum(sum((after - before).values()) for after, before in zip(now, traces, strict=True))
    finally:
        for collector in collectors:
            collector.shutdown()
        sender.close()
        friction_sender.close()
        direct.close()
    rebuild = [rebuild_seconds(n, 0.5 + torch.rand(n, generator=generator)) for _ in range(rebuilds)]
    return {
        "push_s": median(times["push"]),
        "apply_s": median(times["apply"]),
        "write_s": median(times["write"]),
        "friction_push_s": median(times["friction_push"]),
        "rebuild_s": median(rebuild),
        "attach_s": attach,
        "exact": all(exact),
        "traces_added": added,
        "samples": len(times["push"]),
        "raw": {**{f"{k}_s": v for k, v in times.items()}, "rebuild_s": rebuild},
    }
