"""A parameter's gradient reduction, traced as one op and written out as the collectives before any pass reads it.

At stages 2 and 3 each parameter's gradient is averaged over the ranks and cut to this rank's
shard in the backward graph (``graph_ops``' autograd functions): flattened, padded to a multiple of
the group size, cast to the reduce dtype, reduce-scattered, waited, divided by the group size, cast
to the shard's dtype. Traced by AOTAutograd that is 3-6 ops a parameter, each dispatched through
functionalization, proxy and fake tensors, and then carried through inductor's joint-graph pattern
passes and the min-cut partitioner, all of whose costs grow with the joint graph's nodes: for a
model of many parameters, a large share of the compile.

So the autograd functions call ``zcompile::reduce_grad_to_shard`` instead: one node through the
trace, the partition and the joint passes. ``expand_grad_reductions_pass``, the first pass on a
backward graph, writes each one out as those ops, the nodes the trace would have made, so that every
later pass (bucketing, qgZ, the schedule, the all-to-all lowering), report and rank check reads
the reduce-scatters as before. The op's own kernel runs the same steps eagerly, so a graph that
kept it would still train right.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from zcompile.passes.collectives import REDUCE_SCATTER, WAIT, reduce_scatter_in_graph
from zcompile.passes.inline import AddNode, write_out_calls

log = logging.getLogger(__name__)
aten = torch.ops.aten
prims = torch.ops.prims


def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``world_size``: the flat length every rank's shard divides."""
    return -(-numel // world_size) * world_size


def reduce_padded_grad(
    flat: torch.Tensor,
    world_size: int,
    group_name: str | None,
    reduce_dtype: torch.dtype | None,
    shard_dtype: torch.dtype,
) -> torch.Tensor:
    """Mean over ranks of a flat gradient already padded to a multiple of ``world_size``: this rank's
    shard (traceable; hpZ's flat parameters and one-rank groups trace it as it is)."""
    if reduce_dtype is not None and flat.dtype != reduce_dtype:
        flat = flat.to(reduce_dtype)
    if world_size > 1:
        flat = reduce_scatter_in_graph(flat, world_size, group_name) / world_size
    return flat.to(shard_dtype)


@torch.library.custom_op("zcompile::reduce_grad_to_shard", mutates_args=())
def reduce_grad_to_shard(
    grad: torch.Tensor,
    numel: int,
    world_size: int,
    group_name: str,
    reduce_dtype: torch.dtype | None,
    shard_dtype: torch.dtype,
) -> torch.Tensor:
    """Mean over the ``world_size`` (> 1) ranks of ``grad`` (a parameter's whole, dense gradient), as this
    rank's flat shard of ``padded_numel / world_size`` elements in ``shard_dtype``, reduced in
    ``reduce_dtype`` (None: the gradient's own)."""
    flat = grad.reshape(-1)
    padding = padded_numel(numel, world_size) - numel
    if padding:
        flat = F.pad(flat, (0, padding))
    return reduce_padded_grad(flat, world_size, group_name, reduce_dtype, shard_dtype)  # the collective's new tensor


@reduce_grad_to_shard.register_fake
def _reduce_grad_to_shard_fake(
    grad: torch.Tensor,
    numel: int,
    world_size: int,
    group_name: str,
    reduce_dtype: torch.dtype | None,
    shard_dtype: torch.dtype,
) -> torch.Tensor:
    return grad.new_empty(padded_numel(numel, world_size) // world_size, dtype=shard_dtype)


REDUCE_GRAD_TO_SHARD = torch.ops.zcompile.reduce_grad_to_shard.default


def _write_out(
    add: AddNode,
    grad: torch.fx.Node,
    numel: int,
    world_size: int,
    group_name: str,
    reduce_dtype: torch.dtype | None,
    shard_dtype: torch.dtype,
) -> torch.fx.Node:
    flat, value = grad, grad.meta["val"]
    if not value.is_contiguous():  # what reshape traces to for a tensor no view can flatten
        flat = add(aten.clone.default, [flat], {"memory_format": torch.contiguous_format})
    if value.dim() != 1:
        flat = add(aten.view.default, [flat, [numel]])
    padding = padded_numel(numel, world_size) - numel
    if padding:
        flat = add(aten.constant_pad_nd.default, [flat, [0, padding], 0.0])
    if reduce_dtype is not None and value.dtype != reduce_dtype:
        flat = add(prims.convert_element_type.default, [flat, reduce_dtype])
    reduced = add(WAIT, [add(REDUCE_SCATTER, [flat, "sum", world_size, group_name])])
    shard = add(aten.div.Tensor, [reduced, world_size])
    if shard.meta["val"].dtype != shard_dtype:
        shard = add(prims.convert_element_type.default, [shard, shard_dtype])
    return shard


def expand_grad_reductions_pass(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrites each ``zcompile::reduce_grad_to_shard`` into the ops it stands for (module docstring):
    [clone] [view] [pad] [cast] reduce-scatter, wait, divide [cast], in place, with the op's metadata
    (zcompile's role and parameter tags) on each. Reads ``meta["val"]`` of the gradients; writes
    ``meta["val"]`` on every inserted node, from the graph's fake mode."""
    written = write_out_calls(gm, REDUCE_GRAD_TO_SHARD, _write_out)
    if written:
        log.info("expand_grad_reductions: %d gradient reductions written out as reduce-scatters", written)
    return gm
