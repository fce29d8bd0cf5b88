"""Steps with non-finite gradients are skipped by every rank together (``skip_nonfinite``)."""

import logging
import math

import pytest
import torch
import torch.distributed as dist

import zcompile
from support.launch import run_ranks
from support.models import build_model, global_batch
from support.training import RunSpec, micro_batches
from zcompile.optim.nonfinite import local_grads_finite, skip_nonfinite_by_default
from zcompile.sharding.shards import shard_of

NAN_STEP = 1
STEPS = 3
LR = 0.1
HUGE_MAX_NORM = 1e6  # clip coefficient clamped to exactly 1: clipping leaves finite gradients bit-identical


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    with zcompile.gathered(model):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def _state(optimizer) -> list[dict]:
    return [{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for s in optimizer.state.values()]


def _assert_bitwise_equal(after: dict, before: dict) -> None:
    assert after.keys() == before.keys()
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0, msg=str(key))


def _train(compiled, optimizer, step: int, poison: bool) -> None:
    loss = compiled(*global_batch(step, 2))
    (loss * float("nan") if poison else loss).backward()
    optimizer.step()
    optimizer.zero_grad()


def _compiled(stage: int, **options):
    torch._dynamo.reset()
    model = build_model("gpt")
    return model, torch.compile(model, backend="zero", options={"stage": stage, **options})


# --- one process, a world of one --------------------------------------------------------------------


@pytest.mark.parametrize("stage", [1, 3])
def test_nan_step_leaves_params_and_state_bitwise_unchanged(stage, caplog):
    """A real step first (AdamW moments and step count exist), then a NaN one: nothing changes;
    the step after it trains again, its step count 2."""
    model, compiled = _compiled(stage)
    optimizer = zcompile.optim.AdamW(model.parameters(), lr=LR, skip_nonfinite=True)
    _train(compiled, optimizer, 0, poison=False)
    params, state = _params(model), _state(optimizer)
    with caplog.at_level(logging.WARNING, logger="zcompile.optim"):
        _train(compiled, optimizer, 1, poison=True)
    assert optimizer.skipped_steps == 1 and optimizer.last_step_skipped
    assert any("optimizer step 2 skipped" in r.getMessage() and "not finite" in r.getMessage() for r in caplog.records)
    _assert_bitwise_equal(_params(model), params)
    for after, before in zip(_state(optimizer), state, strict=True):
        _assert_bitwise_equal(after, before)
    _train(compiled, optimizer, 2, poison=False)
    assert optimizer.skipped_steps == 1 and not optimizer.last_step_skipped
    assert all(s["step"] == 2 for s in optimizer.state.values())
    assert all(torch.isfinite(p).all() for p in _params(model).values())
    assert any(not torch.equal(p, params[name]) for name, p in _params(model).items())


def test_nan_with_clipping_is_skipped_from_the_norm():
    model, compiled = _compiled(2)
    optimizer = zcompile.optim.SGD(model.parameters(), lr=LR, skip_nonfinite=True, max_grad_norm=1.0)
    before = _params(model)
    _train(compiled, optimizer, 0, poison=True)
    assert optimizer.skipped_steps == 1 and math.isnan(optimizer.last_grad_norm)
    _assert_bitwise_equal(_params(model), before)
    _train(compiled, optimizer, 1, poison=False)
    assert optimizer.skipped_steps == 1 and math.isfinite(optimizer.last_grad_norm)


def test_default_is_on_under_fp16_only():
    assert skip_nonfinite_by_default(list(torch.nn.Linear(2, 2).half().parameters()))
    assert not skip_nonfinite_by_default(list(torch.nn.Linear(2, 2).parameters()))
    fp16 = torch.nn.Linear(4, 3).half()  # trained eagerly: the optimizer shards it itself (stage-1 rules)
    optimizer = zcompile.optim.SGD(fp16.parameters(), lr=LR)
    before = {name: p.detach().clone() for name, p in fp16.named_parameters()}
    (fp16(torch.ones(2, 4, dtype=torch.float16)).sum() * float("nan")).backward()
    optimizer.step()
    assert optimizer.skipped_steps == 1
    _assert_bitwise_equal(dict(fp16.named_parameters()), before)
    model, compiled = _compiled(2, param_dtype="fp16")  # fp32 parameters, fp16 compute: on as well
    optimizer = zcompile.optim.SGD(model.parameters(), lr=LR)
    _train(compiled, optimizer, 0, poison=True)
    assert optimizer.skipped_steps == 1


def test_off_is_unchanged_behavior():
    """fp32 by default, or False explicitly: a NaN step is taken (the weights become NaN)."""
    for options in ({}, {"skip_nonfinite": False}):
        model, compiled = _compiled(2)
        optimizer = zcompile.optim.SGD(model.parameters(), lr=LR, **options)
        _train(compiled, optimizer, 0, poison=True)
        assert optimizer.skipped_steps == 0 and not optimizer.last_step_skipped
        assert any(torch.isnan(p).any() for p in _params(model).values())
    with pytest.raises(ValueError, match="skip_nonfinite"):
        zcompile.optim.AdamW(torch.nn.Linear(2, 2).parameters(), skip_nonfinite="yes")


