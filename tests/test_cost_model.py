"""The cost model: fitting, FLOPs per node, the simulated timeline against hand-computed ones, and
constants measured on 2 gloo ranks (identical on both, predicting a fresh size)."""

import operator
import random
import statistics
import time

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from support.hand_built import layered_graph
from support.launch import run_ranks
from zcompile.backend.compiled import CompiledGraphs
from zcompile.common.process_group import DataParallelGroup, all_gather_eager
from zcompile.passes.schedule import plan_schedule, schedule_pass
from zcompile.predict.cost_model import (
    MAX_OVERLAP_SLOWDOWN,
    CollectiveCost,
    CollectiveCosts,
    ComputeCosts,
    fit_linear,
    measure_collective_costs,
    measure_compute_costs,
    node_bytes,
    node_flops,
    node_seconds,
    predict,
    predict_step,
)

aten = torch.ops.aten


# ----------------------------------------------------------------------------- fit_linear
def test_fit_linear_recovers_noiseless_constants():
    latency, per_byte = 25e-6, 1 / 2e9  # 25 us, 2 GB/s
    fitted = fit_linear([(n, latency + n * per_byte) for n in (4096, 65536, 2**20, 2**22)])
    assert fitted.latency_s == pytest.approx(latency, abs=1e-9)
    assert fitted.seconds_per_byte == pytest.approx(per_byte, abs=1e-9)
    assert fitted.seconds(2**20) == pytest.approx(latency + 2**20 * per_byte, abs=1e-9)


def test_fit_linear_with_noise_and_clamping():
    rng = random.Random(0)
    latency, per_byte, sigma = 50e-6, 1e-9, 2e-6
    sizes = [2**k for k in range(12, 23)]
    samples = [(n, latency + n * per_byte + rng.gauss(0.0, sigma)) for n in sizes for _ in range(20)]
    fitted = fit_linear(samples)
    # 220 samples with sigma 2 us: the standard error of the intercept is about 0.2 us and of the
    # slope about 0.1%; 5 us and 2% are over 10 standard errors away
    assert fitted.latency_s == pytest.approx(latency, abs=5e-6)
    assert fitted.seconds_per_byte == pytest.approx(per_byte, rel=0.02)
    # a negative intercept is clamped: the line is refitted through the origin
    through_origin = fit_linear([(1.0, 0.5), (2.0, 2.0), (3.0, 3.5)])  # least squares: -1 + 1.5 x
    assert through_origin.latency_s == 0.0
    assert through_origin.seconds_per_byte == pytest.approx((0.5 + 4.0 + 10.5) / 14)
    assert fit_linear([]) == CollectiveCost()


def test_costs_json_round_trip():
    costs = CollectiveCosts(4, {"all_gather": CollectiveCost(1e-5, 3e-10, 2e-6), "all_to_all": CollectiveCost(2e-5)})
    assert CollectiveCosts.from_json(costs.to_json()) == costs
    assert costs.seconds("reduce_scatter", 10**6) == 0.0  # not measured: free
    compute = ComputeCosts(1e12, 1e11, 5e-6)
    assert ComputeCosts.from_json(compute.to_json()) == compute


# ----------------------------------------------------------------------------- per node
def _single_op_graph(target, shapes, *extra_args):
    """A graph calling ``target`` on placeholders of ``shapes`` (fp32 fake tensors) and ``extra_args``."""
    mode = FakeTensorMode()
    graph = torch.fx.Graph()
    inputs = []
    for i, shape in enumerate(shapes):
        placeholder = graph.placeholder(f"in{i}")
        placeholder.meta["val"] = mode.from_tensor(torch.empty(shape))
        inputs.append(placeholder)
    node = graph.call_function(target, (*inputs, *extra_args))
    with mode:
        node.meta["val"] = target(*(p.meta["val"] for p in inputs), *extra_args)
    graph.output(node)
    return node


