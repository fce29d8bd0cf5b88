"""detach_collective_inputs_pass: collectives read graph inputs through a detach, nothing else changes."""

import torch

from support.hand_built import layered_graph
from zcompile.passes.collective_inputs import detach_collective_inputs_pass, detached_input_positions
from zcompile.passes.collectives import collective_nodes

aten = torch.ops.aten


def test_gathers_of_graph_inputs_read_a_detach_and_other_collectives_are_untouched():
    gm = layered_graph(layers=3)
    before = {c.node.name: c.input.name for c in collective_nodes(gm)}
    assert before == {"gather0": "shard0", "gather1": "shard1", "gather2": "shard2", "reduce": "layer2"}
    detach_collective_inputs_pass(gm)
    for collective in collective_nodes(gm):
        source = collective.input
        if collective.kind == "all_gather":
            assert source.target is aten.detach.default and source.args[0].name == before[collective.node.name]
            assert source.meta["val"].shape == source.args[0].meta["val"].shape
        else:  # an intermediate value (no grad inside the graph): read as it is
            assert source.name == "layer2"
    assert len(gm.graph.find_nodes(op="call_function", target=aten.detach.default)) == 3


def test_a_graph_input_read_by_two_collectives_is_detached_once():
    gm = layered_graph(layers=2)
    shard0 = next(n for n in gm.graph.nodes if n.name == "shard0")
    gather1 = next(n for n in gm.graph.nodes if n.name == "gather1")
    gather1.replace_input_with(gather1.args[0], shard0)  # both gathers read shard0
    detach_collective_inputs_pass(gm)
    detaches = gm.graph.find_nodes(op="call_function", target=aten.detach.default)
    assert len(detaches) == 1 and set(detaches[0].users) == {n for n in gm.graph.nodes if n.name.startswith("gather")}


def test_the_detached_input_is_an_alias_without_grad():
    """What the pass relies on at run time: aten.detach of a leaf that requires grad shares its storage
    and carries no autograd state."""
    leaf = torch.randn(8, requires_grad=True)
    alias = aten.detach.default(leaf)
    assert alias.data_ptr() == leaf.data_ptr() and not alias.requires_grad and alias.grad_fn is None


def test_detached_input_positions_are_the_placeholders_a_collective_reads():
    """What the front end detaches under inductor (which erases the graph's detach): the gathered
    shards' positions among the placeholders (x is 0 and is read by compute only)."""
    gm = layered_graph(layers=3)
    assert detached_input_positions(gm) == []
    detach_collective_inputs_pass(gm)
    assert detached_input_positions(gm) == [1, 2, 3]
