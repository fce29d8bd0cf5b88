"""param_gather: a stage-3 parameter's gather traced as one op and written out as the collective.

The written-out graph is run for every rank by an interpreter that plays the all-gather (every
rank's input, concatenated in rank order), and its output is checked against the parameter the
shards were cut from; the multi-process training tests run it on gloo against a single process.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from support.graph_builders import calls, trace
from zcompile.passes import metadata
from zcompile.passes.collectives import ALL_GATHER, WAIT, CollectiveNode
from zcompile.passes.param_gather import GATHER_SHARDS, expand_param_gathers_pass, gather_shards, gather_shards_bytes

WORLD = 2
aten = torch.ops.aten


def _run_ranks(gm: torch.fx.GraphModule, shards: list[torch.Tensor]) -> list[torch.Tensor]:
    """``gm`` run as each rank, rank r on ``shards[r]``, the all-gather played as the ranks' inputs
    concatenated (a first run per rank collects them)."""
    inputs = []

    class Collect(torch.fx.Interpreter):
        def call_function(self, target, args, kwargs):
            if target is ALL_GATHER:
                inputs.append(args[0])
                return args[0].new_zeros(args[0].shape[0] * len(shards))
            return args[0] if target is WAIT else super().call_function(target, args, kwargs)

    class Gather(torch.fx.Interpreter):
        def call_function(self, target, args, kwargs):
            if target is ALL_GATHER:
                return torch.cat(inputs)
            return args[0] if target is WAIT else super().call_function(target, args, kwargs)

    for shard in shards:
        Collect(gm).run(shard)
    return [Gather(gm).run(shard) for shard in shards]


@pytest.mark.parametrize(
    "shape, shard_dtype, gather_dtype",
    [
        ((8, 3), torch.float32, torch.float32),  # a weight: the gathered buffer viewed to its shape
        ((5,), torch.float32, torch.float32),  # a bias of odd length: gathered padded to 6, then cut
        ((3, 5), torch.float32, torch.bfloat16),  # an fp32 master gathered in bf16 (param_dtype), cut and viewed
        ((6,), torch.float32, torch.float32),  # a 1-D parameter that needs neither a cut nor a view
    ],
)
def test_written_out_gather_gives_every_rank_the_parameter(shape, shard_dtype, gather_dtype):
    param = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))).to(shard_dtype)
    numel = param.numel()
    padded = -(-numel // WORLD) * WORLD
    shards = list(torch.nn.functional.pad(param.reshape(-1), (0, padded - numel)).chunk(WORLD))
    gm = trace(lambda shard: gather_shards(shard, numel, list(shape), WORLD, "world", gather_dtype), shards[0])
    (op,) = calls(gm, GATHER_SHARDS)
    metadata.tag(op, role=metadata.ROLE_GATHER, param="layer.weight")
    op.meta[metadata.RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE
    assert gather_shards_bytes(op) == (padded * gather_dtype.itemsize, WORLD)

    gm = expand_param_gathers_pass(gm)

    assert calls(gm, GATHER_SHARDS) == []
    (node,) = calls(gm, ALL_GATHER)
    collective = CollectiveNode.of(node)
    assert collective.is_zero and metadata.tags(node)[metadata.PARAM] == "layer.weight"  # the op's tags travel
    assert node.meta[metadata.RECOMPUTE] == CheckpointPolicy.MUST_RECOMPUTE
    assert (collective.group_size, collective.group_name, collective.dtype) == (WORLD, "world", gather_dtype)
    assert collective.bytes == padded * gather_dtype.itemsize
    written = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert (aten.slice.Tensor in written) == (padded != numel)
    assert (aten.view.default in written) == (len(shape) > 1)  # no identity view of a 1-D parameter

    want = param.to(gather_dtype)
    out_val = gm.graph.find_nodes(op="output")[0].args[0].meta["val"]
    assert (tuple(out_val.shape), out_val.dtype) == (shape, gather_dtype)
    for full in _run_ranks(gm, shards):
        torch.testing.assert_close(full, want, rtol=0, atol=0)  # a cast and copies: bitwise


def test_a_graph_without_the_op_is_left_as_it_is():
    gm = trace(lambda shard: shard * 2, torch.zeros(4))
    code = gm.code
    assert expand_param_gathers_pass(gm).code == code
