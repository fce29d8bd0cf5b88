"""ZeRO++ hpZ passes on single-process graphs (no process group needed to trace or rewrite).

- ``hpz_pass`` on a Dynamo-like stage-3 graph: each ``gather_param`` becomes ``gather_flat`` ->
  ``hpz_secondary`` (MUST_SAVE) -> ``hpz_regather`` (MUST_RECOMPUTE), tagged, wired in that order;
  in a world of one the rewritten graph gives stage 3's output and shard gradients bit for bit.
- ``hpz_forward_shortcut_pass`` on aten forward graphs: the tagged K-rank re-gather and its wait
  are removed and their users read the world gather's result; a re-gather that is not a slice of
  a same-sized gather, an untagged one, or one on another group is left in place.
- Both together: the tags ``hpz_pass`` sets survive tracing to aten, so the shortcut finds them.
"""

import logging

import pytest
import torch
import torch.fx.traceback as fx_traceback
from torch.testing import FileCheck
from torch.utils.checkpoint import CheckpointPolicy

from support.graph_builders import calls, linear_graph, trace
from zcompile.passes import metadata
from zcompile.passes.collectives import ALL_GATHER, WAIT
from zcompile.passes.graph_ops import gather_flat, gather_param, hpz_regather, hpz_secondary
from zcompile.passes.hpz import hpz_forward_shortcut_pass, hpz_pass
from zcompile.passes.param_collectives import insert_param_collectives_pass, plan_sharding

WORLD, HPZ, HPZ_RANK = 4, 2, 1


def _stage3(world=WORLD, group="world"):
    gm, inputs = linear_graph()
    return insert_param_collectives_pass(gm, plan_sharding(gm, inputs, 3, world, group, None, None)), inputs


# ----------------------------------------------------------------------------- hpz_pass (Dynamo graph)
def test_hpz_pass_replaces_each_gather_param_by_gather_secondary_regather():
    gm, _ = _stage3()
    assert len(calls(gm, gather_param)) == 2  # the input really has gathers to replace
    gm = hpz_pass(gm, HPZ, HPZ_RANK, "hpz")
    assert calls(gm, gather_param) == []
    # per parameter, in order: world gather of the shard, this rank's 1/K slice of it, K-rank re-gather
    # of the slices (which also reads the world gather: its gradient goes there); compute reads the last.
    for shard, numel, shape, suffix in (("weight_shard", 15, "(3, 5)", ""), ("bias_shard", 3, "(3,)", "_1")):
        FileCheck().check(f"gather_flat{suffix} = ").check_same(
            f"gather_flat({shard}, 4, 'world', torch.float32, None)"
        ).check_next(f"hpz_secondary{suffix} = ").check_same(f"hpz_secondary(gather_flat{suffix}, 2, 1)").check_next(
            f"hpz_regather{suffix} = "
        ).check_same(f"hpz_regather(gather_flat{suffix}, hpz_secondary{suffix}, {numel}, {shape}, 2, 'hpz')").run(
            gm.code
        )
    FileCheck().check("linear(x, hpz_regather, hpz_regather_1)").check("sum(hpz_regather)").check_not(
        "gather_param"
    ).run(gm.code)


def test_hpz_pass_tags_roles_params_and_recompute_policies():
    gm = hpz_pass(_stage3()[0], HPZ, HPZ_RANK, "hpz")
    expected = {
        gather_flat: (metadata.ROLE_GATHER, None),
        hpz_secondary: (metadata.ROLE_HPZ_SECONDARY, CheckpointPolicy.MUST_SAVE),
        hpz_regather: (metadata.ROLE_HPZ_REGATHER, CheckpointPolicy.MUST_RECOMPUTE),
    }
    for target, (role, policy) in expected.items():
        nodes = calls(gm, target)
        assert [metadata.tags(n)[metadata.PARAM] for n in nodes] == ["weight", "bias"]
        assert all(metadata.tags(n)[metadata.ROLE] == role for n in nodes)
        assert all(n.meta.get(metadata.RECOMPUTE) == policy for n in nodes)


def test_hpz_pass_world_of_one_matches_stage3_forward_and_backward():
    # With one rank and K = 1 no collective runs, so the rewritten wiring (which tensor feeds which
    # op, the gradient path through hpz_regather back to gather_flat) is checked against stage 3.
    results = []
    for rewrite in (False, True):
        gm, inputs = _stage3(world=1, group=None)
        if rewrite:
            gm = hpz_pass(gm, 1, 0, None)
        shards = [inputs[0].detach().reshape(-1).requires_grad_(), inputs[1], inputs[2].detach().requires_grad_()]
        out = gm(*shards)[0]
        out.square().sum().backward()
        results.append((out.detach(), shards[0].grad, shards[2].grad))
    assert len(calls(gm, hpz_regather)) == 2
    for want, got in zip(*results):
        assert torch.equal(got, want)


