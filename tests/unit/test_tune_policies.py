"""Schedule policies on the hand-built layered graph: the policy interface of the schedule pass
(greedy prefetch unchanged, a custom policy followed, bad depths refused with the rule) and the
cost-guided policy's depths against timelines worked out by hand."""

import pytest

from support.hand_built import layered_graph
from zcompile.passes.schedule import greedy_prefetch, plan_schedule, schedule_pass, schedule_problem
from zcompile.predict.cost_model import CollectiveCost, CollectiveCosts, ComputeCosts, predict
from zcompile.tune.policies import CostGuidedPrefetch, policy_from_name

# as in test_cost_model: a layer (mul of two 64-byte fp32 tensors) takes 3 s, an all-gather of
# 64 bytes 1 + 64/64 = 2 s
COMPUTE = ComputeCosts(flops_per_s=1e9, bytes_per_s=64.0)
FAST = CollectiveCosts(2, {"all_gather": CollectiveCost(1.0, 1 / 64), "reduce_scatter": CollectiveCost(0.5, 1 / 128)})
SLOW = CollectiveCosts(2, {"all_gather": CollectiveCost(4.0, 1 / 64)})  # 5 s: longer than a layer


def _depths(plan):
    return [c.depth for c in plan.collectives if c.kind == "all_gather"]


def test_problem_lists_gathers_in_order_of_first_use():
    problem, reduces = schedule_problem(layered_graph(), prefetch=2)
    assert [(g.name, g.first_use, g.bytes) for g in problem.gathers] == [
        ("gather0", "layer0", 64),
        ("gather1", "layer1", 64),
        ("gather2", "layer2", 64),
    ]
    assert [r.name for r in reduces] == ["reduce"]
    assert problem.nodes[problem.gathers[1].position].name == "layer1"
    assert problem.peak_bytes([0, 1, 2]) == 3 * 64 and problem.peak_bytes([0, 0, 0]) == 64


def test_greedy_is_the_default_policy_and_a_custom_one_is_followed():
    gm = layered_graph()
    assert plan_schedule(gm, prefetch=2).to_json() == plan_schedule(gm, prefetch=2, policy=greedy_prefetch).to_json()
    assert _depths(plan_schedule(gm, prefetch=2)) == [0, 1, 2]

    def no_prefetch_for_the_last(problem):
        return [min(j, 1) if j < len(problem.gathers) - 1 else 0 for j in range(len(problem.gathers))]

    plan = plan_schedule(gm, prefetch=2, policy=no_prefetch_for_the_last)
    assert _depths(plan) == [0, 1, 0] and plan.policy == "no_prefetch_for_the_last"
    order = [n.name for n in schedule_pass(gm, plan).graph.nodes if n.op == "call_function"]
    assert order.index("gather1") < order.index("layer0") and order.index("layer1") < order.index("gather2")


@pytest.mark.parametrize(
    "depths, message",
    [
        (
            [0, 1],
            r"returned 2 depths for the 3 all-gathers of graph 'g'; return one prefetch depth per problem.gathers",
        ),
        ([0, 2, 1], r"depth 2 for all-gather 1 \(gather1\) of graph 'g'; a depth is an int 0 <= depth <= 1"),
        ([0, 1, -1], r"depth -1 for all-gather 2"),
        ([0, 1.0, 1], r"depth 1.0 for all-gather 1"),
    ],
)
def test_bad_depths_are_refused_naming_the_policy_and_the_rule(depths, message):
    def broken(problem):
        return depths

    with pytest.raises(ValueError, match=r"schedule_policy 'broken'.*" + message):
        plan_schedule(layered_graph(), prefetch=2, graph="g", policy=broken)


def test_cost_guided_takes_the_least_depth_that_hides_the_transfer():
    # compute clock at the layers: 0, 3, 6. gather0 [0, 2] (depth 0: nothing before it). gather1 at
    # depth 0 would start at 3, at depth 1 it starts at 0 but queues behind gather0: [2, 4], not done
    # by 3 either: depth 1, the deepest prefetch 2 allows for j = 1. gather2 at depth 1 is issued at
    # 3, starts when gather1 is done (4), ends at 6 = its first use: hidden, so not depth 2.
    policy = CostGuidedPrefetch(FAST, COMPUTE)
    plan = plan_schedule(layered_graph(), prefetch=2, policy=policy)
    assert _depths(plan) == [0, 1, 1] and plan.policy == "cost_guided"
    assert plan.peak_gathered_bytes == 2 * 64 < plan_schedule(layered_graph(), prefetch=2).peak_gathered_bytes
    # the cost model agrees that the greedy depth 2 buys nothing: same predicted step
    gm_cost, gm_greedy = layered_graph(), layered_graph()
    cost_step = predict(schedule_pass(gm_cost, plan), FAST, COMPUTE).step_s
    greedy_step = predict(schedule_pass(gm_greedy, plan_schedule(gm_greedy, prefetch=2)), FAST, COMPUTE).step_s
    assert cost_step == greedy_step


def test_cost_guided_goes_deep_when_transfers_are_slow_and_stays_in_the_budget():
    # 5 s gathers: gather1 at depth 1 is [5, 10], needed at 3: depth 1 (deepest allowed); gather2 is
    # needed at 6, and queues behind gather1 at any depth ([10, 15]): nothing hides it, so the deepest
    assert _depths(plan_schedule(layered_graph(), prefetch=2, policy=CostGuidedPrefetch(SLOW, COMPUTE))) == [0, 1, 2]
    budget = plan_schedule(layered_graph(), prefetch=2, memory_budget=2 * 64, policy=CostGuidedPrefetch(SLOW, COMPUTE))
    assert _depths(budget) == [0, 1, 1] and budget.peak_gathered_bytes <= 2 * 64
    # free transfers (a world of one): depth 0 already hides them
    free = CostGuidedPrefetch(CollectiveCosts(1), COMPUTE)
    assert _depths(plan_schedule(layered_graph(), prefetch=2, policy=free)) == [0, 0, 0]


def test_policy_names():
    assert policy_from_name("greedy", FAST, COMPUTE) is None
    assert policy_from_name("cost_guided", FAST, COMPUTE) == CostGuidedPrefetch(FAST, COMPUTE)
    with pytest.raises(ValueError, match="not a built-in policy"):
        policy_from_name("lookahead", FAST, COMPUTE)
