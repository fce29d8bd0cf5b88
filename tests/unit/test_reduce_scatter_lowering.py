"""reduce_scatter_lowering: a reduce-scatter run as all-to-all + sum, on hand-built graphs.

The numbers are checked against a reduce-scatter computed with torch (the sum of every rank's
input, this rank's slice), the ranks' exchange played by an interpreter; the multi-process
training tests run the lowered graphs on gloo against a single process.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import FileCheck

from support.graph_builders import as_zero_collectives, calls, reduce_scatter_graph, trace
from zcompile.common.process_group import DataParallelGroup, reduce_scatter_by_all_to_all
from zcompile.config import ZeroConfig
from zcompile.passes import metadata
from zcompile.passes.collectives import ALL_TO_ALL, REDUCE_SCATTER, WAIT, collective_nodes
from zcompile.passes.liveness import live_peak_bytes
from zcompile.passes.reduce_scatter_lowering import (
    SUM_RECEIVED_ROWS,
    exchanged_rows_released,
    reduce_scatter_as_all_to_all_pass,
    release_storage,
)


class _Ranks(torch.fx.Interpreter):
    """Runs a lowered graph as rank ``rank`` of ``len(inputs)``: the all-to-all returns row ``rank`` of
    every rank's input, stacked in rank order (what torch's all_to_all_single delivers)."""

    def __init__(self, gm, inputs, rank):
        super().__init__(gm)
        self.inputs, self.rank = inputs, rank

    def call_function(self, target, args, kwargs):
        if target is ALL_TO_ALL:
            world = len(self.inputs)
            return torch.cat([x.chunk(world)[self.rank] for x in self.inputs])
        if target is WAIT:
            return args[0]
        return super().call_function(target, args, kwargs)


def _graph(reduce_op: str, shape: tuple[int, ...], world: int) -> torch.fx.GraphModule:
    return as_zero_collectives(
        trace(lambda grad: WAIT(REDUCE_SCATTER(grad, reduce_op, world, "world")), torch.zeros(shape))
    )


@pytest.mark.parametrize(
    "reduce_op, shape, world", [("sum", (64,), 4), ("avg", (64,), 4), ("sum", (8, 3), 4), ("sum", (10,), 2)]
)
def test_reduce_scatter_becomes_all_to_all_and_sum_of_the_rows_received(reduce_op, shape, world):
    gm = reduce_scatter_as_all_to_all_pass(_graph(reduce_op, shape, world))
    assert calls(gm, REDUCE_SCATTER) == []
    (exchange,) = calls(gm, ALL_TO_ALL)
    rows = shape[0] // world
    assert exchange.args[1] == exchange.args[2] == [rows] * world
    check = FileCheck().check("all_to_all_single.default(").check("wait_tensor.default(")
    check = check.check("sum_received_rows.default(")
    (check.check("div.Tensor(") if reduce_op == "avg" else check.check_not("div")).run(gm.code)
    gen = torch.Generator().manual_seed(world)
    inputs = [torch.randn(shape, generator=gen) for _ in range(world)]
    total = torch.stack(inputs).sum(0)
    for rank in range(world):
        out = _Ranks(gm, inputs, rank).run(inputs[rank])
        want = total.chunk(world)[rank] / (world if reduce_op == "avg" else 1)
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)  # fp32 sums of `world` terms, other order
        assert gm.graph.find_nodes(op="output")[0].args[0].meta["val"].shape == want.shape


def test_the_all_to_all_still_reads_as_the_reduce_scatter_it_runs():
    before = reduce_scatter_graph(96, 4, "world")
    metadata.tag(calls(before, REDUCE_SCATTER)[0], role=metadata.ROLE_REDUCE, params=["a", "b"])
    (original,) = collective_nodes(before)
    facts = (original.kind, original.group_size, original.group_name, original.bytes, original.shard_elements)
    gm = reduce_scatter_as_all_to_all_pass(before)
    (lowered,) = collective_nodes(gm)
    assert lowered.node.target is ALL_TO_ALL
    assert (lowered.kind, lowered.group_size, lowered.group_name, lowered.bytes, lowered.shard_elements) == facts
    assert lowered.reduce_op == "sum" and lowered.wait is not None
    assert metadata.params_of(lowered.node) == ["a", "b"]  # the bucket's parameters travel with it


def test_issue_and_wait_stay_where_the_schedule_put_them():
    def step(grad, other):
        reduced = REDUCE_SCATTER(grad, "sum", 2, "world")
        busy = other * 3  # compute the schedule overlapped with the transfer
        return WAIT(reduced) + busy.sum()

    gm = reduce_scatter_as_all_to_all_pass(as_zero_collectives(trace(step, torch.zeros(8), torch.zeros(5))))
    order = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    exchange, wait, mul = order.index(ALL_TO_ALL), order.index(WAIT), order.index(torch.ops.aten.mul.Tensor)
    assert exchange < mul < wait  # still overlapped
    assert order[wait + 1] is SUM_RECEIVED_ROWS


def test_other_reductions_and_single_rank_groups_are_left_alone():
    for reduce_op, world in (("max", 4), ("sum", 1)):
        gm = reduce_scatter_as_all_to_all_pass(_graph(reduce_op, (8,), world))
        assert len(calls(gm, REDUCE_SCATTER)) == 1 and calls(gm, ALL_TO_ALL) == []


def test_the_option_chooses_the_form_and_auto_needs_gloo():
    no_backend = DataParallelGroup(rank=0, world_size=2, name="0", process_group=None)
    assert reduce_scatter_by_all_to_all("all_to_all", no_backend)
    assert not reduce_scatter_by_all_to_all("native", no_backend)
    assert not reduce_scatter_by_all_to_all("auto", no_backend)
    with pytest.raises(ValueError, match="option 'reduce_scatter' must be one of"):
        ZeroConfig(reduce_scatter="alltoall")


def _packed_then_overlapped(grad, other):
    packed = grad * 2  # the graph's own buffer, read by the exchange alone (a bucket's pack)
    reduced = REDUCE_SCATTER(packed, "sum", 2, "world")
    busy = other * 3  # compute the schedule overlapped with the transfer
    return WAIT(reduced) + busy.sum()


def test_the_executed_form_frees_the_exchanged_rows_where_the_graph_stops_reading_them():
    gm = reduce_scatter_as_all_to_all_pass(
        as_zero_collectives(trace(_packed_then_overlapped, torch.zeros(64), torch.zeros(1000)))
    )
    gm = exchanged_rows_released(gm)
    order = [n for n in gm.graph.nodes if n.op == "call_function"]
    targets = [n.target for n in order]
    wait, summed = targets.index(WAIT), targets.index(SUM_RECEIVED_ROWS)
    (exchange,) = calls(gm, ALL_TO_ALL)
    assert order[wait + 1].target is release_storage and order[wait + 1].args == (exchange.args[0],)  # rows sent
    assert order[summed + 1].target is release_storage and order[summed + 1].args == (order[wait],)  # received
    grads = [torch.randn(64, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    other = torch.randn(1000)
    for rank in range(2):  # the result is the reduce-scatter's, the released buffers read no more
        out = _Ranks(gm, [g * 2 for g in grads], rank).run(grads[rank], other)
        want = (grads[0] * 2 + grads[1] * 2).chunk(2)[rank] + (other * 3).sum()
        torch.testing.assert_close(out, want)


def test_rows_sent_that_the_graph_did_not_make_for_the_exchange_are_not_freed():
    gm = exchanged_rows_released(reduce_scatter_as_all_to_all_pass(reduce_scatter_graph(64, 2, "world")))
    released = calls(gm, release_storage)
    assert [n.args[0].target for n in released] == [WAIT]  # the received rows alone: the input is the caller's


def test_a_collective_input_lives_until_its_wait_in_the_memory_walk():
    gm = as_zero_collectives(trace(_packed_then_overlapped, torch.zeros(64), torch.zeros(1000)))
    floats = 4
    packed, received, busy = 64 * floats, 32 * floats, 1000 * floats
    # at other * 3: the pack (held by the transfer until its wait, not freed at the issue, its last
    # reader), the reduce-scatter's output and the overlapped product
    assert live_peak_bytes(gm) == packed + received + busy
