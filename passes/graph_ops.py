"""Differentiable sharded-parameter ops that the passes insert into Dynamo graphs.

AOTAutograd traces through these ``autograd.Function``s, so the forward graph gets their
all-gathers and the backward graph their reduce-scatters; gradients flow to the fp32 shard,
which is the leaf the optimizer updates. They are plain module-level functions (not
``Function.apply``) so that FX code generation can name them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zcompile.passes.collectives import all_gather_in_graph
from zcompile.passes.grad_reduction import reduce_grad_to_shard, reduce_padded_grad
from zcompile.passes.param_gather import gather_shards


def _reduce_flat_grad(
    grad: torch.Tensor,
    numel: int,
    world_size: int,
    group_name: str | None,
    reduce_dtype: torch.dtype | None,
    shard_dtype: torch.dtype,
) -> torch.Tensor:
    """Mean over ranks of ``grad`` (full shape), returned as this rank's flat shard. A sparse gradient
    (``nn.Embedding(sparse=True)``) is made dense first: shards are cut from the dense layout, and the
    dense gradient is what the update reads (the values a dense embedding's gradient has)."""
    if grad.layout != torch.strided:
        grad = grad.to_dense()
    if world_size > 1:  # one node through AOTAutograd, written out by the first backward pass (grad_reduction)
        return reduce_grad_to_shard(grad, numel, world_size, group_name, reduce_dtype, shard_dtype)
    return reduce_padded_grad(grad.reshape(-1), world_size, group_name, reduce_dtype, shard_dtype)


class _GatherParam(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, numel, shape, world_size, group_name, param_dtype, reduce_dtype):
        ctx.static = (numel, world_size, group_name, reduce_dtype, shard.dtype)
        if world_size > 1:  # one node through AOTAutograd, written out after the partition (param_gather)
            return gather_shards(shard, numel, shape, world_size, group_name, param_dtype or shard.dtype)
        if param_dtype is not None and shard.dtype != param_dtype:
            shard = shard.to(param_dtype)
        return shard.view(shape)

    @staticmethod
    def backward(ctx, grad):
        numel, world_size, group_name, reduce_dtype, shard_dtype = ctx.static
        grad_shard = _reduce_flat_grad(grad, numel, world_size, group_name, reduce_dtype, shard_dtype)
        return grad_shard, None, None, None, None, None, None


class _GatherFlat(torch.autograd.Function):
    """hpZ, first half: the padded flat parameter gathered from every rank (the forward's weights)."""

    @staticmethod
    def forward(ctx, shard, world_size, group_name, param_dtype, reduce_dtype):
        ctx.static = (world_size, group_name, reduce_dtype, shard.dtype)
        if param_dtype is not None and shard.dtype != param_dtype:
            shard = shard.to(param_dtype)
        return all_gather_in_graph(shard, world_size, group_name) if world_size > 1 else shard

    @staticmethod
    def backward(ctx, grad_padded):
        world_size, group_name, reduce_dtype, shard_dtype = ctx.static
        return (
            reduce_padded_grad(grad_padded, world_size, group_name, reduce_dtype, shard_dtype),
            None,
            None,
            None,
            None,
        )


class _HpzRegather(torch.autograd.Function):
    """hpZ, second half: the parameter gathered from the secondary partition, inside its small group.

    Its value equals ``padded`` (the secondary partition is a slice of it), so its gradient goes
    to ``padded`` unchanged; ``secondary`` gets none. In the forward graph a pass replaces this
    gather by ``padded`` itself; what remains is the backward's re-gather (see ``passes/hpz.py``).
    """

    @staticmethod
    def forward(ctx, padded, secondary, numel, shape, hpz_size, hpz_group_name):
        ctx.static = (padded.numel(),)
        full = all_gather_in_graph(secondary, hpz_size, hpz_group_name) if hpz_size > 1 else secondary
        return full[:numel].view(shape)

    @staticmethod
    def backward(ctx, grad):
        (padded_numel,) = ctx.static
        flat = grad.reshape(-1)
        if padded_numel > flat.numel():
            flat = F.pad(flat, (0, padded_numel - flat.numel()))
        return flat, None, None, None, None, None


class _ReplicatedParam(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, full, numel, world_size, group_name, param_dtype, reduce_dtype):
        ctx.static = (numel, world_size, group_name, reduce_dtype, shard.dtype)
        if param_dtype is not None and full.dtype != param_dtype:
            return full.to(param_dtype)
        return full.view_as(full)

    @staticmethod
    def backward(ctx, grad):
        numel, world_size, group_name, reduce_dtype, shard_dtype = ctx.static
        grad_shard = _reduce_flat_grad(grad, numel, world_size, group_name, reduce_dtype, shard_dtype)
        return grad_shard, None, None, None, None, None, None


def gather_param(
    shard: torch.Tensor,
    numel: int,
    shape: tuple[int, ...],
    world_size: int,
    group_name: str | None,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
) -> torch.Tensor:
    """Stage 3: the full parameter, all-gathered from every rank's shard.

    Backward reduce-scatters the gradient and averages it over ranks (as DDP does), so the
    gradient arrives on ``shard.grad`` already sharded.
    """
    return _GatherParam.apply(shard, numel, tuple(shape), world_size, group_name, param_dtype, reduce_dtype)


def replicated_param(
    shard: torch.Tensor,
    full: torch.Tensor,
    numel: int,
    world_size: int,
    group_name: str | None,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
) -> torch.Tensor:
    """Stage 2: the replicated full parameter in forward; its gradient reduce-scattered onto the shard."""
    return _ReplicatedParam.apply(shard, full, numel, world_size, group_name, param_dtype, reduce_dtype)


def gather_flat(
    shard: torch.Tensor,
    world_size: int,
    group_name: str | None,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
) -> torch.Tensor:
    """hpZ: every rank's shard concatenated (padded, flat); backward reduce-scatters and averages."""
    return _GatherFlat.apply(shard, world_size, group_name, param_dtype, reduce_dtype)


def hpz_secondary(padded: torch.Tensor, hpz_size: int, hpz_rank: int) -> torch.Tensor:
    """This rank's 1/hpz_size slice of the gathered parameter: what backward re-gathers from."""
    return padded.view(hpz_size, -1)[hpz_rank].clone()


def hpz_regather(
    padded: torch.Tensor,
    secondary: torch.Tensor,
    numel: int,
    shape: tuple[int, ...],
    hpz_size: int,
    hpz_group_name: str | None,
) -> torch.Tensor:
    """hpZ: the full parameter, gathered over the hpZ group from the secondary partitions."""
    return _HpzRegather.apply(padded, secondary, numel, tuple(shape), hpz_size, hpz_group_name)
