"""Bucketing: the plan on hand-built graphs, and bucketed training equal to a single process."""

import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from support.launch import run_ranks
from support.training import RunSpec, assert_same_training, train_reference, zero_run_on_rank
from zcompile.passes import metadata
from zcompile.passes.bucket_ops import PACK_BUCKET, UNPACK_BUCKET, pack_bucket, unpack_bucket
from zcompile.passes.bucketing import bucket_collectives_pass, plan_buckets
from zcompile.passes.collectives import ALL_GATHER, REDUCE_SCATTER, WAIT

aten = torch.ops.aten


def _gather_graph(shard_sizes, world=2, reduce=False, average=False):
    """placeholders -> per-parameter all-gather (+ wait) -> a use each; optionally reduce-scatters,
    their results divided by ``world`` (the mean, as ``graph_ops`` averages gradients)."""
    mode = FakeTensorMode()
    graph = torch.fx.Graph()
    outputs = []
    for i, size in enumerate(shard_sizes):
        shard = graph.placeholder(f"shard{i}")
        with mode:
            shard.meta["val"] = torch.empty(size)
        if reduce:
            full = graph.placeholder(f"grad{i}")
            with mode:
                full.meta["val"] = torch.empty(size * world)
            op = graph.call_function(REDUCE_SCATTER, (full, "sum", world, "0"))
        else:
            op = graph.call_function(ALL_GATHER, (shard, world, "0"))
        metadata.tag(op, role=metadata.ROLE_REDUCE if reduce else metadata.ROLE_GATHER, param=f"p{i}")
        wait = graph.call_function(WAIT, (op,))
        use = graph.call_function(aten.div.Tensor if average else aten.mul.Tensor, (wait, world if average else 2.0))
        with mode:
            out_size = size if reduce else size * world
            op.meta["val"] = wait.meta["val"] = use.meta["val"] = torch.empty(out_size)
        outputs.append(use)
    graph.output(tuple(outputs))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_plan_groups_consecutive_collectives_up_to_the_budget():
    gm = _gather_graph([100, 50, 30, 400])
    # per-rank volume: 2 x shard x 4 bytes = 800, 400, 240, 3200 bytes
    plan = plan_buckets(gm, bucket_bytes=1500, graph="forward")
    assert [b.params for b in plan.buckets] == [("p0", "p1", "p2")]  # p3 alone: left unbucketed
    assert plan.buckets[0].sizes == (100, 50, 30)
    assert json.loads(plan.to_json())["buckets"][0]["members"] == list(plan.buckets[0].members)
    assert plan_buckets(_gather_graph([100, 50, 30, 400]), 1500).buckets == plan.buckets  # deterministic
    assert [b.params for b in plan_buckets(gm, bucket_bytes=1000).buckets] == [("p1", "p2")]  # 800 + 400 > 1000
    assert plan_buckets(gm, bucket_bytes=100).buckets == []


@pytest.mark.parametrize("reduce", [False, True], ids=["all_gather", "reduce_scatter"])
def test_pass_rewrites_a_bucket_into_one_collective(reduce):
    gm = _gather_graph([3, 5, 7], reduce=reduce)
    plan = plan_buckets(gm, bucket_bytes=10**6)
    gm = bucket_collectives_pass(gm, plan)
    op = REDUCE_SCATTER if reduce else ALL_GATHER
    collectives = gm.graph.find_nodes(op="call_function", target=op)
    assert len(collectives) == 1
    assert metadata.params_of(collectives[0]) == ["p0", "p1", "p2"]
    # one flat buffer: 15 elements per rank in, 30 out for the gather (the reverse for the reduction)
    assert collectives[0].args[0].meta["val"].shape == ((30,) if reduce else (15,))
    assert collectives[0].meta["val"].shape == ((15,) if reduce else (30,))
    # every use still gets its own tensor of the member's size, after the bucket's wait
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    wait = next(iter(collectives[0].users))
    uses = gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor)
    assert [u.args[0].meta["val"].shape[0] for u in uses] == ([3, 5, 7] if reduce else [6, 10, 14])
    assert all(order[u] > order[wait] for u in uses)


def test_bucket_ops_equal_torchs_cat_and_split():
    torch.manual_seed(0)
    world, sizes = 4, [3, 1, 6]
    members = [torch.randn(world * size) for size in sizes]
    flat = pack_bucket(members, world)
    # rank r's row holds every member's r-th slice, in member order: what the reduce-scatter hands rank r
    expected = torch.cat([m.view(world, -1) for m in members], dim=1).reshape(-1)
    assert torch.equal(flat, expected)
    pieces = unpack_bucket(flat, world, sizes, 1.0)
    assert all(torch.equal(piece, member) for piece, member in zip(pieces, members))
    # each piece its own storage: a gradient must not keep its bucket (and the other members) alive
    storages = {t.untyped_storage().data_ptr() for t in (flat, *pieces)}
    assert len(storages) == 1 + len(pieces)
    reduced = torch.randn(sum(sizes))
    averaged = unpack_bucket(reduced, 1, sizes, 4.0)
    assert all(torch.equal(a, r / 4) for a, r in zip(averaged, reduced.split(sizes)))  # div's own rounding
    shards = [torch.randn(size) for size in sizes]
    assert torch.equal(pack_bucket(shards, 1), torch.cat(shards))  # an all-gather's input: one row
    with FakeTensorMode():
        fake = unpack_bucket(torch.empty(world * 10), world, sizes, 1.0)
        assert [p.shape[0] for p in fake] == [12, 4, 24]
        assert pack_bucket([torch.empty(8), torch.empty(4)], world).shape == (12,)


