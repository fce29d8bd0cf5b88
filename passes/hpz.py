"""ZeRO++ hpZ: backward re-gathers the weights inside a small group, from a secondary partition.

Stage 3 re-gathers every parameter from all N ranks in backward. hpZ keeps, from the forward's
gather, a secondary copy of each weight sharded over K ranks (one node), and re-gathers from that
in backward, so the backward all-gather never crosses nodes. The secondary partition costs
``padded_numel / K`` elements per parameter in the gather dtype (2Ψ/K bytes for bf16), held from
forward to backward, and is taken from the newest weights at every forward, so it is fresh after
every optimizer step without communication of its own.

Two passes:

- ``hpz_pass`` (Dynamo graph, after ``insert_param_collectives``) replaces each stage-3
  ``gather_param`` by ``gather_flat`` (the world gather, whose backward reduce-scatters the
  gradient) -> ``hpz_secondary`` (this rank's 1/K slice, tagged ``MUST_SAVE``: the partitioner
  keeps it for backward) -> ``hpz_regather`` (gather of the slices over the K-rank group, tagged
  ``MUST_RECOMPUTE``: backward redoes it instead of saving the full weight).
- ``hpz_forward_shortcut_pass`` (the AOTAutograd forward graph): the forward does not need to
  gather over K what it just gathered over N; each ``hpz_regather`` gather there is replaced by
  the world gather's result it was sliced from. Only the backward keeps the K-rank gathers.
"""

from __future__ import annotations

import logging

import torch
from torch.utils.checkpoint import CheckpointPolicy

from zcompile.passes import metadata
from zcompile.passes.collectives import ALL_GATHER, CollectiveNode
from zcompile.passes.graph_ops import gather_flat, gather_param, hpz_regather, hpz_secondary
from zcompile.passes.op_sets import SHAPE_VIEWS, SLICE_VIEWS

log = logging.getLogger(__name__)

# what hpz_secondary traced into: a slice of the gathered buffer, cloned (not a re-ordering view)
_SLICING = SHAPE_VIEWS | SLICE_VIEWS | {torch.ops.aten.clone.default}


def hpz_pass(
    gm: torch.fx.GraphModule, hpz_size: int, hpz_rank: int, hpz_group_name: str | None
) -> torch.fx.GraphModule:
    """Splits every ``gather_param`` into world gather, secondary slice and hpZ re-gather (module docstring)."""
    graph = gm.graph
    gathers = graph.find_nodes(op="call_function", target=gather_param)
    for node in gathers:
        shard, numel, shape, world_size, group_name, param_dtype, reduce_dtype = node.args
        param = metadata.tags(node).get(metadata.PARAM)
        with graph.inserting_before(node):
            padded = graph.call_function(gather_flat, (shard, world_size, group_name, param_dtype, reduce_dtype))
            metadata.tag(padded, role=metadata.ROLE_GATHER, param=param)
            secondary = graph.call_function(hpz_secondary, (padded, hpz_size, hpz_rank))
            secondary.meta[metadata.RECOMPUTE] = CheckpointPolicy.MUST_SAVE
            metadata.tag(secondary, role=metadata.ROLE_HPZ_SECONDARY, param=param)
            full = graph.call_function(hpz_regather, (padded, secondary, numel, shape, hpz_size, hpz_group_name))
            full.meta[metadata.RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE
            metadata.tag(full, role=metadata.ROLE_HPZ_REGATHER, param=param)
        node.replace_all_uses_with(full)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    log.info("hpZ: %d parameters re-gathered in backward over %d ranks", len(gathers), hpz_size)
    return gm


def _sliced_from(node: torch.fx.Node) -> torch.fx.Node:
    """Walks back through clone/select/view nodes to the tensor they slice."""
    while node.op == "call_function" and node.target in _SLICING:
        node = node.args[0]
    return node


def hpz_forward_shortcut_pass(gm: torch.fx.GraphModule, hpz_group_name: str) -> torch.fx.GraphModule:
    """In a forward graph, replaces each hpZ re-gather by the world-gathered tensor it equals."""
    graph = gm.graph
    replaced = 0
    for gather in map(CollectiveNode.of, list(graph.find_nodes(op="call_function", target=ALL_GATHER))):
        if (
            gather.group_name != hpz_group_name
            or metadata.tags(gather.node).get(metadata.ROLE) != metadata.ROLE_HPZ_REGATHER
        ):
            continue
        wait = gather.wait
        source = _sliced_from(gather.input)
        got = source.meta.get("val")
        want = None if wait is None else wait.meta.get("val")
        if want is None or got is None or got.shape != want.shape or got.dtype != want.dtype:
            log.warning(
                "zcompile: hpZ re-gather %s is not a slice of a gathered tensor of its size; left in place",
                gather.node.name,
            )
            continue
        wait.replace_all_uses_with(source)
        graph.erase_node(wait)
        graph.erase_node(gather.node)
        replaced += 1
    graph.lint()
    gm.recompile()
    log.info("hpZ: %d forward re-gathers replaced by the world gather's result", replaced)
    return gm