def test_matmul_flops_and_roofline():
    m, k, n = 3, 5, 7
    mm = _single_op_graph(aten.mm.default, [(m, k), (k, n)])
    assert node_flops(mm) == 2 * m * k * n
    assert node_bytes(mm) == 4 * (m * k + k * n + m * n)
    addmm = _single_op_graph(aten.addmm.default, [(n,), (m, k), (k, n)])
    assert node_flops(addmm) == 2 * m * k * n  # flop_counter counts the product, not the bias add
    # roofline: the larger of the two times, plus the per-op overhead
    compute_bound = ComputeCosts(flops_per_s=1.0, bytes_per_s=1e9, op_overhead_s=0.5)
    assert node_seconds(mm, compute_bound) == 0.5 + 2 * m * k * n
    memory_bound = ComputeCosts(flops_per_s=1e9, bytes_per_s=2.0)
    assert node_seconds(mm, memory_bound) == 4 * (m * k + k * n + m * n) / 2.0


def test_cpu_attention_flops():
    b, h, s, d = 2, 3, 5, 4
    sdpa = _single_op_graph(aten._scaled_dot_product_flash_attention_for_cpu.default, [(b, h, s, d)] * 3)
    assert node_flops(sdpa) == 2 * (2 * b * h * s * s * d)  # q @ k^T and p @ v


def test_views_and_getitem_cost_nothing():
    view = _single_op_graph(aten.view.default, [(4, 6)], [24])
    assert node_flops(view) == 0 and node_bytes(view) == 0
    assert node_seconds(view, ComputeCosts(1.0, 1.0)) == 0.0
    split = _single_op_graph(aten.split.Tensor, [(4, 6)], 2)
    with split.graph.inserting_after(split):
        getitem = split.graph.call_function(operator.getitem, (split, 0))
    assert node_seconds(getitem, ComputeCosts(1.0, 1.0, op_overhead_s=1.0)) == 0.0
    # a pointwise op reads and writes its tensors: mul of two [4, 6] fp32 = 3 x 96 bytes
    mul = _single_op_graph(aten.mul.Tensor, [(4, 6), (4, 6)])
    assert node_flops(mul) == 0 and node_seconds(mul, ComputeCosts(1e9, 96.0)) == 3.0


# ----------------------------------------------------------------------------- predict
# Hand-set costs, powers of two so every time below is exact. Each gathered buffer is 16 fp32 =
# 64 bytes: an all-gather takes 1 + 64/64 = 2 s; the reduce-scatter of x (64 bytes) 0.5 + 64/128
# = 1 s. A layer (mul of two 64-byte tensors into a third) moves 192 bytes at 64 B/s = 3 s; the
# tail (mul by a scalar) 128 bytes = 2 s. Compute is 3 x 3 + 2 = 11 s, communication 3 x 2 + 1 = 7 s.
HAND_COLLECTIVES = CollectiveCosts(
    2, {"all_gather": CollectiveCost(1.0, 1 / 64), "reduce_scatter": CollectiveCost(0.5, 1 / 128)}
)
HAND_COMPUTE = ComputeCosts(flops_per_s=1e9, bytes_per_s=64.0)


def _timeline(prediction):
    return {c.name: (c.issue_s, c.start_s, c.end_s, c.waited_s) for c in prediction.collectives}


def test_predict_unscheduled_graph_exposes_all_communication():
    # gather0 [0,2] wait 2 | layer0 2..5 | gather1 [5,7] wait 2 | layer1 7..10 | gather2 [10,12]
    # wait 2 | layer2 12..15 | reduce [15,16] wait 1 | tail 16..18
    prediction = predict(layered_graph(), HAND_COLLECTIVES, HAND_COMPUTE)
    assert (prediction.step_s, prediction.compute_s, prediction.comm_s, prediction.exposed_comm_s) == (18, 11, 7, 7)
    assert _timeline(prediction) == {
        "gather0": (0, 0, 2, 2),
        "gather1": (5, 5, 7, 2),
        "gather2": (10, 10, 12, 2),
        "reduce": (15, 15, 16, 1),
    }
    assert [c.bytes for c in prediction.collectives] == [64, 64, 64, 64]


