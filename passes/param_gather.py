"""A stage-3 parameter's gather, traced as one op and written out as the collective after the partition.

At stage 3 each parameter reaches the graph through ``graph_ops.gather_param``: its shard cast to
the gather dtype, all-gathered, waited, cut to the parameter's length and viewed to its shape.
Traced by AOTAutograd that is 3-5 ops a parameter, each dispatched through functionalization,
proxy and fake tensors twice (metadata collection, then the joint trace; the all-gather through
the functional collectives' own autograd wrapper as well), then carried through inductor's
joint-graph pattern passes and the min-cut partitioner, which recomputes the whole chain in the
backward (the gathers are tagged ``MUST_RECOMPUTE``). On the 16-layer example GPT that is 196
parameters, and the gathers' share of a warm stage-3 compile was the largest thing stage 3 adds.

So ``gather_param`` calls ``zcompile::gather_shards`` instead: one node through the trace, the
joint passes and the partition, which recomputes it in the backward as it did the chain (the op
carries the chain's ``MUST_RECOMPUTE`` tag, and keep-gathered lifts it the same way).
``expand_param_gathers_pass``, the first pass on every partitioned graph, writes each one out as
the nodes the trace used to make, with the op's tags, so every later pass (bucketing, qwZ, the
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
from zcompile.passes.inline import graph_fake_mode

log = logging.getLogger(__name__)
aten = torch.ops.aten
prims = torch.ops.prims


@torch.library.custom_op("zcompile::gather_shards", mutates_args=())
def gather_shards(shard: torch.Tensor, numel: int, shape: Sequence[int], world_size: int, group_name: str,
                  gather_dtype: torch.dtype) -> torch.Tensor:
    """The parameter of ``numel`` elements and ``shape`` in ``gather_dtype``, every one of the
    ``world_size`` (> 1) ranks' flat ``shard`` all-gathered and the padding cut off."""
    if shard.dtype != gather_dtype:
        shard = shard.to(gather_dtype)
    full = all_gather_in_graph(shard, world_size, group_name)
    return (full if full.numel() == numel else full[:numel]).view(shape)  # a view of the gather's new tensor


@gather_shards.register_fake
def _gather_shards_fake(shard: torch.Tensor, numel: int, shape: Sequence[int], world_size: int, group_name: str,
                        gather_dtype: torch.dtype) -> torch.Tensor:
    return shard.new_empty(tuple(shape), dtype=gather_dtype)


GATHER_SHARDS = torch.ops.zcompile.gather_shards.default


def gather_shards_bytes(node: torch.fx.Node) -> tuple[int, int]:
    """(bytes the gather's buffer holds: the padded parameter in the gather dtype; its group's size)
    of a ``zcompile::gather_shards`` node: what its all-gather will be once written out."""
    _, numel, _, world_size, _, gather_dtype = node.args
    return padded_numel(numel, world_size) * gather_dtype.itemsize, world_size


def _expand(graph: torch.fx.Graph, node: torch.fx.Node, fake_mode) -> None:
    shard, numel, shape, world_size, group_name, gather_dtype = node.args
    # zcompile's tags, the stack trace, seq_nr, the partitioner's tag; not what describes the op's own output
    meta = {key: value for key, value in node.meta.items() if key not in ("val", "tensor_meta", "original_aten")}

    def add(target, args) -> torch.fx.Node:
        made = graph.call_function(target, tuple(args))
        made.meta.update(meta)
        values = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
        with fake_mode:
            made.meta["val"] = target(*values)
        return made

    with graph.inserting_before(node):
        flat = shard
        if shard.meta["val"].dtype != gather_dtype:
            flat = add(prims.convert_element_type.default, [flat, gather_dtype])
        full = add(WAIT, [add(ALL_GATHER, [flat, world_size, group_name])])
        if padded_numel(numel, world_size) != numel:
            full = add(aten.slice.Tensor, [full, 0, 0, numel])
        # a 1-D parameter is the flat piece itself: no identity view for drop_identity_views to remove
        if tuple(shape) != (numel,):
            full = add(aten.view.default, [full, list(shape)])
    node.replace_all_uses_with(full)
    graph.erase_node(node)


def expand_param_gathers_pass(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrites each ``zcompile::gather_shards`` into the ops it stands for (module docstring):
    [cast] all-gather, wait [slice] [view], in place, with the op's metadata (zcompile's role and
    parameter tags, the recompute tag) on each. Reads ``meta["val"]`` of the shards; writes
    ``meta["val"]`` on every inserted node, from the graph's fake mode."""
    gathers = gm.graph.find_nodes(op="call_function", target=GATHER_SHARDS)
    if not gathers:
        return gm
    fake_mode = graph_fake_mode(gm)
    for node in gathers:
        _expand(gm.graph, node, fake_mode)
    log.info("expand_param_gathers: %d parameter gathers written out as all-gathers", len(gathers))
    gm.graph.lint()
    gm.recompile()
    return gm
