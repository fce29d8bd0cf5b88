"""torch.nn.utils' gradient clipping routed to zcompile parameters' shards.

Why torch is patched. ``torch.nn.utils.clip_grad_norm_`` over zcompile parameters finds no
``param.grad`` at stages 2 and 3 and clips nothing; at stage 1 it clips each rank by its local
norm, and the ranks then apply different updates. Both are silent wrong results, the worst
defect class of this project. ``install_torch_clip_patch`` runs with the other routes (``zcompile.routes.install``) before the
backend, the optimizer or weight averaging makes a shard: before that no parameter is a zcompile
one, after it the patch is in place. It
replaces, in ``torch.nn.utils`` and ``torch.nn.utils.clip_grad``:

- ``clip_grad_norm_`` and ``clip_grad_value_`` by wrappers that clip the given parameters here
  when any of them has a shard, and call torch's function otherwise;
- ``clip_grads_with_norm_`` (``_clip_grads_with_norm_``) by a guard that raises, naming the fix,
  when given zcompile parameters: its norm was computed from ``param.grad``. torch's own
  ``clip_grad_norm_`` calls it through its module, so a reference bound before the patch
  (``from torch.nn.utils import clip_grad_norm_`` at import time) raises instead of no-op'ing.

``get_total_norm`` receives gradients, not parameters, and cannot tell; the norm of zcompile
gradients is ``optimizer.clip_grad_norm_`` (or ``clip_grad_norm_`` with ``max_norm=inf``).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad as torch_clip_grad

from zcompile.agreement.step_agreement import DEFAULT_TIMEOUT_S as STEP_AGREEMENT_TIMEOUT_S
from zcompile.agreement.step_agreement import agree_before_step
from zcompile.optim.clip import clip_grad_norm_of_shards, clip_grad_value_of_shards
from zcompile.routes.patched import ORIGINAL_ATTR
from zcompile.sharding.shards import ShardedParam, shard_eager_parameter, shard_of, warn_eager_sharded

log = logging.getLogger(__name__)


def install_torch_clip_patch() -> None:
    """Routes torch.nn.utils' gradient clipping of zcompile parameters here; idempotent (module docstring)."""
    if hasattr(torch_clip_grad.clip_grad_norm_, ORIGINAL_ATTR):
        return
    routed = {
        "clip_grad_norm_": _routed_clip_grad_norm(torch_clip_grad.clip_grad_norm_),
        "clip_grad_value_": _routed_clip_grad_value(torch_clip_grad.clip_grad_value_),
    }
    if hasattr(torch_clip_grad, "_clip_grads_with_norm_"):
        guard = _guarded_clip_grads_with_norm(torch_clip_grad._clip_grads_with_norm_)
        torch_clip_grad._clip_grads_with_norm_ = guard
        torch.nn.utils.clip_grads_with_norm_ = guard
    for module in (torch_clip_grad, torch.nn.utils):
        for name, function in routed.items():
            setattr(module, name, function)
    log.info("zcompile: torch.nn.utils.clip_grad_norm_ and clip_grad_value_ now clip zcompile parameters' shards")


def _listed(parameters) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def route_members(params: list[torch.Tensor]) -> list[ShardedParam]:
    """The shards of ``params`` (deduplicated); a parameter with a gradient but no shard trained
    outside the compiled graphs and gets a stage-1 shard, as the optimizer gives it."""
    params = list(dict.fromkeys(params))
    shards = [shard_of(p) for p in params]
    group = next(s.group for s in shards if s is not None)
    shown: list[str] = []
    members = [
        s if s is not None else shard_eager_parameter(p, f"#{index} of the clipped parameters", group, shown)
        for index, (p, s) in enumerate(zip(params, shards))
        if s is not None or p.grad is not None
    ]
    warn_eager_sharded(shown, "gradient clipping", members)
    return members


def agree_before_route(params: list[torch.Tensor], what: str) -> None:
    """Before the clip's collectives: every rank is clipping the same step (``zcompile.agreement.step_agreement``)."""
    members = [s for s in dict.fromkeys(map(shard_of, params)) if s is not None]
    agree_before_step(members, params, what, STEP_AGREEMENT_TIMEOUT_S)


def _routed_clip_grad_norm(original):
    @functools.wraps(original)
    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        params = _listed(parameters)
        if not any(shard_of(p) is not None for p in params):
            return original(params if params else parameters, max_norm, norm_type, error_if_nonfinite, foreach)
        agree_before_route(params, "torch.nn.utils.clip_grad_norm_()")
        with torch.no_grad():
            return clip_grad_norm_of_shards(
                route_members(params), max_norm, norm_type, error_if_nonfinite=error_if_nonfinite
            )

    setattr(clip_grad_norm_, ORIGINAL_ATTR, original)
    return clip_grad_norm_


def _routed_clip_grad_value(original):
    @functools.wraps(original)
    def clip_grad_value_(parameters, clip_value, foreach=None):
        params = _listed(parameters)
        if not any(shard_of(p) is not None for p in params):
            return original(params, clip_value, foreach)
        agree_before_route(params, "torch.nn.utils.clip_grad_value_()")
        with torch.no_grad():
            clip_grad_value_of_shards(route_members(params), clip_value)

    setattr(clip_grad_value_, ORIGINAL_ATTR, original)
    return clip_grad_value_


def _guarded_clip_grads_with_norm(original):
    @functools.wraps(original)
    def clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
        params = _listed(parameters)
        sharded = next((s for s in map(shard_of, params) if s is not None), None)
        if sharded is not None:
            raise RuntimeError(
                f"zcompile: torch.nn.utils.clip_grads_with_norm_ was given zcompile parameters ({sharded.name!r}, "
                "...), whose gradients live on their shards, not in param.grad, so a norm computed from param.grad "
                "is not theirs. Use optimizer.clip_grad_norm_(max_norm), max_grad_norm= on zcompile.optim.AdamW/SGD, "
                "or torch.nn.utils.clip_grad_norm_ looked up at call time, not bound at import."
            )
        return original(params, max_norm, total_norm, foreach)

    setattr(clip_grads_with_norm_, ORIGINAL_ATTR, original)
    return clip_grads_with_norm_