# ----------------------------------------------------------------------------- hpz_forward_shortcut_pass
def _forward(secondary_of, regather_group="hpz", tag=True, shard_numel=4):
    """aten forward: world gather -> secondary slice -> K-rank gather on ``regather_group`` -> use."""

    def forward(shard):
        padded = WAIT(ALL_GATHER(shard, WORLD, "world"))
        secondary = secondary_of(padded)
        return WAIT(ALL_GATHER(secondary, HPZ, regather_group)) * 2

    gm = trace(forward, torch.zeros(shard_numel))
    if tag:  # what hpz_pass's tag becomes on the aten nodes (test_passes_compose checks that it does)
        for node in calls(gm, ALL_GATHER):
            if node.args[2] == regather_group:
                metadata.tag(node, role=metadata.ROLE_HPZ_REGATHER)
    return gm


def _hpz_secondary(padded):  # what graph_ops.hpz_secondary traces to
    return padded.view(HPZ, -1)[HPZ_RANK].clone()


def test_forward_shortcut_reads_the_world_gather_instead_of_regathering():
    gm = _forward(_hpz_secondary)
    assert len(calls(gm, ALL_GATHER)) == 2
    gm = hpz_forward_shortcut_pass(gm, "hpz")
    gathers, waits = calls(gm, ALL_GATHER), calls(gm, WAIT)
    assert [g.args[2] for g in gathers] == ["world"] and len(waits) == 1
    (mul,) = calls(gm, torch.ops.aten.mul.Tensor)
    assert mul.args[0] is waits[0]  # the user now reads the world gather's wait
    FileCheck().check_count("all_gather_into_tensor.default(", 1, exactly=True).check_not("'hpz'").run(gm.code)
    FileCheck().check("wait_tensor = ").check("mul.Tensor(wait_tensor, 2)").run(gm.code)


def test_forward_shortcut_leaves_a_regather_of_another_size(caplog):
    # The slice is 1/4 of the world gather, so K = 2 slices are half its size: not the same tensor.
    gm = _forward(lambda padded: padded[:4].clone())
    before = gm.code
    with caplog.at_level(logging.WARNING, logger="zcompile.passes.hpz"):
        gm = hpz_forward_shortcut_pass(gm, "hpz")
    assert "left in place" in caplog.text
    assert gm.code == before
    assert len(calls(gm, ALL_GATHER)) == 2


@pytest.mark.parametrize("tag, pass_group", [(False, "hpz"), (True, "other")])
def test_forward_shortcut_ignores_untagged_or_other_group_gathers(tag, pass_group):
    gm = _forward(_hpz_secondary, tag=tag)
    before = gm.code
    assert hpz_forward_shortcut_pass(gm, pass_group).code == before


# ----------------------------------------------------------------------------- both passes, through tracing
def test_passes_compose():
    # hpz_pass's tags are copied onto the aten nodes when the Dynamo graph is traced (as AOTAutograd
    # does: an Interpreter under preserve_node_meta), and the shortcut then drops every K-rank gather.
    gm = hpz_pass(_stage3()[0], HPZ, HPZ_RANK, "hpz")
    with fx_traceback.preserve_node_meta():
        fwd = trace(lambda *a: torch.fx.Interpreter(gm).run(*a), torch.zeros(4), torch.zeros(2, 5), torch.zeros(1))
    regathers = [n for n in calls(fwd, ALL_GATHER) if metadata.tags(n).get(metadata.ROLE) == metadata.ROLE_HPZ_REGATHER]
    assert [n.args[1:] for n in regathers] == [(HPZ, "hpz")] * 2
    fwd = hpz_forward_shortcut_pass(fwd, "hpz")
    assert [n.args[1:] for n in calls(fwd, ALL_GATHER)] == [(WORLD, "world")] * 2
    # weight: the compute reads the world gather, sliced to the 15 elements and viewed (3, 5)
    FileCheck().check("wait_tensor = ").check_next("view = ").check("slice.Tensor(wait_tensor, 0, 0, 15)").check_not(
        "'hpz'"
    ).run(fwd.code)
