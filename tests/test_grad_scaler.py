"""``torch.amp.GradScaler`` over zcompile parameters (``zcompile.routes.grad_scaler``): a user's unchanged
loss-scaling loop (scale, backward, ``unscale_``, clip, ``step``, ``update``) trains like one
process running the same loop on the global batch, at every stage, including a step where one
rank's gradient alone overflows: every rank skips it and halves its scale, as the reference does
with the averaged (overflowed) gradient.

SGD with momentum, so an unscale that is off by any factor moves the parameters (Adam would hide
it); tolerances as ``support.training``'s SGD runs (1e-6 of the parameters' scale; norms 1e-6
relative). Before the route, stages 2 and 3 stopped at ``scaler.step`` with torch's "No inf checks
were recorded for this optimizer" (``param.grad`` is None there), and at stage 1 the rank that
overflowed skipped alone: ``RankDivergenceError`` on both ranks.
"""

import math

import pytest
import torch

import zcompile
from support.launch import run_ranks
from support.models import build_model
from support.scaled_training import INIT_SCALE, scaled_loop, scaled_loss, scaled_reference
from support.training import PARAM_TOL
from zcompile.agreement.abort_note import RankDivergenceError

NORM_RTOL = 1e-6
CASES = {1: "unscale_ then clip", 2: "step unscales", 3: "unscale_ then clip"}  # stage -> the loop's form


def scaled_runs_on_rank(rank: int, world: int) -> dict:
    out = {}
    for stage, form in CASES.items():
        torch._dynamo.reset()
        model = build_model("gpt")
        compiled = torch.compile(model, backend="zero", options={"stage": stage})
        optimizer = zcompile.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        run = scaled_loop(
            model, lambda step: scaled_loss(compiled, step, rank, world), optimizer, clip=form == "unscale_ then clip"
        )
        with zcompile.gathered(model):
            run["params"] = {name: p.detach().clone() for name, p in model.named_parameters()}
        out[stage] = run
    # a scaler made (or its state loaded) differently on one rank: an error on every rank, not a
    # gradient unscaled by a different factor on each
    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": 2})
    optimizer = zcompile.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE * (2 if rank == world - 1 else 1))
    scaler.scale(scaled_loss(compiled, 0, rank, world)).backward()
    try:
        scaler.unscale_(optimizer)
        out["scales_differ"] = None
    except RankDivergenceError as error:
        out["scales_differ"] = str(error)
    return out


@pytest.fixture(scope="module")
def world2():
    return run_ranks(2, scaled_runs_on_rank)


@pytest.mark.parametrize("stage", CASES)
def test_grad_scaler_trains_like_one_process_and_skips_a_one_rank_overflow_on_every_rank(world2, stage):
    clip = CASES[stage] == "unscale_ then clip"
    expected = scaled_reference(2, clip)
    assert expected["scales"] == [INIT_SCALE, INIT_SCALE / 2, INIT_SCALE / 2, INIT_SCALE / 2]  # the overflow skipped
    for rank_runs in world2:
        run = rank_runs[stage]
        assert run["scales"] == expected["scales"]
        for ours, theirs in zip(run["norms"], expected["norms"], strict=True):
            assert math.isfinite(ours) == math.isfinite(theirs)
            if math.isfinite(theirs):
                assert ours == pytest.approx(theirs, rel=NORM_RTOL)
        for name, value in expected["params"].items():
            torch.testing.assert_close(
                run["params"][name], value, rtol=0, atol=PARAM_TOL * max(1.0, value.abs().max().item()), msg=name
            )
    initial = build_model("gpt").state_dict()
    assert any(not torch.equal(initial[name], value) for name, value in expected["params"].items())


def test_world_of_one_unscales_the_shards_and_skips_an_overflow():
    """No process group: stage 3 at one rank against the same loop on a plain model."""
    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": 3})
    optimizer = zcompile.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ours = scaled_loop(model, lambda step: scaled_loss(compiled, step, 0, 1), optimizer, clip=True)
    expected = scaled_reference(1, clip=True)
    assert ours["scales"] == expected["scales"] == [INIT_SCALE, INIT_SCALE / 2, INIT_SCALE / 2, INIT_SCALE / 2]
    with zcompile.gathered(model):
        for name, param in model.named_parameters():
            value = expected["params"][name]
            torch.testing.assert_close(
                param.detach(), value, rtol=0, atol=PARAM_TOL * max(1.0, value.abs().max().item()), msg=name
            )


def test_fp16_gradient_shards_are_refused_with_the_alternatives():
    """Stage 2 with param_dtype fp16 keeps fp16 gradient shards: unscaling them would underflow (torch
    refuses fp16 gradients the same way); the error names what works."""
    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": 2, "param_dtype": "fp16"})
    optimizer = zcompile.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(scaled_loss(compiled, 0, 0, 1)).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients.*stage 1 or 3.*bf16"):
        scaler.unscale_(optimizer)


def test_ranks_with_different_loss_scales_fail_together(world2):
    """One rank's scaler at twice the others' scale (as after loading its state on rank 0 only): a
    RankDivergenceError on every rank, naming both scales and the fix."""
    for rank_runs in world2:
        assert "loss scales differ (from 1024 to 2048)" in rank_runs["scales_differ"]
        assert "load_state_dict" in rank_runs["scales_differ"]
