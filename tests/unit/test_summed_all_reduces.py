"""``merge_summed_all_reduces_pass`` on hand-built backward graphs and on a tensor-parallel Llama's
simulated backward: sums of the model's waited all-reduces become one all-reduce of the sum; the
graph computes the same (run for two ranks at once, each with its own inputs), and zcompile's own all-reduces or one read elsewhere are left alone."""

from __future__ import annotations

import copy

import pytest
import torch

from support.models import small_llama_config
from zcompile.passes.collectives import ALL_REDUCE, WAIT
from zcompile.passes.metadata import ROLE, ROLE_REPLICA_REDUCE, tag
from zcompile.passes.summed_all_reduces import merge_summed_all_reduces_pass

aten = torch.ops.aten
SHAPE = (4, 3)


class TwoRanks(torch.fx.Interpreter):
    """Runs the graph for two ranks at once: every value holds both ranks' on a leading dim of 2, and
    an all-reduce gives each rank the sum of the two."""

    def call_function(self, target, args, kwargs):
        if target is ALL_REDUCE:
            return args[0].sum(0, keepdim=True).expand_as(args[0]).clone()
        if target is WAIT:
            return args[0]
        return super().call_function(target, args, kwargs)


def _reduced(graph: torch.fx.Graph, value: torch.fx.Node, group: str = "tp") -> torch.fx.Node:
    reduce = graph.call_function(ALL_REDUCE, (value, "sum", group))
    wait = graph.call_function(WAIT, (reduce,))
    for node in (reduce, wait):
        node.meta["val"] = torch.empty(SHAPE)
    return wait


def _graph(third_group: str = "tp", zero_third: bool = False, third_read_elsewhere: bool = False):
    graph = torch.fx.Graph()
    inputs = []
    for name in "xyz":
        node = graph.placeholder(name)
        node.meta["val"] = torch.empty(SHAPE)
        inputs.append(node)
    doubled = [graph.call_function(aten.mul.Tensor, (value, 2.0)) for value in inputs]
    waits = [_reduced(graph, value, third_group if i == 2 else "tp") for i, value in enumerate(doubled)]
    if zero_third:
        tag(waits[2].args[0], **{ROLE: ROLE_REPLICA_REDUCE})
    first = graph.call_function(aten.add.Tensor, (waits[0], waits[1]))
    total = graph.call_function(aten.add.Tensor, (first, waits[2]))
    for node in (*doubled, first, total):
        node.meta["val"] = torch.empty(SHAPE)
    outputs = (total, waits[2]) if third_read_elsewhere else (total,)
    graph.output(outputs)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _count(gm, target) -> int:
    return sum(node.target is target for node in gm.graph.nodes)


@pytest.mark.parametrize(
    "variant, merged_to",
    [({}, 1), ({"third_group": "dp"}, 2), ({"zero_third": True}, 2), ({"third_read_elsewhere": True}, 2)],
    ids=["chain-of-three", "another-group", "zcompile's-own", "read-elsewhere"],
)
def test_sums_of_waited_all_reduces_become_one_and_compute_the_same(variant, merged_to):
    gm = _graph(**variant)
    before = copy.deepcopy(gm)
    merge_summed_all_reduces_pass(gm)
    assert _count(before, ALL_REDUCE) == 3 and _count(gm, ALL_REDUCE) == merged_to
    inputs = [torch.randn(2, *SHAPE) for _ in range(3)]  # each rank's own
    expected, got = TwoRanks(before).run(*inputs), TwoRanks(gm).run(*inputs)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e)


def test_a_tensor_parallel_llama_layer_all_reduces_twice_in_backward():
    """q, k, v and gate, up read one input each: 5 input-gradient all-reduces a layer, merged to 2
    (attention's and the MLP's); the forward's row-wise all-reduces (o, down) are untouched."""
    transformers = pytest.importorskip("transformers")
    import zcompile

    config = small_llama_config()
    ids = torch.zeros(2, 32, dtype=torch.long)
    graphs = []
    zcompile.simulate(
        lambda: transformers.LlamaForCausalLM(config),
        {"input_ids": ids, "labels": ids},
        world_size=4,
        node_size=4,
        options={"stage": 3, "on_compile": graphs.append},
        hardware="h100-sxm",
        tensor_parallel=2,
    )
    (compiled,) = graphs
    assert _count(compiled.forward, ALL_REDUCE) == 2 * 2
    assert _count(compiled.backward, ALL_REDUCE) == 2 * 2
