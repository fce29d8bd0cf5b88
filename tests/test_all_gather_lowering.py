"""all_gathers_into_buffers: gloo's form of the graphs' all-gathers (passes/all_gather_lowering.py)."""

import torch

from support.graph_builders import fake_process_group, trace
from support.hand_built import layered_graph
from zcompile.passes.all_gather_lowering import ALL_GATHER_OUT, all_gathers_into_buffers
from zcompile.passes.collectives import ALL_GATHER, WAIT

aten = torch.ops.aten


def test_each_gather_runs_into_a_buffer_of_its_output_shape_allocated_where_it_was_issued():
    gm = layered_graph(layers=3, shard=8, world=2)
    order_before = [n.name for n in gm.graph.nodes]
    all_gathers_into_buffers(gm)
    assert not gm.graph.find_nodes(op="call_function", target=ALL_GATHER)
    gathers = gm.graph.find_nodes(op="call_function", target=ALL_GATHER_OUT)
    assert len(gathers) == 3
    nodes = list(gm.graph.nodes)
    for i, gather in enumerate(gathers):
        buffer = gather.kwargs["out"]
        assert buffer.target is aten.empty.memory_format and buffer.args[0] == [16]
        assert nodes.index(buffer) == nodes.index(gather) - 1  # allocated at the issue, as the functional op does
        assert gather.args[0].name == f"shard{i}" and gather.args[1:] == (2, "0")
        (wait,) = gather.users
        assert wait.target is WAIT and wait.name == f"wait{i}"
    # everything else where it was: the gathers' places taken by buffer + gather
    assert [n for n in order_before if not n.startswith("gather")] == [
        n.name for n in nodes if n.target not in (ALL_GATHER_OUT, aten.empty.memory_format)]


def test_the_rewritten_graph_computes_what_the_graph_did():
    """Run on torch's fake process group of 2 ranks (an all-gather there repeats this rank's shard):
    the same values from the functional op and from the out= form."""
    with fake_process_group(world_size=2) as group:
        gm = trace(lambda shard: WAIT(ALL_GATHER(shard, 2, group)) * 2 + 1, torch.zeros(6))
        shard = torch.randn(6)
        expected = gm(shard)
        lowered = all_gathers_into_buffers(gm)
        assert lowered.graph.find_nodes(op="call_function", target=ALL_GATHER_OUT)
        torch.testing.assert_close(lowered(shard), expected, rtol=0, atol=0)
        torch.testing.assert_close(expected, shard.repeat(2) * 2 + 1, rtol=0, atol=0)


def test_the_front_end_rewrites_the_graph_it_runs_and_keeps_the_one_reports_read():
    """``boxed_graph_function(gm, rewrite)`` runs a rewritten copy: ``gm`` (dumps, step_report, the
    memory walks) keeps its all-gathers; the copy that runs gathers into buffers."""
    from zcompile.inner import boxed_graph_function

    with fake_process_group(world_size=2) as group:
        gm = trace(lambda shard: WAIT(ALL_GATHER(shard, 2, group)) * 2, torch.zeros(4))
        run = boxed_graph_function(gm, all_gathers_into_buffers)
        shard = torch.randn(4)
        torch.testing.assert_close(run([shard]), shard.repeat(2) * 2, rtol=0, atol=0)
    assert len(gm.graph.find_nodes(op="call_function", target=ALL_GATHER)) == 1
    assert not gm.graph.find_nodes(op="call_function", target=ALL_GATHER_OUT)