def test_predict_scheduled_graph_hides_communication():
    gm = layered_graph()
    gm = schedule_pass(gm, plan_schedule(gm, prefetch=1))
    order = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    assert order == [
        "gather0",
        "gather1",
        "wait0",
        "layer0",
        "gather2",
        "wait1",
        "layer1",
        "wait2",
        "layer2",
        "reduce",
        "tail",
        "reduce_wait",
    ]
    # gather0 [0,2]; gather1 issued at 0 but queued behind it: [2,4]; wait0 2 | layer0 2..5 |
    # gather2 [5,7]; wait1 free (4 <= 5) | layer1 5..8 | wait2 free (7 <= 8) | layer2 8..11 |
    # reduce [11,12] | tail 11..13 | reduce_wait free (12 <= 13)
    prediction = predict(gm, HAND_COLLECTIVES, HAND_COMPUTE)
    assert (prediction.step_s, prediction.compute_s, prediction.comm_s, prediction.exposed_comm_s) == (13, 11, 7, 2)
    assert _timeline(prediction) == {
        "gather0": (0, 0, 2, 2),
        "gather1": (0, 2, 4, 0),
        "gather2": (5, 5, 7, 0),
        "reduce": (11, 11, 12, 0),
    }
    unscheduled = predict(layered_graph(), HAND_COLLECTIVES, HAND_COMPUTE)
    assert prediction.exposed_comm_s < unscheduled.exposed_comm_s


def test_issue_overhead_is_charged_to_compute():
    # issuing an all-gather holds compute 0.5 s, a reduce-scatter 0.25 s; the transfer starts at the call
    costs = CollectiveCosts(
        2, {"all_gather": CollectiveCost(1.0, 1 / 64, 0.5), "reduce_scatter": CollectiveCost(0.5, 1 / 128, 0.25)}
    )
    # gather0 [0,2], compute busy to 0.5, wait 1.5 | layer0 2..5 | gather1 [5,7] wait 1.5 | layer1
    # 7..10 | gather2 [10,12] wait 1.5 | layer2 12..15 | reduce [15,16], busy to 15.25, wait 0.75 | tail 16..18
    unscheduled = predict(layered_graph(), costs, HAND_COMPUTE)
    assert (unscheduled.step_s, unscheduled.issue_s, unscheduled.exposed_comm_s) == (18, 1.75, 5.25)
    # gather0 [0,2] busy to 0.5 | gather1 issued 0.5, queued: [2,4], busy to 1 | wait0 1 | layer0
    # 2..5 | gather2 [5,7] busy to 5.5 | layer1 5.5..8.5 | layer2 8.5..11.5 | reduce [11.5,12.5]
    # busy to 11.75 | tail 11.75..13.75 | reduce_wait free
    gm = layered_graph()
    scheduled = predict(schedule_pass(gm, plan_schedule(gm, prefetch=1)), costs, HAND_COMPUTE)
    assert (scheduled.step_s, scheduled.issue_s, scheduled.exposed_comm_s) == (13.75, 1.75, 1)
    assert _timeline(scheduled)["gather1"] == (0.5, 2, 4, 0)
    for prediction in (unscheduled, scheduled):
        assert prediction.step_s == prediction.compute_s + prediction.issue_s + prediction.exposed_comm_s


