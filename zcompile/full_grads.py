"""``gathered(model, grads=True)``: each parameter's ``.grad`` as DDP leaves it, for eager code.

Between backward and ``optimizer.step()`` zcompile keeps gradients where the step wants them, not
where DDP puts them: stages 2 and 3 hold this rank's slice of the gradient averaged over ranks on the
shard (``ShardedParam.shard_grad``; ``param.grad`` is None), and stage 1 holds the local gradient of
this rank's micro-batch, reduced by the step. Code that reads or edits ``param.grad`` (per-layer
gradient norms in a logger, gradient surgery, a hand-written clip) would read None, or a gradient
that is not the one the step applies. Inside ``gathered(model, grads=True)`` every sharded
parameter that has a gradient holds the full gradient averaged over ranks in ``.grad``, in the
parameter's dtype (collectives: an all-gather of the averaged shards, an all-reduce of stage 1's
local gradients). On leaving, with ``writeback`` (the default) what ``.grad`` holds then, edits
included, is the gradient the step applies: this rank's slice goes back onto the shard, stage 1's
too (so the step does not reduce it again, as after a clip), and ``.grad`` is None again; without
``writeback`` the gradients are left as they were. A ``.grad`` set to None inside drops that
parameter's gradient (the step skips it, as torch's optimizers do).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from zcompile.param_shards import ShardedParam
from zcompile.process_group import all_gather_eager, all_reduce_eager


@dataclass
class _Saved:
    """What a member held before ``enter``: restored on a leave without write-back."""

    sharded: ShardedParam
    param_grad: torch.Tensor | None
    replica_grad: torch.Tensor | None
    shard_grad: torch.Tensor | None


def grad_layout(members: list[ShardedParam]) -> list[bool]:
    """Which members hold a gradient on this rank: every rank must agree before the collectives."""
    return [m.shard_grad is not None or m.full_grad is not None for m in members]


def enter(members: list[ShardedParam]) -> list[_Saved]:
    """Puts each member's averaged full gradient on ``param.grad`` (collective; every rank, the same
    members with gradients). Returns what to restore."""
    saved = []
    for m in members:
        before = _Saved(m, m.param.grad, m.replica.grad if m.replica is not None else None, m.shard_grad)
        if m.shard_grad is None and m.full_grad is None:
            continue
        saved.append(before)
        full = _averaged_full_grad(m)
        if m.replica is not None:
            m.replica.grad = None
        m.param.grad = full
    return saved


def leave(saved: list[_Saved], writeback: bool) -> None:
    """Undoes ``enter``: with ``writeback`` the ``.grad`` found now becomes the gradient the step
    applies (this rank's slice on the shard); without, the gradients held before come back."""
    for before in saved:
        m = before.sharded
        grad = m.param.grad
        m.param.grad = None
        if m.replica is not None:
            m.replica.grad = None
        if not writeback:
            m.param.grad, m.shard_grad = before.param_grad, before.shard_grad
            if m.replica is not None:
                m.replica.grad = before.replica_grad
            continue
        if grad is None:
            m.shard_grad = None
            continue
        flat = m.padded_flat(grad, torch.float32)
        m.shard_grad = flat[m.shard_offset: m.shard_offset + m.shard_numel].clone()


def _averaged_full_grad(m: ShardedParam) -> torch.Tensor:
    """``m``'s gradient averaged over its group, full and in the parameter's shape and dtype: the
    averaged shards gathered, plus any local full gradient (stage 1's; at stages 2 and 3 one from
    eager code) all-reduced and divided by N, as the step would reduce it."""
    world = m.group.world_size
    total = torch.zeros(m.numel, dtype=torch.float32, device=m.shard.device)
    if m.shard_grad is not None:
        shard = m.shard_grad.detach().to(torch.float32)
        if world > 1:
            padded = torch.empty(m.padded_numel, dtype=torch.float32, device=shard.device)
            all_gather_eager(padded, shard.contiguous(), m.group)
        else:
            padded = shard
        total += padded[: m.numel]
    if m.full_grad is not None:
        local = m.full_grad.detach().reshape(-1).to(torch.float32, copy=True)
        if world > 1:
            all_reduce_eager(local, m.group, dist.ReduceOp.SUM)
            local.mul_(1.0 / world)
        total += local
    return total.view(m.shape).to(m.param.dtype)