def test_step_report_counts_skipped_steps():
    model, compiled = _compiled(2)
    optimizer = zcompile.optim.SGD(model.parameters(), lr=LR, skip_nonfinite=True)
    _train(compiled, optimizer, 0, poison=False)
    assert zcompile.step_report(model, optimizer).skipped_steps == 0
    assert not any("skipped" in line for line in zcompile.step_report(model, optimizer).summary_lines())
    _train(compiled, optimizer, 1, poison=True)
    report = zcompile.step_report(model, optimizer)
    assert report.skipped_steps == 1 and report.to_dict()["skipped_steps"] == 1
    assert any("1 step(s) skipped" in line for line in report.summary_lines())


def test_local_check_sees_full_and_shard_gradients():
    class Member:  # what local_grads_finite reads of a ShardedParam
        def __init__(self, shard_grad, param_grad):
            self.shard_grad = shard_grad
            self.full_grad = param_grad

    assert local_grads_finite([Member(torch.ones(2), None)])
    assert local_grads_finite([Member(None, None)])
    assert not local_grads_finite([Member(torch.ones(2), torch.tensor([1.0, float("inf")]))])
    assert not local_grads_finite([Member(torch.tensor([float("nan"), 0.0]), None)])


# --- 2 gloo ranks: one rank's gradients go bad ------------------------------------------------------

# (stage, the rank whose gradients go bad at NAN_STEP, norm type clipped to HUGE_MAX_NORM or None,
#  the optimizer's check_timeout_s: with the step agreement on, the flags ride on it)
VARIANTS = (
    (1, 0, None, 60.0),  # the NaN is in rank 0's local full gradient, before the step's reduce-scatter
    (2, 0, None, 60.0),  # the NaN reached the shards through the backward's reduce-scatter
    (2, 0, None, None),  # no step agreement: one all-reduced flag decides
    (2, 1, math.inf, 60.0),  # one NaN in one of rank 1's shards only: the clip's max-norm all-reduce decides
)


def _poison_one_shard_element(model: torch.nn.Module) -> None:
    """A NaN in one element of this rank's gradient shard (stage 2): it reached no other rank."""
    shard_of(next(model.parameters())).shard.grad.view(-1)[0] = float("nan")


def _nan_run(
    rank: int, world: int, stage: int, bad_rank: int, clip_norm_type: float | None, check_timeout_s: float | None
):
    """(the steps skipped, the skipped step's optimizer collectives, the weights on this rank and on every rank)."""
    model, compiled = _compiled(stage)
    optimizer = zcompile.optim.SGD(model.parameters(), lr=LR, skip_nonfinite=True, check_timeout_s=check_timeout_s)
    spec = RunSpec(stage=stage, optimizer="sgd", lr=LR)
    skipped, skipped_records = [], None
    for step in range(STEPS):
        ((tokens, targets),) = micro_batches(spec, step, rank, world)
        loss = compiled(tokens, targets)
        poisoned = step == NAN_STEP and rank == bad_rank
        (loss * float("nan") if poisoned and clip_norm_type is None else loss).backward()
        if poisoned and clip_norm_type is not None:
            _poison_one_shard_element(model)
        if clip_norm_type is not None:
            optimizer.clip_grad_norm_(HUGE_MAX_NORM, clip_norm_type)
        optimizer.step()
        if optimizer.last_step_skipped:
            skipped.append(step)
            skipped_records = [(c.kind, c.elements, c.dtype) for c in optimizer.last_step_collectives]
        optimizer.zero_grad()
    params = _params(model)
    gathered = [None] * world
    dist.all_gather_object(gathered, params)
    assert optimizer.skipped_steps == len(skipped)
    return skipped, skipped_records, params, gathered


def _nan_runs(rank: int, world: int) -> list:
    return [_nan_run(rank, world, *variant) for variant in VARIANTS]


def test_nan_on_one_rank_skips_on_every_rank_like_a_reference_that_skips():
    """Every variant (one spawn): both ranks skip step 1 and only it, hold identical weights, equal
    to one process training on steps 0 and 2 only; the skip was decided with no collective of its
    own (the step agreement's exchange or the clip's norm), or one all-reduce without the agreement."""
    reference = _reference_skipping(NAN_STEP)
    for variant, *results in zip(VARIANTS, *run_ranks(2, _nan_runs), strict=True):
        _, _, clip_norm_type, check_timeout_s = variant
        # the poisoned step itself, not a later one whose weights went NaN
        assert [skipped for skipped, _, _, _ in results] == [[NAN_STEP]] * 2, variant
        _, records, params, gathered = results[0]
        all_reduces = [r for r in records if r[0] == "all_reduce"]
        if clip_norm_type is None and check_timeout_s is not None:  # the flags came with the step agreement
            assert all_reduces == [], (variant, records)
        elif clip_norm_type is None:  # the 0/1 flag
            assert all_reduces == [("all_reduce", 1, torch.float32)], (variant, records)
        else:  # the norm's all-reduce (max and NaN flag), no extra collective
            assert all_reduces == [("all_reduce", 2, torch.float64)], (variant, records)
        for name, value in params.items():
            torch.testing.assert_close(gathered[1][name], value, rtol=0, atol=0, msg=f"{variant} {name}")
            # data parallel vs one process: only the order of the cross-rank gradient sum differs
            torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6, msg=f"{variant} {name}")


def _reference_skipping(skipped: int) -> dict:
    model = build_model("gpt")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        model(*global_batch(step, RunSpec().batch_size)).backward()
        if step != skipped:
            optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}
