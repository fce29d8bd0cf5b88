"""The schedule pass on hand-built graphs, and scheduled training equal to a single process."""

import json

import pytest

from support.hand_built import layered_graph, reduce_chain_graph
from support.launch import run_ranks
from support.training import RunSpec, assert_same_training, train_reference, zero_run_on_rank
from zcompile.passes.schedule import plan_schedule, schedule_pass


def _order(gm):
    return [n.name for n in gm.graph.nodes if n.op == "call_function"]


def test_prefetch_issues_the_next_gather_before_the_current_layer():
    gm = layered_graph()
    plan = plan_schedule(gm, prefetch=1)
    assert [(c.name, c.issue_before, c.depth) for c in plan.collectives if c.kind == "all_gather"] == [
        ("gather0", "layer0", 0),
        ("gather1", "layer0", 1),
        ("gather2", "layer1", 1),
    ]
    assert json.loads(plan.to_json())["prefetch"] == 1
    order = _order(schedule_pass(gm, plan))
    # gather1 is in flight while layer0 computes; each wait sits right before its own layer
    assert order.index("gather1") < order.index("layer0") < order.index("wait1") < order.index("layer1")
    assert order.index("gather2") < order.index("layer1") < order.index("wait2") < order.index("layer2")
    # the reduce-scatter goes out as soon as its input exists; its wait after the remaining compute
    assert order.index("reduce") < order.index("tail") < order.index("reduce_wait")
    # 2 gathered buffers alive at once: one computing, one in flight (16 fp32 = 64 bytes each)
    assert plan.peak_gathered_bytes == 2 * 64


def test_reduce_scatters_are_waited_two_later():
    """Issued as soon as their bucket's gradients exist, each waited just before the reduce-scatter two
    later goes out: at most two in flight, each holding its input (a bucket's full gradients) until
    its wait; the last two waited at the end."""
    gm = reduce_chain_graph(buckets=4)
    plan = plan_schedule(gm, prefetch=1)
    assert [(c.name, c.wait_before) for c in plan.collectives] == [
        ("reduce0", "reduce2"),
        ("reduce1", "reduce3"),
        ("reduce2", ""),
        ("reduce3", ""),
    ]
    order = _order(schedule_pass(gm, plan))
    assert order == [
        "grad0",
        "reduce0",
        "grad1",
        "reduce1",
        "grad2",
        "reduce_wait0",
        "reduce2",
        "grad3",
        "reduce_wait1",
        "reduce3",
        "reduce_wait2",
        "reduce_wait3",
    ]


def test_memory_budget_lowers_prefetch_depth():
    gm = layered_graph()
    plan = plan_schedule(gm, prefetch=2, memory_budget=2 * 64)
    depths = [c.depth for c in plan.collectives if c.kind == "all_gather"]
    assert depths == [0, 1, 1]  # depth 2 would hold 3 buffers
    assert plan.peak_gathered_bytes <= 2 * 64
    no_prefetch = plan_schedule(gm, prefetch=2, memory_budget=64)
    assert [c.depth for c in no_prefetch.collectives if c.kind == "all_gather"] == [0, 0, 0]
    assert no_prefetch.peak_gathered_bytes == 64
    # peak does not grow with depth of the model
    deeper = plan_schedule(layered_graph(layers=8), prefetch=1)
    assert deeper.peak_gathered_bytes == plan_schedule(gm, prefetch=1).peak_gathered_bytes


def test_plan_is_deterministic():
    assert plan_schedule(layered_graph(), 1).to_json() == plan_schedule(layered_graph(), 1).to_json()


SPECS = [
    RunSpec(model="gpt", stage=3, optimizer="sgd", lr=0.1, options={"bucket_mb": 0.01, "prefetch": 2}),
    RunSpec(model="hf_llama", stage=3, optimizer="sgd", lr=0.1, options={"bucket_mb": 0.01}),
    RunSpec(model="gpt", stage=3, optimizer="sgd", lr=0.1, options={"bucket_mb": 0.01, "memory_budget_mb": 0.02}),
    RunSpec(model="gpt", stage=2, optimizer="sgd", lr=0.1, options={"bucket_mb": 0.01}),
    RunSpec(model="gpt", stage=3, optimizer="sgd", lr=0.1, options={"bucket_mb": 0.01, "overlap": False}),
]


@pytest.fixture(scope="module")
def scheduled_runs():
    return run_ranks(2, zero_run_on_rank, SPECS, timeout_s=600)[0]


@pytest.mark.parametrize("index", range(len(SPECS)))
def test_scheduled_training_equals_single_process(scheduled_runs, index):
    spec, result = SPECS[index], scheduled_runs[index]
    assert_same_training(result, train_reference(spec, world=2), spec)
    assert result.facts["gathered_twice"] == 0 and result.facts["saved_gathered"] == 0
    ops, overlapped = result.facts["collective_ops"], result.facts["overlapped_collectives"]
    if not spec.options.get("overlap", True):
        assert overlapped == 0, result.facts
    elif "memory_budget_mb" in spec.options:
        # a budget of about one bucket leaves no room to prefetch: gathers wait at once, but the
        # reduce-scatters still overlap the backward compute after them
        assert 0 < overlapped < ops, result.facts
    else:
        # all but the first gather of each graph (nothing to hide it behind) overlap compute
        assert overlapped >= ops - 2, result.facts