def test_transfers_slow_down_while_compute_runs():
    # overlap_slowdown 2: a transfer moves at half speed while a layer computes, full speed while
    # compute waits. gather0 and gather1 issued at 0; wait0 [0,2] (gather0 alone, full speed) | layer0
    # 2..5: gather1 does 1.5 of its 2 s | gather2 issued at 5 | wait1: 0.5 s left, 5..5.5 | layer1
    # 5.5..8.5: gather2 does 1.5 | wait2 5.5..9 -> 8.5..9 | layer2 9..12 | reduce issued at 12, the
    # 2 s tail carries its 1 s at half speed: done at 14, reduce_wait free
    gm = layered_graph()
    gm = schedule_pass(gm, plan_schedule(gm, prefetch=1))
    slow = CollectiveCosts(2, HAND_COLLECTIVES.costs, overlap_slowdown=2.0)
    prediction = predict(gm, slow, HAND_COMPUTE)
    assert (prediction.step_s, prediction.compute_s, prediction.comm_s, prediction.exposed_comm_s) == (14, 11, 7, 3)
    assert _timeline(prediction) == {
        "gather0": (0, 0, 2, 2),
        "gather1": (0, 2, 5.5, 0.5),
        "gather2": (5, 5.5, 9, 0.5),
        "reduce": (12, 12, 14, 0),
    }
    # unscheduled, every transfer is waited at once: contention changes nothing
    assert predict(layered_graph(), slow, HAND_COMPUTE).step_s == 18
    assert CollectiveCosts.from_json(slow.to_json()) == slow


def test_unwaited_transfer_extends_the_step_and_world_of_one_is_free():
    gm = layered_graph(layers=1)
    wait = next(n for n in gm.graph.nodes if n.name == "reduce_wait")
    wait.replace_all_uses_with(wait.args[0])
    gm.graph.erase_node(wait)
    # gather0 [0,2] wait 2 | layer0 2..5 | reduce [5,6] never waited | tail 5..7: ends after it
    prediction = predict(gm, HAND_COLLECTIVES, HAND_COMPUTE)
    assert (prediction.step_s, prediction.exposed_comm_s) == (7, 2)
    # the reduce-scatter outlives a shorter tail: the step ends with the transfer
    slow_reduce = CollectiveCosts(2, {**HAND_COLLECTIVES.costs, "reduce_scatter": CollectiveCost(4.0, 0.0)})
    assert predict(gm, slow_reduce, HAND_COMPUTE).step_s == 9  # reduce [5,9], tail ends at 7
    assert predict(gm, CollectiveCosts(1), HAND_COMPUTE).exposed_comm_s == 0


def test_predict_step_sums_forward_and_backward():
    graphs = [
        CompiledGraphs(dynamo=None, forward=layered_graph(), backward=layered_graph(layers=2)),
        CompiledGraphs(dynamo=None, forward=layered_graph(layers=1), backward=None),
    ]
    step = predict_step(graphs, HAND_COLLECTIVES, HAND_COMPUTE)
    # layered graph of L layers, unscheduled: L x (2 + 3) + 1 + 2 = 5L + 3 s, all communication exposed
    assert step.step_s == 18 + 13 + 8
    assert step.exposed_comm_s == 7 + 5 + 3
    # forward0, forward1, then backward0 (backward1 not compiled): collectives on the step's clock
    assert [c.graph for c in step.collectives] == ["forward0"] * 4 + ["forward1"] * 2 + ["backward0"] * 3
    first_backward = next(c for c in step.collectives if c.graph == "backward0")
    assert first_backward.issue_s == 18 + 8


# ----------------------------------------------------------------------------- measuring
FRESH_BYTES = 3 * 2**20  # 3 MiB, between the fitted sizes 256 KiB and 4 MiB


MEASUREMENTS = 3  # a fit and a fresh size timed under different bursts of load on a shared machine


