"""ZeRO++ qwZ / qgZ rewrites on single-process aten graphs.

Graphs are traced with make_fx (no process group needed); the rewritten graphs are checked with
FileCheck and node inspection: which ops replaced the collective, over which group, moving how
many bytes of which dtype (against the formulas of the module docstrings: int8 or packed int4
blocks plus 4 bytes of fp32 scale per block). Numbers come from running both the original and
the rewritten graph on a fake process group (``support.graph_builders``): its all-gather repeats
this rank's shard (every rank holds the same shard) and its one-rank collectives are identities,
so the original graph is the exact reference and the quantized one must be within half a step.
"""

import pytest
import torch
import torch.distributed as dist
from torch.testing import FileCheck

from support.graph_builders import all_gather_graph, calls, fake_process_group, reduce_scatter_graph
from zcompile.passes import metadata
from zcompile.passes.collectives import ALL_GATHER, ALL_TO_ALL, REDUCE_SCATTER, CollectiveNode
from zcompile.passes.quantize_grads import quantize_grads_pass
from zcompile.passes.quantize_weights import effective_block, quantize_weights_pass

_zops = torch.ops.zcompile


def _blocks(n, block):
    return -(-n // block)


def _half_steps(x: torch.Tensor, block: int, qmax: int) -> torch.Tensor:
    """Per element of ``x``: half the quantization step of its block (absmax / qmax / 2)."""
    padded = torch.zeros(_blocks(x.numel(), block) * block)
    padded[: x.numel()] = x.float().abs()
    return (padded.view(-1, block).amax(dim=1) / qmax / 2).repeat_interleave(block)[: x.numel()]


@pytest.mark.parametrize("shard, block, want", [(1, 64, 2), (6, 64, 8), (64, 64, 64), (65, 64, 64), (1000, 2048, 1024)])
def test_effective_block_is_block_or_next_power_of_two(shard, block, want):
    assert effective_block(shard, block) == want


# ----------------------------------------------------------------------------- qwZ
@pytest.mark.parametrize(
    "numel, block, dtype", [(100, 64, torch.float32), (6, 64, torch.bfloat16), (300, 128, torch.float16)]
)
def test_qwz_gather_moves_int8_blocks_and_scales(numel, block, dtype):
    gm = all_gather_graph(numel, 4, "world", dtype)
    full_bytes = CollectiveNode.of(calls(gm, ALL_GATHER)[0]).bytes
    gm = quantize_weights_pass(gm, "world", block)
    chosen = effective_block(numel, block)
    FileCheck().check(f"zcompile.quantize_blockwise.default(shard_1, 8, {chosen})").check(
        "all_gather_into_tensor.default(cat, 4, 'world')"
    ).check("wait_tensor.default").check("zcompile.dequantize_blockwise.default(").check_same(
        f"{4 * _blocks(numel, chosen) * chosen}, 8, {chosen}, {dtype})"
    ).check("mul.Tensor").run(gm.code)
    (gather,) = map(CollectiveNode.of, calls(gm, ALL_GATHER))
    assert gather.dtype == torch.int8
    # per rank: the int8 values padded to whole blocks, then 4 bytes of fp32 scale per block
    assert gather.input_val.numel() == _blocks(numel, chosen) * (chosen + 4)
    assert gather.bytes == 4 * _blocks(numel, chosen) * (chosen + 4)
    if numel >= block:  # a shard of a block or more moves fewer bytes (a tiny one may not: 6 bf16 = 8 + 4)
        assert gather.bytes < full_bytes
    # the user still gets the gathered weights, unpadded, in the parameter's dtype
    (mul,) = calls(gm, torch.ops.aten.mul.Tensor)
    assert mul.args[0].meta["val"].shape == (4 * numel,) and mul.args[0].meta["val"].dtype == dtype


@pytest.mark.parametrize("group, dtype", [("other", torch.float32), ("world", torch.int32)])
def test_qwz_leaves_other_groups_and_integer_gathers(group, dtype):
    gm = all_gather_graph(100, 4, group, dtype)
    before = gm.code
    assert quantize_weights_pass(gm, "world", 64).code == before


def test_qwz_copies_tags_onto_every_inserted_node():
    gm = all_gather_graph(100, 4, "world")
    metadata.tag(calls(gm, ALL_GATHER)[0], role=metadata.ROLE_GATHER, param="w")
    gm = quantize_weights_pass(gm, "world", 64)
    inserted = (
        calls(gm, _zops.quantize_blockwise.default)
        + calls(gm, ALL_GATHER)
        + calls(gm, _zops.dequantize_blockwise.default)
    )
    assert len(inserted) == 3
    for node in inserted:
        assert metadata.tags(node) == {"role": metadata.ROLE_GATHER, "param": "w", "quantized": "int8"}


@pytest.mark.parametrize("numel, dtype", [(100, torch.float32), (5, torch.bfloat16)])
def test_qwz_result_within_half_a_step_of_the_exact_gather(numel, dtype):
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 1, numel)).to(dtype)
    with fake_process_group(rank=1, world_size=4) as name:
        exact = all_gather_graph(numel, 4, name, dtype)(x)
        got = quantize_weights_pass(all_gather_graph(numel, 4, name, dtype), name, 64)(x)
    assert got.dtype == dtype and got.shape == exact.shape
    block = effective_block(numel, 64)
    bound = _half_steps(x, block, 127).repeat(4) * (1 + 1e-4)
    if dtype != torch.float32:  # plus the rounding of the dequantized value to 16 bits
        bound = bound + torch.finfo(dtype).eps / 2 * exact.float().abs() / 2
    err = (got.float() - exact.float()).abs() / 2  # the graph's user doubles the weights (exactly)
    assert bool((err <= bound).all()), (err - bound).max()
    assert not torch.equal(got, exact)  # really quantized


