"""``backward(inputs=...)`` and ``torch.autograd.grad`` over zcompile parameters.

Why: a compiled graph's autograd does not accumulate a parameter's gradient into the parameter at
stages 2 and 3, nor at stage 1 with ``param_dtype``. The leaf it accumulates into is the shard's
gradient carrier (stages 2 and 3: the averaged gradient shard, ``ShardedParam.grad_target``) or the
low-precision replica (stage 1: the local full gradient). So:

- ``loss.backward(inputs=list(model.parameters()))`` (a loop training a subset, or spelling out
  what to differentiate) would accumulate nothing at stage 2: the parameters are not in the graph's
  autograd, the optimizer would find no gradient, and the weights would stop changing with no word.
  At stage 3 it would raise the sharded parameter's eager-use error, which names ``gathered`` and
  not the cause;
- ``torch.autograd.grad(loss, params, allow_unused=True)`` would return None for every stage-2
  parameter, which code summing ``g.pow(2)`` over the non-None gradients reads as zero.

``install_autograd_route`` (idempotent, run when the first parameter is sharded, beside the clip and
zero-grad routes) wraps ``torch.autograd.backward`` (which ``Tensor.backward`` calls) and
``torch.autograd.grad``. In ``backward``, a zcompile parameter in ``inputs`` is replaced by the leaf
its gradient accumulates into: the step then finds it where a plain ``backward()`` leaves it, and
only the listed parameters get one. In ``grad``, a parameter whose gradient is a shard (stages 2 and
3) raises ``ShardedParameterError`` naming what to do: no tensor of the parameter's shape holds its
gradient; at stage 1 under ``param_dtype`` the replica's local gradient is returned (the graph
differentiated the replica). Other tensors pass through: one attribute lookup each, only where
``inputs`` is given.

A reference bound before the first shard (``from torch.autograd import grad`` at import time) keeps
torch's function.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.autograd

from zcompile.routes.patched import ORIGINAL_ATTR
from zcompile.sharding.sharded_parameter import AUTOGRAD_GRAD_FIX, ShardedParameterError
from zcompile.sharding.shards import ShardedParam, shard_of

log = logging.getLogger(__name__)


def autograd_leaf(sharded: ShardedParam) -> torch.Tensor:
    """The tensor the compiled backward accumulates ``sharded``'s gradient into: the shard's gradient
    carrier at stages 2 and 3, the low-precision replica at stage 1 under ``param_dtype``, else the
    parameter itself."""
    if sharded.stage != 1:
        return sharded.grad_target
    return sharded.replica if sharded.replica is not None else sharded.param


def _routed(inputs, for_grad: bool):
    """``inputs`` (a tensor or a sequence) with each zcompile parameter replaced by its autograd leaf;
    ``for_grad``: a parameter whose gradient is a shard is refused (module docstring)."""
    single = isinstance(inputs, torch.Tensor)
    listed = [inputs] if single else list(inputs)
    routed = []
    for tensor in listed:
        sharded = shard_of(tensor) if isinstance(tensor, torch.nn.Parameter) else None
        if sharded is not None and for_grad and sharded.stage != 1:
            raise ShardedParameterError(
                f"zcompile: torch.autograd.grad with respect to parameter {sharded.name!r} at ZeRO stage "
                f"{sharded.stage}: the compiled backward reduce-scatters its gradient onto this rank's shard, so no "
                f"tensor of the parameter's shape holds it. {AUTOGRAD_GRAD_FIX}"
            )
        routed.append(autograd_leaf(sharded) if sharded is not None else tensor)
    return routed[0] if single else routed


def install_autograd_route() -> None:
    """Wraps ``torch.autograd.backward`` and ``torch.autograd.grad`` (module docstring); idempotent."""
    if hasattr(torch.autograd.backward, ORIGINAL_ATTR):
        return
    original_backward, original_grad = torch.autograd.backward, torch.autograd.grad

    @functools.wraps(original_backward)
    def backward(*args, **kwargs):
        if kwargs.get("inputs") is not None:
            kwargs["inputs"] = _routed(kwargs["inputs"], for_grad=False)
        elif len(args) > 5 and args[5] is not None:  # inputs given by position
            args = (*args[:5], _routed(args[5], for_grad=False), *args[6:])
        return original_backward(*args, **kwargs)

    @functools.wraps(original_grad)
    def grad(outputs, inputs, *args, **kwargs):
        return original_grad(outputs, _routed(inputs, for_grad=True), *args, **kwargs)

    setattr(backward, ORIGINAL_ATTR, original_backward)
    setattr(grad, ORIGINAL_ATTR, original_grad)
    torch.autograd.backward, torch.autograd.grad = backward, grad
    log.info("zcompile: torch.autograd.backward(inputs=...) and torch.autograd.grad now route zcompile parameters")
