"""A torch optimizer stepping zcompile parameters is an error, not a step that trains nothing.

Why: zcompile's parameters keep their gradients and master weights where zcompile's optimizers
(``zcompile.optim.AdamW`` / ``SGD``) look for them. ``torch.optim.AdamW(model.parameters())`` over a
zero-compiled model reads ``param.grad``:

- stages 2 and 3: ``param.grad`` is None (the averaged gradient is on the shard), so every step
  would update nothing, with no error or warning and the loss flat;
- stage 1: ``param.grad`` is this rank's own, unreduced gradient, so on more than one rank each
  rank applies a different update and the replicas part, silently.

``install_foreign_optimizer_guard`` (idempotent, run when the first parameter is sharded, beside the
clip and zero_grad routes) registers a global step pre-hook with torch
(``torch.optim.optimizer.register_optimizer_step_pre_hook``): before any optimizer's ``step()``, one
that is not zcompile's (or a wrapper of one, like accelerate's ``AcceleratedOptimizer``, found
through its ``optimizer`` attribute) and holds a zcompile parameter raises, naming the parameter and
the fix. Every rank that runs such a loop raises at the same step; one that alone holds a torch
optimizer leaves an abort note first, which the others, waiting in their step's agreement, quote. Optimizers without zcompile parameters pay one attribute lookup per parameter.
"""

from __future__ import annotations

import logging

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from zcompile.agreement.abort_note import leave_abort_note
from zcompile.sharding.shards import shard_of

log = logging.getLogger(__name__)

GUARD_ATTR = "_zcompile_foreign_optimizer_guard"  # on torch.optim.Optimizer: the hook's handle
SHARDED_OPTIMIZER_ATTR = "_zcompile_sharded_optimizer"  # True on zcompile.optim's optimizer classes


class ForeignOptimizerError(TypeError):
    """A torch (or other non-zcompile) optimizer was asked to step zcompile parameters."""


def is_zcompile_optimizer(optimizer) -> bool:
    """``optimizer`` is a zcompile one, or wraps one through ``.optimizer`` attributes."""
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        if getattr(type(optimizer), SHARDED_OPTIMIZER_ATTR, False):
            return True
        seen.add(id(optimizer))
        optimizer = getattr(optimizer, "optimizer", None)
    return False


def refuse_foreign_optimizer(optimizer, args, kwargs) -> None:
    """The step pre-hook (module docstring)."""
    if is_zcompile_optimizer(optimizer):
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            sharded = shard_of(param)
            if sharded is not None:
                message = (
                    f"zcompile: {type(optimizer).__module__}.{type(optimizer).__name__}.step() was given zcompile "
                    f"parameters ({sharded.name!r}, ...): their gradients and master weights live on zcompile's "
                    "shards, so it would update nothing at stages 2 and 3 (param.grad is None there) and, at "
                    "stage 1, apply each rank's own unreduced gradient. Use zcompile.optim.AdamW or "
                    "zcompile.optim.SGD (torch's signatures) over the model's parameters."
                )
                leave_abort_note(sharded.group, message)  # a rank whose optimizer is zcompile's, waiting, quotes it
                raise ForeignOptimizerError(message)


def install_foreign_optimizer_guard() -> None:
    """Registers ``refuse_foreign_optimizer`` with torch once per process (module docstring)."""
    if getattr(torch.optim.Optimizer, GUARD_ATTR, None) is not None:
        return
    handle = register_optimizer_step_pre_hook(refuse_foreign_optimizer)
    setattr(torch.optim.Optimizer, GUARD_ATTR, handle)
    log.info("zcompile: optimizers that are not zcompile's refuse to step zcompile parameters")
