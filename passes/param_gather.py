"""A stage-3 parameter's gather, traced as one op and written out as the collective after the partition.

At stage 3 each parameter reaches the graph through ``graph_ops.gather_param``: its shard cast to
the gather dtype, all-gathered, waited, cut to the parameter's length and viewed to its shape.
Traced by AOTAutograd that is 3-5 ops a parameter, each dispatched through functionalization,
proxy and fake tensors twice (metadata collection, then the joint trace; the all-gather through
the functional collectives' own autograd wrapper as well), then carried through inductor's
joint-graph pattern passes and the min-cut partitioner, which recomputes the whole chain in the
backward (the gathers are tagged ``MUST_RECOMPUTE``). For a model of many parameters that is the
largest part of what stage 3 adds to a compile.

So ``gather_param`` calls ``zcompile::gather_shards`` instead: one node through the trace, the
joint passes and the partition, which recomputes it in the backward as it did the chain (the op
carries the chain's ``MUST_RECOMPUTE`` tag, and keep-gathered lifts it the same way).
``expand_param_gathers_pass``, the first pass on every partitioned graph, writes each one out as
the nodes the trace would have made, with the op's tags, so every later pass (bucketing, qwZ, the
schedule, cross-call prefetch, the all-gather lowering), report and rank check reads the
all-gathers as before. The op's own kernel runs the same steps eagerly, so a graph that kept it
would still train right.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from zcompile.passes.collectives import ALL_GATHER, WAIT, all_gather_in_graph
from zcompile.passes.grad_reduction import padded_numel
from zcompile.passes.inline import AddNode, write_out_calls

log = logging.getLogger(__name__)
aten = torch.ops.aten
prims = torch.ops.prims


@torch.library.custom_op("zcompile::gather_shards", mutates_args=())
def gather_shards(
    shard: torch.Tensor, numel: int, shape: Sequence[int], world_size: int, group_name: str, gather_dtype: torch.dtype
) -> torch.Tensor:
    """The parameter of ``numel`` elements and ``shape`` in ``gather_dtype``, every one of the
    ``world_size`` (> 1) ranks' flat ``shard`` all-gathered and the padding cut off."""
    if shard.dtype != gather_dtype:
        shard = shard.to(gather_dtype)
    full = all_gather_in_graph(shard, world_size, group_name)
    return (full if full.numel() == numel else full[:numel]).view(shape)  # a view of the gather's new tensor


@gather_shards.register_fake
def _gather_shards_fake(
    shard: torch.Tensor, numel: int, shape: Sequence[int], world_size: int, group_name: str, gather_dtype: torch.dtype
) -> torch.Tensor:
    return shard.new_empty(tuple(shape), dtype=gather_dtype)


GATHER_SHARDS = torch.ops.zcompile.gather_shards.default


def gather_shards_bytes(node: torch.fx.Node) -> tuple[int, int]:
    """(bytes the gather's buffer holds: the padded parameter in the gather dtype; its group's size)
    of a ``zcompile::gather_shards`` node: what its all-gather will be once written out."""
    _, numel, _, world_size, _, gather_dtype = node.args
    return padded_numel(numel, world_size) * gather_dtype.itemsize, world_size


def _write_out(
    add: AddNode,
    shard: torch.fx.Node,
    numel: int,
    shape: Sequence[int],
    world_size: int,
    group_name: str,
    gather_dtype: torch.dtype,
) -> torch.fx.Node:
    flat = shard
    if shard.meta["val"].dtype != gather_dtype:
        flat = add(prims.convert_element_type.default, [flat, gather_dtype])
    full = add(WAIT, [add(ALL_GATHER, [flat, world_size, group_name])])
    if padded_numel(numel, world_size) != numel:
        full = add(aten.slice.Tensor, [full, 0, 0, numel])
    # a 1-D parameter is the flat piece itself: no identity view for drop_identity_views to remove
    if tuple(shape) != (numel,):
        full = add(aten.view.default, [full, list(shape)])
    return full


def expand_param_gathers_pass(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrites each ``zcompile::gather_shards`` into the ops it stands for (module docstring):
    [cast] all-gather, wait [slice] [view], in place, with the op's metadata (zcompile's role and
    parameter tags, the recompute tag) on each. Reads ``meta["val"]`` of the shards; writes
    ``meta["val"]`` on every inserted node, from the graph's fake mode."""
    written = write_out_calls(gm, GATHER_SHARDS, _write_out)
    if written:
        log.info("expand_param_gathers: %d parameter gathers written out as all-gathers", written)
    return gm