def _fresh_all_gather_seconds(world, group):
    out, shard = torch.empty(FRESH_BYTES // 4), torch.ones(FRESH_BYTES // 4 // world)
    for _ in range(2):
        all_gather_eager(out, shard, group)
    times = []
    for _ in range(7):
        torch.distributed.barrier()
        start = time.perf_counter()
        all_gather_eager(out, shard, group)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _within_a_factor_of_5(costs, fresh):
    predicted = costs.seconds("all_gather", FRESH_BYTES)
    return fresh / 5 < predicted < fresh * 5


def _measure_on_rank(rank, world):
    """The fit and the fresh time, measured again (every rank alike, on rank 0's verdict) while the
    prediction misses: the other test worker's load comes in bursts that one measurement can catch
    at the fitted sizes and not at the fresh one (a CI run's fit: 2.7 ms of latency)."""
    group = DataParallelGroup.resolve()
    measured = []
    for _ in range(MEASUREMENTS):
        costs = measure_collective_costs(repeats=5)
        fresh = _fresh_all_gather_seconds(world, group)
        measured.append((costs.to_json(), fresh))
        verdict = torch.tensor([float(_within_a_factor_of_5(costs, fresh))])
        torch.distributed.broadcast(verdict, src=0)
        if verdict.item():
            break
    compute = measure_compute_costs(matmul_size=128, copy_bytes=2**20, repeats=3)
    return measured, compute.to_json()


def test_measured_costs_agree_across_ranks_and_predict_a_fresh_size():
    (measured0, compute0), (measured1, compute1) = run_ranks(2, _measure_on_rank, timeout_s=240)
    # the element-wise median: identical on both ranks
    assert [c for c, _ in measured0] == [c for c, _ in measured1] and compute0 == compute1
    for costs_json, _ in measured0:
        costs = CollectiveCosts.from_json(costs_json)
        assert costs.world_size == 2 and set(costs.costs) == {
            "all_gather",
            "reduce_scatter",
            "all_reduce",
            "all_to_all",
        }
        for cost in costs.costs.values():
            assert cost.seconds_per_byte > 0 and cost.latency_s >= 0
        # the contention factor that reproduces the measured overlap: from 1 (fully hidden) to serial
        assert 1.0 <= costs.overlap_slowdown <= MAX_OVERLAP_SLOWDOWN
    # CPU timing on a shared 2-core machine (both ranks and gloo's threads on 2 cores) is noisy:
    # a factor of 5 in one of 3 measurements still fails a model that is wrong in units (1000x)
    # or ignores bandwidth, which misses in all of them
    predictions = [(CollectiveCosts.from_json(c).seconds("all_gather", FRESH_BYTES), fresh) for c, fresh in measured0]
    assert _within_a_factor_of_5(CollectiveCosts.from_json(measured0[-1][0]), measured0[-1][1]), predictions
    compute = ComputeCosts.from_json(compute0)
    assert compute.flops_per_s > 0 and compute.bytes_per_s > 0 and compute.op_overhead_s > 0


def test_world_of_one_measures_zero_cost():
    costs = measure_collective_costs()
    assert costs.world_size == 1 and all(c == CollectiveCost() for c in costs.costs.values())


def test_a_block_traced_once_is_priced_at_every_call():
    """With zcompile.mark_repeated_blocks each layer is an invoke_subgraph call: the cost model
    prices the calls by their subgraph's nodes, so the predicted compute equals the unmarked
    model's (without it, the blocks' compute would count as nothing)."""
    import zcompile
    from support.models import GPT, GPTConfig, synthetic_batch
    from zcompile.predict.cost_model import predict_step

    config = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)
    compute = ComputeCosts(flops_per_s=1e9, bytes_per_s=1e9, op_overhead_s=1e-6)
    predicted = {}
    for regional in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = GPT(config)
        if regional:
            zcompile.mark_repeated_blocks(model)
        graphs = []
        compiled = torch.compile(model, backend="zero", options={"stage": 3, "on_compile": graphs.append})
        compiled(*synthetic_batch(0, 2, config)).backward()
        predicted[regional] = predict_step(graphs, CollectiveCosts(), compute).compute_s
    torch._dynamo.reset()
    # equal up to a few ops' overhead (the partitions differ slightly at the blocks' borders)
    assert predicted[True] == pytest.approx(predicted[False], rel=0.03), predicted


