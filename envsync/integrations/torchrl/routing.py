"""An env push through ``collector.update_policy_weights_(..., model_id="env")`` is no policy
update: it leaves the policy version alone.

With ``track_policy_version=True`` torchrl tags every frame with a policy version (its
``PolicyVersion`` transform) and counts updates in ``update_policy_weights_``, whatever the
``model_id``: a single ``Collector`` bumps its version after every call (torchrl 0.14.1 and
the nightly), and the nightly's ``MultiCollector`` bumps its aggregate ``policy_version`` once
per model id of a call, or sets it to ``None`` for a call to a subset of workers. An env push
would then move (or blank) the version that says which policy made a frame, while the
workers' tags did not move. So envsync's scheme hands the collector an
``update_policy_weights_`` of its own (:func:`route_env_pushes`): the ``"env"`` share of a
call goes straight to the scheme, as torchrl itself would send it, and only the rest reaches
torchrl's update and its version count.

torchrl gives no public way to say that a weight-sync scheme carries no policy: its
version count sits inside ``update_policy_weights_`` and keys on the call's model ids only
(the nightly reads a scheme's ``sync`` flag, which only turns the count into ``None``). The
one reach is therefore the replaced method on the collector instance; nothing of torchrl's
internals is read or written.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from envsync.errors import ValidationError

ENV = "env"
"""The model id envsync's scheme is registered under in ``weight_sync_schemes`` by
``sender.schemes()``."""
_WEIGHT_ARGS = ("policy_or_weights", "weights", "policy")


def route_env_pushes(collector: Any, send: Callable[[Any, Any], None], model_id: str = ENV) -> None:
    """Make ``collector.update_policy_weights_`` hand the env's share of a call (its
    ``model_id="env"``, or the ``"env"`` entry of its ``weights_dict``) to
    ``send(weights, worker_ids)``, and only the rest to torchrl's own update.

    Args:
        collector: a torchrl collector.
        send: pushes env weights (``TensorDict(config=..., env_state=...)``) to the given
            workers (``None``: all).
        model_id: the model id envsync's scheme is registered under.

    Examples:
        >>> class Collector:
        ...     version = 0
        ...     def update_policy_weights_(self, *args, **kwargs):
        ...         self.version += 1
        >>> collector, pushed = Collector(), []
        >>> route_env_pushes(collector, lambda weights, workers: pushed.append((weights, workers)))
        >>> collector.update_policy_weights_(weights={"config": 1}, model_id="env", worker_ids=[0])
        >>> collector.update_policy_weights_(weights_dict={"env": {"config": 2}, "policy": None})
        >>> pushed, collector.version
        ([({'config': 1}, [0]), ({'config': 2}, None)], 1)
    """
    update = collector.update_policy_weights_

    @functools.wraps(update)
    def update_policy_weights_(*args: Any, **kwargs: Any) -> None:
        workers = kwargs.get("worker_ids")
        if kwargs.get("model_id") == model_id:
            send(_env_weights(args, kwargs), workers)
            return
        weights_dict = kwargs.get("weights_dict")
        if isinstance(weights_dict, dict) and model_id in weights_dict:
            rest = {model: w for model, w in weights_dict.items() if model != model_id}
            if rest:
                update(*args, **{**kwargs, "weights_dict": rest})
            send(weights_dict[model_id], workers)
            return
        update(*args, **kwargs)

    collector.update_policy_weights_ = update_policy_weights_


def _env_weights(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The one weights argument of an env push, given positionally or by any of torchrl's
    keywords."""
    given = [a for a in args[:1] if a is not None] + [kwargs[k] for k in _WEIGHT_ARGS if kwargs.get(k) is not None]
    if len(given) > 1:
        raise ValidationError("update_policy_weights_(model_id='env') takes its weights once")
    return given[0] if given else None
