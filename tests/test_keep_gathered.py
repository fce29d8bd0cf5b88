"""Keep gathered: the plan on a hand-built joint graph, and training that keeps weights for backward."""

import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import CheckpointPolicy

from support.launch import run_ranks
from support.training import RunSpec, assert_same_training, train_reference, zero_run_on_rank
from zcompile.passes import metadata
from zcompile.passes.collectives import ALL_GATHER, WAIT
from zcompile.passes.keep_gathered import keep_gathered_pass, plan_keep_gathered
from zcompile.passes.param_gather import GATHER_SHARDS

aten = torch.ops.aten


def _joint_graph(shard_sizes=(8, 8, 8), world=2, one_op=False):
    """A joint graph: per parameter i, all-gather -> wait -> view (the weight), tagged MUST_RECOMPUTE,
    or with ``one_op`` the ``zcompile::gather_shards`` node stage 3 traces instead (param_gather);
    forward x = x @ w_i for the first params and x + w_last (a bias); backward reads every w_i
    except the bias (d(x + b)/dx needs no b)."""
    mode = FakeTensorMode()
    graph = torch.fx.Graph()
    n = world * shard_sizes[0]
    x = graph.placeholder("primals_x")
    shards = [graph.placeholder(f"primals_{i}") for i in range(len(shard_sizes))]
    tangent = graph.placeholder("tangents_1")
    with mode:
        x.meta["val"] = tangent.meta["val"] = torch.empty(n, n)
        for shard, size in zip(shards, shard_sizes):
            shard.meta["val"] = torch.empty(size * n)
    weights = []
    for i, shard in enumerate(shards):
        shape = [n, world * shard_sizes[i]]
        if one_op:
            chain = [
                graph.call_function(
                    GATHER_SHARDS, (shard, n * shape[1], shape, world, "0", torch.float32), name=f"w{i}"
                )
            ]
        else:
            gather = graph.call_function(ALL_GATHER, (shard, world, "0"), name=f"gather{i}")
            wait = graph.call_function(WAIT, (gather,), name=f"wait{i}")
            chain = [gather, wait, graph.call_function(aten.view.default, (wait, [n, -1]), name=f"w{i}")]
            with mode:
                gather.meta["val"] = wait.meta["val"] = torch.empty(world * shard_sizes[i] * n)
        weight = chain[-1]
        with mode:
            weight.meta["val"] = torch.empty(shape)
        for node in chain:
            node.meta[metadata.RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE
            metadata.tag(node, role=metadata.ROLE_GATHER, param=f"p{i}")
        weights.append(weight)
    activations = [x]
    for i, weight in enumerate(weights):
        op = aten.add.Tensor if i == len(weights) - 1 else aten.mm.default
        x = graph.call_function(op, (x, weight), name=f"layer{i}")
        with mode:
            x.meta["val"] = torch.empty(n, n)
        activations.append(x)
    grad = tangent
    for i in reversed(range(len(weights) - 1)):  # the bias's gradient is the tangent itself
        transposed = graph.call_function(aten.t.default, (weights[i],), name=f"w{i}_t")
        grad = graph.call_function(aten.mm.default, (grad, transposed), name=f"grad{i}")
        with mode:
            transposed.meta["val"] = grad.meta["val"] = torch.empty(n, n)
    graph.output((x, grad))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("one_op", [False, True], ids=["all_gather", "gather_shards"])
def test_plan_keeps_what_backward_reads_last_layers_first(one_op):
    gm = _joint_graph(one_op=one_op)
    weight_bytes = 2 * 8 * 16 * 4  # world x shard x rows x fp32
    plan = plan_keep_gathered(gm, budget_bytes=10 * weight_bytes)
    # the bias (p2) is never re-gathered, so it is no candidate; p1 is later in forward than p0
    assert plan.kept_params == ["p1", "p0"] and plan.regathered == []
    assert plan.kept[0].bytes_kept == weight_bytes and plan.kept[0].bytes_saved == weight_bytes // 2
    assert json.loads(plan.to_json())["kept_bytes"] == 2 * weight_bytes
    one = plan_keep_gathered(gm, budget_bytes=weight_bytes + 1)
    assert one.kept_params == ["p1"] and [p.param for p in one.regathered] == ["p0"]
    assert plan_keep_gathered(gm, budget_bytes=weight_bytes - 1).kept_params == []


def test_plan_prefers_more_saved_per_kept_byte():
    # same bytes kept, but p0's re-gather runs over 4 ranks (receives 3/4 of them) and p1's over 2
    gm = _joint_graph(shard_sizes=(8, 8, 8))
    gm.graph.find_nodes(op="call_function", target=ALL_GATHER)[0].update_arg(1, 4)
    plan = plan_keep_gathered(gm, budget_bytes=2 * 8 * 16 * 4)
    assert plan.kept_params == ["p0"]  # saves 3/4 of its bytes, p1 only 1/2


@pytest.mark.parametrize("one_op", [False, True], ids=["all_gather", "gather_shards"])
def test_pass_lifts_only_the_kept_tags(one_op):
    gm = _joint_graph(one_op=one_op)
    plan = plan_keep_gathered(gm, budget_bytes=2 * 8 * 16 * 4)
    keep_gathered_pass(gm, plan)
    tagged = {
        metadata.tags(n)[metadata.PARAM]
        for n in gm.graph.nodes
        if n.meta.get(metadata.RECOMPUTE) == CheckpointPolicy.MUST_RECOMPUTE
    }
    assert tagged == {"p0", "p2"}


SPECS = [
    RunSpec(model="gpt", stage=3, optimizer="sgd", lr=0.1, options={"bucket_mb": 0.01}),
    RunSpec(model="gpt", stage=3, optimizer="sgd", lr=0.1, options={"bucket_mb": 0.01, "keep_gathered_mb": 100}),
    RunSpec(model="gpt", stage=3, optimizer="adamw", options={"keep_gathered_mb": 0.05}),
]


@pytest.fixture(scope="module")
def kept_runs():
    return run_ranks(2, zero_run_on_rank, SPECS, timeout_s=600)[0]


@pytest.mark.parametrize("index", range(len(SPECS)))
def test_training_with_kept_weights_equals_single_process(kept_runs, index):
    spec, result = SPECS[index], kept_runs[index]
    assert_same_training(result, train_reference(spec, world=2), spec)


def test_kept_weights_are_not_regathered(kept_runs):
    baseline, everything, budget = (r.facts for r in kept_runs)
    assert baseline["kept_params"] == 0 and baseline["saved_gathered"] == 0
    # every weight backward reads is kept: no all-gather left in backward
    assert everything["kept_params"] == baseline["bw_all_gathers"] > 0
    assert everything["bw_all_gathers"] == 0 and everything["saved_gathered"] > 0
    # within a budget: kept ones leave backward; kept bytes fit; no re-gathered one would still fit
    (plan,) = budget["keep_plans"]
    assert 0 < budget["kept_params"] < baseline["bw_all_gathers"]
    assert budget["bw_all_gathers"] == baseline["bw_all_gathers"] - budget["kept_params"]
    assert plan["kept_bytes"] <= 0.05 * 2**20
    assert all(p["bytes_kept"] > 0.05 * 2**20 - plan["kept_bytes"] for p in plan["regathered"])
    assert budget["report_kept_bytes"] == plan["kept_bytes"]