# ----------------------------------------------------------------------------- qgZ
# node_size -> the groups its all-to-alls run over, in order (world 4: 2 nodes of 2, 1 node of 4, 4 nodes of 1)
ALL_TO_ALLS = {2: ["intra", "inter"], 4: ["intra"], 1: ["inter"]}


@pytest.mark.parametrize("node_size", [2, 4, 1])
def test_qgz_reduce_scatter_becomes_int4_all_to_alls(node_size):
    world, shard = 4, 10
    nodes, chosen = world // node_size, effective_block(shard, 64)
    padded = _blocks(shard, chosen) * chosen
    gm = reduce_scatter_graph(world * shard, world, "world")
    assert len(calls(gm, REDUCE_SCATTER)) == 1
    gm = quantize_grads_pass(gm, "world", world, node_size, "intra", "inter", 64)
    assert calls(gm, REDUCE_SCATTER) == []
    exchanges = [CollectiveNode.of(n) for n in calls(gm, ALL_TO_ALL)]
    assert [e.group_name for e in exchanges] == ALL_TO_ALLS[node_size]
    assert all(e.dtype == torch.uint8 for e in exchanges)  # packed int4 (and scale bytes) move
    # bytes each rank sends: int4 values (2 per byte) + 4 bytes of scale per block, for all its rows
    # inside the node (world rows), then only the partial sums of its own column across nodes (nodes rows)
    row_bytes = padded // 2 + 4 * (padded // chosen)
    sent = {"intra": world * row_bytes, "inter": nodes * row_bytes}
    assert [e.bytes for e in exchanges] == [sent[g] for g in ALL_TO_ALLS[node_size]]
    assert exchanges[0].group_size == (node_size if node_size > 1 else nodes)
    check = FileCheck().check("zcompile.quantize_blockwise.default(").check_same(f", 4, {chosen})")
    for group in ALL_TO_ALLS[node_size]:
        check = check.check("all_to_all_single.default(").check_same(f"'{group}')")
        if group == "intra" and nodes > 1:  # reduce inside the node in fp32, re-quantize for the next hop
            check = check.check("zcompile.dequantize_reduce_requantize.default(")
    check.check("zcompile.dequantize_reduce.default(").check_not("all_to_all_single").run(gm.code)
    (out,) = gm.graph.find_nodes(op="output")[0].args
    assert out.meta["val"].shape == (shard,) and out.meta["val"].dtype == torch.float32


@pytest.mark.parametrize(
    "group, group_size, dtype", [("other", 4, torch.float32), ("world", 2, torch.float32), ("world", 4, torch.int32)]
)
def test_qgz_leaves_other_groups_sizes_and_integer_reductions(group, group_size, dtype):
    gm = reduce_scatter_graph(40, group_size, group, dtype)
    before = gm.code
    assert quantize_grads_pass(gm, "world", 4, 2, "intra", "inter", 64).code == before


def test_qgz_copies_tags_with_int4():
    gm = reduce_scatter_graph(40, 4, "world")
    metadata.tag(calls(gm, REDUCE_SCATTER)[0], role=metadata.ROLE_REDUCE, params=["a", "b"])
    gm = quantize_grads_pass(gm, "world", 4, 2, "intra", "inter", 64)
    for node in calls(gm, ALL_TO_ALL) + calls(gm, _zops.dequantize_reduce.default):
        assert metadata.tags(node) == {"role": metadata.ROLE_REDUCE, "params": ["a", "b"], "quantized": "int4"}


def test_qgz_one_rank_within_half_an_int4_step():
    # One rank: the exact reduce-scatter is the identity, and the rewrite quantizes once to int4.
    x = torch.randn(100, generator=torch.Generator().manual_seed(1)) * torch.logspace(-2, 1, 100)
    with fake_process_group(world_size=1) as name:
        exact = reduce_scatter_graph(100, 1, name)(x)
        got = quantize_grads_pass(reduce_scatter_graph(100, 1, name), name, 1, 1, name, name, 64)(x)
    assert torch.equal(exact, x) and got.dtype == torch.float32 and got.shape == x.shape
    assert bool(((got - exact).abs() <= _half_steps(x, 64, 7) * (1 + 1e-4)).all())
    assert not torch.equal(got, exact)


def test_qgz_two_level_graph_runs_on_real_tensors():
    # Values of a fake multi-rank all-to-all are arbitrary; this checks that the real kernels accept
    # the shapes the fake impls promised (the pass traced it on fake tensors only).
    with fake_process_group(rank=1, world_size=4) as name:
        intra, inter = dist.new_group([0, 1]), dist.new_group([1, 3])
        gm = quantize_grads_pass(
            reduce_scatter_graph(40, 4, name, torch.bfloat16), name, 4, 2, intra.group_name, inter.group_name, 64
        )
        got = gm(torch.randn(40).bfloat16())
    assert len(calls(gm, ALL_TO_ALL)) == 2
    assert got.shape == (10,) and got.dtype == torch.bfloat16 and bool(got.float().isfinite().all())
