"""The sharding planner and rewrite on hand-built FX graphs (no processes)."""

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from support.graph_builders import linear_graph
from zcompile.passes import metadata
from zcompile.passes.graph_ops import gather_param, replicated_param
from zcompile.passes.param_collectives import insert_param_collectives_pass, param_name_from_source, plan_sharding


def _plan(gm, inputs, stage):
    return plan_sharding(gm, inputs, stage, 1, None, None, None)


def test_plan_lists_parameter_inputs_only():
    gm, inputs = linear_graph()
    plan = _plan(gm, inputs, 3)
    assert [(p.index, p.shape) for p in plan.params] == [(0, (3, 5)), (2, (3,))]
    assert '"stage": 3' in plan.to_json()


def test_stage3_replaces_parameters_by_shards_and_one_gather_each():
    gm, inputs = linear_graph()
    expected = gm(*inputs)[0]
    gm = insert_param_collectives_pass(gm, _plan(gm, inputs, 3))
    placeholders = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    assert placeholders == ["weight_shard", "x", "bias_shard"]
    gathers = gm.graph.find_nodes(op="call_function", target=gather_param)
    assert len(gathers) == 2  # weight used twice, gathered once
    for node in gathers:
        assert node.meta[metadata.RECOMPUTE] == CheckpointPolicy.MUST_RECOMPUTE
        assert metadata.tags(node)["role"] == metadata.ROLE_GATHER
    # In a world of one the shard is the flattened parameter: same result as before the rewrite.
    shards = [inputs[0].detach().reshape(-1), inputs[1], inputs[2].detach().reshape(-1)]
    torch.testing.assert_close(gm(*shards)[0], expected, rtol=0, atol=0)


def test_gather_sits_before_first_use():
    gm, inputs = linear_graph()
    gm = insert_param_collectives_pass(gm, _plan(gm, inputs, 3))
    nodes = list(gm.graph.nodes)
    for gather in gm.graph.find_nodes(op="call_function", target=gather_param):
        first_user = min(nodes.index(u) for u in gather.users)
        between = nodes[nodes.index(gather) + 1 : first_user]
        assert all(n.target is gather_param for n in between)  # only other gathers for the same op


def test_stage2_appends_shards_and_keeps_replicated_inputs():
    gm, inputs = linear_graph()
    gm = insert_param_collectives_pass(gm, _plan(gm, inputs, 2))
    placeholders = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    assert placeholders == ["weight", "x", "bias", "weight_shard", "bias_shard"]
    assert len(gm.graph.find_nodes(op="call_function", target=replicated_param)) == 2


def test_stage1_leaves_the_graph_alone():
    gm, inputs = linear_graph()
    before = gm.code
    assert insert_param_collectives_pass(gm, _plan(gm, inputs, 1)).code == before


@pytest.mark.parametrize(
    "source_name, expected",
    [
        ("L['self']._modules['h']._modules['0']._parameters['weight']", "h.0.weight"),
        ("L['fn']._modules['0']._parameters['bias']", "0.bias"),
    ],
)
def test_param_names_from_dynamo_sources(source_name, expected):
    class Source:
        name = source_name

    assert param_name_from_source(Source(), "fallback") == expected
    assert param_name_from_source(None, "fallback") == "fallback"