@pytest.mark.parametrize("reduce", [False, True], ids=["all_gather", "reduce_scatter"])
def test_a_bucket_is_copied_in_and_out_once_not_per_member(reduce):
    """One pack (and for a gather one unpack) per bucket, nothing per member; the members' means
    over ranks become one division of the bucket."""
    gm = _gather_graph([3, 5, 7], reduce=reduce, average=reduce)
    gm = bucket_collectives_pass(gm, plan_buckets(gm, bucket_bytes=10**6))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(PACK_BUCKET) == 1 and targets.count(UNPACK_BUCKET) == 1
    assert not {aten.clone.default, aten.cat.default, aten.div.Tensor} & set(targets)
    (unpack,) = gm.graph.find_nodes(op="call_function", target=UNPACK_BUCKET)
    assert unpack.args[3] == (2.0 if reduce else 1.0)  # the members' mean over the 2 ranks, in the unpack
    outputs = gm.graph.output_node().args[0]
    assert [o.meta["val"].shape[0] for o in outputs] == ([3, 5, 7] if reduce else [6, 10, 14])


def test_flattened_gradients_are_packed_as_they_are():
    """A gradient flattened only to be reduce-scattered (``graph_ops``: ``grad.reshape(-1)``) goes
    into the pack unflattened, and its view leaves the graph; the pack reads it to the same buffer."""
    world, shapes = 2, [(4, 3), (2, 5)]
    mode = FakeTensorMode()
    graph = torch.fx.Graph()
    outputs = []
    for i, shape in enumerate(shapes):
        grad = graph.placeholder(f"grad{i}")
        flat = graph.call_function(aten.view.default, (grad, [-1]))
        op = graph.call_function(REDUCE_SCATTER, (flat, "sum", world, "0"))
        metadata.tag(op, role=metadata.ROLE_REDUCE, param=f"p{i}")
        wait = graph.call_function(WAIT, (op,))
        with mode:
            grad.meta["val"] = torch.empty(shape)
            flat.meta["val"] = torch.empty(grad.meta["val"].numel())
            op.meta["val"] = wait.meta["val"] = torch.empty(grad.meta["val"].numel() // world)
        outputs.append(wait)
    graph.output(tuple(outputs))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    gm = bucket_collectives_pass(gm, plan_buckets(gm, bucket_bytes=10**6))
    (pack,) = gm.graph.find_nodes(op="call_function", target=PACK_BUCKET)
    assert [member.name for member in pack.args[0]] == ["grad0", "grad1"]
    assert not gm.graph.find_nodes(op="call_function", target=aten.view.default)
    grads = [torch.randn(shape) for shape in shapes]
    assert torch.equal(pack_bucket(grads, world), pack_bucket([g.reshape(-1) for g in grads], world))


SPECS = [
    RunSpec(model="gpt", stage=3, optimizer="sgd", lr=0.1, options={"bucket_mb": 0.01}),  # several buckets
    RunSpec(model="gpt_untied_odd", stage=3, optimizer="sgd", lr=0.1, options={"bucket_mb": 4}),
    RunSpec(model="gpt", stage=2, optimizer="sgd", lr=0.1, options={"bucket_mb": 4}),
    RunSpec(model="gpt", stage=3, optimizer="sgd", lr=0.1, options={"bucket_mb": 0}),
]


@pytest.fixture(scope="module")
def bucketed_runs():
    return run_ranks(2, zero_run_on_rank, SPECS, timeout_s=600)[0]


@pytest.mark.parametrize("index", range(len(SPECS)))
def test_bucketed_training_equals_single_process(bucketed_runs, index):
    spec, result = SPECS[index], bucketed_runs[index]
    assert_same_training(result, train_reference(spec, world=2), spec)
    facts = result.facts
    assert facts["gathered_twice"] == 0 and facts["saved_gathered"] == 0
    if spec.stage == 3:
        assert facts["fw_all_gathers"] == facts["bw_reduce_scatters"] == facts["gather_nodes"]


def test_bucketing_cuts_collectives_but_not_volume(bucketed_runs):
    small, _, _, unbucketed = bucketed_runs
    assert unbucketed.facts["collective_ops"] == 28 + 19 + 28  # one per parameter use
    assert 3 < small.facts["collective_ops"] < unbucketed.facts["collective_ops"]
    volume = lambda r: sum(c.elements for c in r.collectives)  # noqa: E731
    assert volume(small) == volume(unbucketed)
