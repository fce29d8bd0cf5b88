"""Hand-built aten graphs with collectives, every node carrying a fake ``meta["val"]``."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from support.graph_builders import as_zero_collectives
from zcompile.passes.collectives import ALL_GATHER, REDUCE_SCATTER, WAIT

aten = torch.ops.aten


def layered_graph(layers=3, shard=8, world=2):
    """x -> for each layer: all-gather(shard_i) -> wait -> mul(x, w_i); then a reduce-scatter of x."""
    mode = FakeTensorMode()
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    shards = [graph.placeholder(f"shard{i}") for i in range(layers)]
    with mode:
        x.meta["val"] = torch.empty(shard * world)
        for s in shards:
            s.meta["val"] = torch.empty(shard)
    for i, s in enumerate(shards):
        gather = graph.call_function(ALL_GATHER, (s, world, "0"), name=f"gather{i}")
        wait = graph.call_function(WAIT, (gather,), name=f"wait{i}")
        x = graph.call_function(aten.mul.Tensor, (x, wait), name=f"layer{i}")
        with mode:
            gather.meta["val"] = wait.meta["val"] = x.meta["val"] = torch.empty(shard * world)
    reduce = graph.call_function(REDUCE_SCATTER, (x, "sum", world, "0"), name="reduce")
    reduce_wait = graph.call_function(WAIT, (reduce,), name="reduce_wait")
    tail = graph.call_function(aten.mul.Tensor, (x, 2.0), name="tail")  # compute after the gradient is ready
    with mode:
        reduce.meta["val"] = reduce_wait.meta["val"] = torch.empty(shard)
        tail.meta["val"] = torch.empty(shard * world)
    graph.output((reduce_wait, tail))
    return as_zero_collectives(torch.fx.GraphModule(torch.nn.Module(), graph))


def reduce_chain_graph(buckets=4, shard=8, world=2):
    """A backward's shape: ``g = x``, then per bucket ``g = g * 2`` (its gradients) -> reduce-scatter(g)
    -> wait, each wait right after its collective; the waits are the outputs."""
    mode = FakeTensorMode()
    graph = torch.fx.Graph()
    g = graph.placeholder("x")
    with mode:
        g.meta["val"] = torch.empty(shard * world)
    waits = []
    for i in range(buckets):
        g = graph.call_function(aten.mul.Tensor, (g, 2.0), name=f"grad{i}")
        reduce = graph.call_function(REDUCE_SCATTER, (g, "sum", world, "0"), name=f"reduce{i}")
        waits.append(graph.call_function(WAIT, (reduce,), name=f"reduce_wait{i}"))
        with mode:
            g.meta["val"] = torch.empty(shard * world)
            reduce.meta["val"] = waits[-1].meta["val"] = torch.empty(shard)
    graph.output(tuple(waits))
    return as_zero_collectives(torch.fx.GraphModule(torch.nn.Module(), graph))
