"""remove_unused_gathers_pass on hand-built aten graphs."""

import torch

from zcompile.passes.cleanup import remove_unused_gathers_pass
from zcompile.passes.collectives import ALL_GATHER, WAIT

aten = torch.ops.aten


def _gather_chain(graph, shard, numel=6, shape=(2, 3)):
    gathered = graph.call_function(ALL_GATHER, (shard, 2, "0"))
    waited = graph.call_function(WAIT, (gathered,))
    sliced = graph.call_function(aten.slice.Tensor, (waited, 0, 0, numel))
    return graph.call_function(aten.view.default, (sliced, list(shape)))


def test_size_only_gather_is_removed_and_size_folded():
    graph = torch.fx.Graph()
    shard = graph.placeholder("shard")
    x = graph.placeholder("x")
    weight = _gather_chain(graph, shard)
    size = graph.call_function(aten.sym_size.int, (weight, 0))
    size.meta["val"] = 2
    out = graph.call_function(aten.mul.Tensor, (x, size))
    graph.output((out,))
    gm = remove_unused_gathers_pass(torch.fx.GraphModule(torch.nn.Module(), graph))
    assert not gm.graph.find_nodes(op="call_function", target=ALL_GATHER)
    assert not gm.graph.find_nodes(op="call_function", target=WAIT)
    assert torch.equal(gm(torch.zeros(3), torch.ones(4))[0], torch.full((4,), 2.0))


def test_unused_gather_is_removed():
    graph = torch.fx.Graph()
    shard = graph.placeholder("shard")
    _gather_chain(graph, shard)
    graph.output((shard,))
    gm = remove_unused_gathers_pass(torch.fx.GraphModule(torch.nn.Module(), graph))
    assert len(list(gm.graph.nodes)) == 2


def test_gather_whose_data_is_read_is_kept():
    graph = torch.fx.Graph()
    shard = graph.placeholder("shard")
    x = graph.placeholder("x")
    weight = _gather_chain(graph, shard)
    graph.output((graph.call_function(aten.mm.default, (x, weight)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    code = gm.code
    assert remove_unused_gathers_pass(gm).code == code