def test_op_classes_have_their_own_rates():
    """GELU and softmax move bytes at the transcendental rate, an add at the memory one; attention's
    FLOPs run at the attention rate (the CPU's, ``cpu-local``: 10-15 GB/s against 70-90)."""
    costs = ComputeCosts(flops_per_s=8.0, bytes_per_s=96.0, attention_flops_per_s=2.0, transcendental_bytes_per_s=16.0)
    gelu = _single_op_graph(aten.gelu.default, [(4, 6)])
    softmax = _single_op_graph(aten._softmax.default, [(4, 6)], -1, False)
    add = _single_op_graph(aten.add.Tensor, [(4, 6), (4, 6)])
    assert node_seconds(gelu, costs) == 2 * 96 / 16.0 and node_seconds(softmax, costs) == 2 * 96 / 16.0
    assert node_seconds(add, costs) == 3 * 96 / 96.0
    b, h, s, d = 2, 3, 5, 4
    sdpa = _single_op_graph(aten._scaled_dot_product_flash_attention_for_cpu.default, [(b, h, s, d)] * 3)
    assert node_seconds(sdpa, costs) == node_flops(sdpa) / 2.0
    # without the optional rates every op is on the plain roofline, as before
    plain = ComputeCosts(flops_per_s=8.0, bytes_per_s=96.0)
    assert node_seconds(gelu, plain) == 2 * 96 / 96.0 and node_seconds(sdpa, plain) == node_flops(sdpa) / 8.0
    # scaled keeps the classes apart
    assert node_seconds(gelu, costs.scaled(2.0)) == 2 * node_seconds(gelu, costs)


def _fits_in_turn(monkeypatch, fits_by_kind: dict) -> list[str]:
    """``_measure_kind`` replaced by the given fits, each kind's in turn (its last one repeated);
    returns the kinds as measured, in order."""
    import zcompile.predict.cost_model as cost_model

    measured = []

    def measure_kind(kind, *args):
        measured.append(kind)
        fits = fits_by_kind[kind]
        return fits.pop(0) if len(fits) > 1 else fits[0]

    monkeypatch.setattr(cost_model, "_measure_kind", measure_kind)
    return measured


def test_a_collective_whose_time_did_not_grow_with_its_size_is_measured_again(monkeypatch, caplog):
    """A burst of load at the larger sizes makes a fit flat (once, in CI, for one kind): it is measured
    again, not kept as free bandwidth; still flat after ``MEASURE_AGAIN`` more, a warning names it."""
    from support.graph_builders import fake_process_group
    from zcompile.predict.cost_model import MEASURE_AGAIN

    steady = [1e-4, 1e-10, 1e-5, 0.0]
    flat_then_steady = {kind: [list(steady)] for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")}
    flat_then_steady["all_reduce"] = [[2e-3, 0.0, 1e-5, 0.0], [1e-4, 3e-10, 1e-5, 0.0]]
    measured = _fits_in_turn(monkeypatch, flat_then_steady)
    with fake_process_group(world_size=2):
        costs = measure_collective_costs(measure_overlap=False)
    assert measured == ["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "all_reduce"]
    assert costs.costs["all_reduce"] == CollectiveCost(1e-4, 3e-10, 1e-5, 0.0)
    assert costs.costs["all_gather"] == CollectiveCost(*steady)

    always_flat = {kind: [list(steady)] for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")}
    always_flat["all_to_all"] = [[2e-3, 0.0, 1e-5, 0.0]]
    measured = _fits_in_turn(monkeypatch, always_flat)
    with fake_process_group(world_size=2), caplog.at_level("WARNING", logger="zcompile.predict.cost_model"):
        costs = measure_collective_costs(measure_overlap=False)
    assert measured.count("all_to_all") == 1 + MEASURE_AGAIN and costs.costs["all_to_all"].seconds_per_byte == 0.0
    assert any("the time of all_to_all did not grow with its size" in r.getMessage() for r in caplog.records)
