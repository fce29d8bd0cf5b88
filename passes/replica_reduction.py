"""Hybrid sharding: each gradient reduce-scatter's result all-reduced across the replicas.

With hybrid sharding the shards live in groups of S ranks, and the R groups hold the same shards. A
gradient reduce-scatter sums over this rank's shard group only; one all-reduce of what it returns
(a bucket's shard, after bucketing) over the replicate group, summed and divided by R, makes it the
sum over the S ranks averaged over the R groups: with the division by S that follows, the mean over
every rank. Only 1/S of the gradient bytes cross the groups.

The all-reduce is issued right after the reduce-scatter's wait and waited just before the first
node that reads the shard, so it runs beside whatever the schedule put between them (the rest of
the backward, the next buckets' reduce-scatters). It runs after the schedule, which places the
reduce-scatters and their waits, and before the all-to-all lowering, which keeps the wait's users.
"""

from __future__ import annotations

import logging

import torch

from zcompile.passes.collectives import ALL_REDUCE, WAIT, collective_nodes
from zcompile.passes.metadata import GROUP_SIZE, ROLE, ROLE_REPLICA_REDUCE, tag, tags

log = logging.getLogger(__name__)
aten = torch.ops.aten


def all_reduce_across_replicas_pass(gm: torch.fx.GraphModule, replicas: int, group_name: str) -> torch.fx.GraphModule:
    """After each ZeRO gradient reduce-scatter's wait ``w``: ``all_reduce(w, "sum", group_name)``; its
    wait and a division by ``replicas`` go just before ``w``'s first reader, and every reader reads the
    quotient instead (module docstring). Reads ``meta["val"]`` of the waits; writes ``meta["val"]`` on
    the new nodes, and ``ROLE = ROLE_REPLICA_REDUCE``, ``GROUP_SIZE`` (with the reduce-scatter's
    parameters) on the all-reduce."""
    graph = gm.graph
    position = {node: i for i, node in enumerate(graph.nodes)}
    reduced = 0
    for collective in collective_nodes(gm):
        if not collective.is_zero or collective.kind != "reduce_scatter" or len(collective.waits) != 1:
            continue
        (wait,) = collective.waits
        readers = sorted(wait.users, key=position.__getitem__)
        if not readers:
            continue
        value = wait.meta["val"]
        with graph.inserting_after(wait):
            all_reduce = graph.call_function(ALL_REDUCE, (wait, "sum", group_name))
        all_reduce.meta["val"] = value.new_empty(value.shape)
        inherited = {k: v for k, v in tags(collective.node).items() if k not in (ROLE, GROUP_SIZE)}
        tag(all_reduce, **inherited, **{ROLE: ROLE_REPLICA_REDUCE, GROUP_SIZE: replicas})
        with graph.inserting_before(readers[0]):
            arrived = graph.call_function(WAIT, (all_reduce,))
            mean = graph.call_function(aten.div.Tensor, (arrived, replicas))
        arrived.meta["val"] = all_reduce.meta["val"]
        mean.meta["val"] = value.new_empty(value.shape)
        for reader in readers:
            reader.replace_input_with(wait, mean)
        reduced += 1
    if reduced:
        log.info("all_reduce_across_replicas: %d reduced shards all-reduced over %d replicas", reduced, replicas)
    graph.lint()
    gm.recompile()
    return gm
