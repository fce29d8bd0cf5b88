"""``gathered(model, grads=True)``: each parameter's ``.grad`` as DDP leaves it, for eager code.

Between backward and ``optimizer.step()`` zcompile keeps gradients where the step wants them, not
where DDP puts them: stages 2 and 3 hold this rank's slice of the gradient averaged over ranks on the
shard (``ShardedParam.shard_grad``; ``param.grad`` is None), and stage 1 holds the local gradient of
this rank's micro-batch, reduced by the step. Code that reads or edits ``param.grad`` (per-layer
gradient norms in a logger, gradient surgery, a hand-written clip) would read None, or a gradient
that is not the one the step applies.

Inside ``gathered(model, grads=True)`` every sharded parameter that has a gradient holds the full
gradient averaged over ranks in ``.grad``, in the parameter's dtype. It is made the way clipping
makes it (``optim.clip.averaged_grad_shards``): stage 1's local gradients are reduce-scattered onto the
shards now, bucketed and averaged as the step would (the step then does not reduce them again),
and every averaged shard is all-gathered into a full ``.grad``, a tensor of its own. On leaving,
with ``writeback`` (the default) what ``.grad`` holds then, edits included, becomes the averaged
shard the step applies (None drops the parameter's gradient: the step skips it, as torch's
optimizers do); without, the shards are left as they were. ``.grad`` is None again either way.
"""

from __future__ import annotations

import torch

from zcompile.optim.clip import TORCH_ROUTE_BUCKET_BYTES, averaged_grad_shards, keep_records_for_step
from zcompile.sharding.shards import ShardedParam


def grad_layout(members: list[ShardedParam]) -> list[bool]:
    """Which members hold a gradient on this rank: every rank must agree before the collectives."""
    return [m.shard_grad is not None or m.full_grad is not None for m in members]


def enter(members: list[ShardedParam]) -> list[ShardedParam]:
    """Puts each member's averaged full gradient on ``param.grad`` (collective; every rank, the same
    members with gradients). Returns the members that have one."""
    with_grad, records = averaged_grad_shards(members, TORCH_ROUTE_BUCKET_BYTES)
    keep_records_for_step(with_grad, records)
    for m in with_grad:
        gathered = m.all_gathered(m.shard_grad.detach().to(torch.float32))
        m.param.grad = gathered[: m.numel].view(m.shape).to(m.param.dtype, copy=True)
    return with_grad


def leave(with_grad: list[ShardedParam], writeback: bool) -> None:
    """Undoes ``enter``: with ``writeback`` the ``.grad`` found now becomes the averaged shard the
    step applies (this rank's slice of it); ``param.grad`` is None again."""
    for m in with_grad:
        grad, m.param.grad = m.param.grad, None
        if not writeback:
            continue
        if grad is None:
            m.shard_grad = None
        else:
            m.shard_grad = m.padded_flat(grad, torch.float32)[m.shard_offset : m.shard_offset + m.shard_numel].clone()
