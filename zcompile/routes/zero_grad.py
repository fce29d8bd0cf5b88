"""``module.zero_grad()`` clears zcompile parameters' gradient shards too.

Why: at stages 2 and 3 (and at stage 1 once clipping reduced the gradients early) a parameter's
gradient lives on its shard (``ShardedParam.shard.grad``), which is not a parameter of any module.
``torch.nn.Module.zero_grad`` only clears ``param.grad``, so the loops that zero through the model
(Hugging Face Trainer, accelerate, many hand-written ones) would leave the shards' gradients in place
and the next backward would accumulate onto them: every step after the first would train on the sum
of all gradients so far, with no error. ``install_zero_grad_route`` (idempotent, run when the first
parameter is sharded, next to the clip route of ``zcompile.routes.clip_grad``) wraps ``Module.zero_grad`` so
that it clears, the same way (``set_to_none`` or zeros), the shards of the module's parameters.
Modules without zcompile parameters pay one attribute lookup per parameter.

Gradients zeroed some other way (``p.grad = None`` in a loop) still miss the shards: the optimizer
warns when a step finds the shards' gradients of the previous step (``stale_grad_members``).
"""

from __future__ import annotations

import functools
import logging
import weakref

import torch

from zcompile.routes.patched import ORIGINAL_ATTR
from zcompile.sharding.sharded_parameter import grad_of, set_grad
from zcompile.sharding.shards import ShardedParam, shard_of

log = logging.getLogger(__name__)


def clear_shard_grad(sharded: ShardedParam, set_to_none: bool) -> None:
    """What ``zero_grad`` does to a parameter's gradient, done to its shard's (and to its
    low-precision replica's, which holds stage 1's full gradient under ``param_dtype``, and to the
    tensor sharded, which holds it otherwise: a DTensor parameter's local piece)."""
    sharded.stepped_grad = None  # zeroed since the step (see stale_grad_members)
    for holder in (sharded.grad_target, sharded.replica, sharded.param):
        if holder is not None:
            zero_tensor_grad(holder, set_to_none)


def zero_tensor_grad(tensor: torch.Tensor, set_to_none: bool) -> None:
    """``tensor.grad`` dropped, or zeroed in place (detached first), as ``Optimizer.zero_grad`` does."""
    grad = grad_of(tensor)
    if grad is None:
        return
    if set_to_none:
        set_grad(tensor, None)
    else:
        grad.detach_()
        grad.zero_()


def install_zero_grad_route() -> None:
    """Makes ``torch.nn.Module.zero_grad`` clear zcompile gradient shards too (module docstring)."""
    if hasattr(torch.nn.Module.zero_grad, ORIGINAL_ATTR):
        return
    original = torch.nn.Module.zero_grad

    @functools.wraps(original)
    def zero_grad(self: torch.nn.Module, set_to_none: bool = True) -> None:
        original(self, set_to_none)
        for param in self.parameters():
            sharded = shard_of(param)
            if sharded is not None:
                clear_shard_grad(sharded, set_to_none)

    setattr(zero_grad, ORIGINAL_ATTR, original)
    torch.nn.Module.zero_grad = zero_grad
    log.info("zcompile: torch.nn.Module.zero_grad now clears zcompile parameters' gradient shards")


def remember_stepped_grads(members: list[ShardedParam]) -> None:
    """After a step: which gradient each shard had, to tell at the next step whether it was zeroed."""
    for member in members:
        grad = member.shard_grad
        member.stepped_grad = None if grad is None else weakref.ref(grad)


def stale_grad_members(members: list[ShardedParam]) -> list[ShardedParam]:
    """The members whose shard still holds the gradient tensor the last step used and that no
    ``zero_grad`` (optimizer's or module's, which reset the mark) cleared since: this step's
    gradient was added onto the last one's."""
    return [
        m
        for m in members
        if m.stepped_grad is not None and m.shard_grad is not None and m.stepped_grad() is m.shard_grad
    ]
