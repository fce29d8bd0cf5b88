"""grad_reduction: a gradient's reduction traced as one op and written out as the collectives.

The written-out graph is run for every rank by an interpreter that plays the reduce-scatter (the
sum of every rank's input, this rank's slice), and its shards are checked against the mean of the
ranks' gradients computed with torch; the multi-process training tests run it on gloo against a
single process.
"""

from __future__ import annotations

import pytest
import torch

from support.graph_builders import calls, trace
from zcompile.passes import metadata
from zcompile.passes.collectives import REDUCE_SCATTER, WAIT, CollectiveNode
from zcompile.passes.grad_reduction import REDUCE_GRAD_TO_SHARD, expand_grad_reductions_pass, reduce_grad_to_shard

WORLD = 2


def _run_ranks(gm: torch.fx.GraphModule, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """``gm`` run as each rank of ``len(grads)``, rank r on ``grads[r]``: a first run per rank collects
    its reduce-scatter's input, a second returns rank r's slice of their sum."""
    world, inputs = len(grads), []

    class Collect(torch.fx.Interpreter):
        def call_function(self, target, args, kwargs):
            if target is REDUCE_SCATTER:
                inputs.append(args[0])
                return args[0].new_zeros(args[0].shape[0] // world)
            return args[0] if target is WAIT else super().call_function(target, args, kwargs)

    class Reduce(torch.fx.Interpreter):
        def __init__(self, module, rank):
            super().__init__(module)
            self.rank = rank

        def call_function(self, target, args, kwargs):
            if target is REDUCE_SCATTER:
                return torch.stack(inputs).sum(0).chunk(world)[self.rank]
            return args[0] if target is WAIT else super().call_function(target, args, kwargs)

    for grad in grads:
        Collect(gm).run(grad)
    return [Reduce(gm, rank).run(grad) for rank, grad in enumerate(grads)]


def _grad_graph(example: torch.Tensor, numel: int, reduce_dtype, shard_dtype) -> torch.fx.GraphModule:
    gm = trace(lambda grad: reduce_grad_to_shard(grad, numel, WORLD, "world", reduce_dtype, shard_dtype), example)
    metadata.tag(calls(gm, REDUCE_GRAD_TO_SHARD)[0], role=metadata.ROLE_REPLICATED, param="layer.weight")
    return gm


@pytest.mark.parametrize(
    "shape, transposed, dtype, reduce_dtype, shard_dtype",
    [
        ((8, 3), False, torch.float32, None, torch.float32),  # a weight: flattened by a view
        ((3, 8), True, torch.float32, None, torch.float32),  # not contiguous: a copy, then the view
        ((5,), False, torch.float32, None, torch.float32),  # a bias of odd length: padded to 6
        ((4, 5), False, torch.bfloat16, torch.float32, torch.float32),  # bf16 gradient reduced in fp32
        ((7,), False, torch.float32, torch.bfloat16, torch.float32),  # reduced in bf16, the shard fp32
    ],
)
def test_written_out_reduction_gives_each_rank_its_slice_of_the_mean(
    shape, transposed, dtype, reduce_dtype, shard_dtype
):
    gen = torch.Generator().manual_seed(len(shape) * 10 + shape[0])
    grads = [torch.randn(shape, generator=gen).to(dtype) for _ in range(WORLD)]
    if transposed:
        grads = [grad.t() for grad in grads]  # [8, 3] views of [3, 8]
    numel = grads[0].numel()
    gm = expand_grad_reductions_pass(_grad_graph(grads[0], numel, reduce_dtype, shard_dtype))

    assert calls(gm, REDUCE_GRAD_TO_SHARD) == []
    (node,) = calls(gm, REDUCE_SCATTER)
    collective = CollectiveNode.of(node)
    assert collective.is_zero and metadata.tags(node)[metadata.PARAM] == "layer.weight"  # the op's tags travel
    assert (collective.group_size, collective.group_name, collective.reduce_op) == (WORLD, "world", "sum")
    assert collective.dtype == (reduce_dtype or dtype)

    padded = -(-numel // WORLD) * WORLD
    flat = [torch.nn.functional.pad(grad.reshape(-1).to(reduce_dtype or dtype), (0, padded - numel)) for grad in grads]
    mean = torch.stack(flat).sum(0) / WORLD
    for rank, shard in enumerate(_run_ranks(gm, grads)):
        want = mean.chunk(WORLD)[rank].to(shard_dtype)
        assert shard.dtype == shard_dtype and shard.shape == want.shape
        torch.testing.assert_close(shard, want, rtol=0, atol=0)  # the same ops in the same order
        out_val = gm.graph.find_nodes(op="output")[0].args[0].meta["val"]
        assert (out_val.shape, out_val.dtype) == (want.shape, want.dtype)


def test_a_graph_without_the_op_is_left_as_it_is():
    gm = trace(lambda grad: grad * 2, torch.zeros(4))
    code = gm.code
    assert expand_grad_reductions_pass(gm).code == code
