"""Steps with non-finite gradients are skipped by every rank together (``skip_nonfinite``)."""

import pytest
import torch
import torch.distributed as dist

import zcompile
from support.launch import run_ranks
from support.models import build_model, global_batch
from support.training import RunSpec, micro_batches
from zcompile.nonfinite import local_grads_finite

NAN_STEP = 1


def _one_step(stage: int, poison: bool, **optimizer_options):
    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": stage})
    optimizer = zcompile.optim.SGD(model.parameters(), lr=0.1, **optimizer_options)
    loss = compiled(*global_batch(0, 2))
    (loss * float("nan") if poison else loss).backward()
    with zcompile.gathered(model):
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer.step()
    with zcompile.gathered(model):
        after = {name: p.detach().clone() for name, p in model.named_parameters()}
    return optimizer, before, after


@pytest.mark.parametrize("stage", [1, 3])
def test_nan_gradient_skips_the_step_and_finite_one_does_not(stage):
    optimizer, before, after = _one_step(stage, poison=True, skip_nonfinite=True)
    assert optimizer.skipped_steps == 1 and optimizer.last_step_skipped
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0, msg=name)
    assert not optimizer.state or all(not s for s in optimizer.state.values())
    optimizer, before, after = _one_step(stage, poison=False, skip_nonfinite=True)
    assert optimizer.skipped_steps == 0 and any(not torch.equal(after[n], before[n]) for n in before)


def test_nan_with_clipping_decides_from_the_norm():
    optimizer, before, after = _one_step(2, poison=True, skip_nonfinite=True, max_grad_norm=1.0)
    assert optimizer.skipped_steps == 1 and optimizer.last_grad_norm != optimizer.last_grad_norm  # NaN norm
    assert all(torch.equal(after[n], before[n]) for n in before)
    assert not any(c.kind == "all_reduce" and c.dtype == torch.float32 for c in optimizer.last_step_collectives)


def test_default_is_on_under_fp16_only():
    from zcompile.nonfinite import skip_nonfinite_by_default

    fp16 = torch.nn.Linear(2, 2).half()
    assert skip_nonfinite_by_default(list(fp16.parameters()))
    assert not skip_nonfinite_by_default(list(torch.nn.Linear(2, 2).parameters()))
    optimizer, before, after = _one_step(2, poison=True)  # fp32, default: not skipped (weights become NaN)
    assert optimizer.skipped_steps == 0


def test_local_check_sees_full_and_shard_gradients():
    class Member:
        def __init__(self, shard_grad, param_grad):
            self.shard = torch.zeros(2)
            self.shard.grad = shard_grad
            self.param = torch.nn.Parameter(torch.zeros(2))
            self.param.grad = param_grad

    assert local_grads_finite([Member(torch.ones(2), None)])
    assert not local_grads_finite([Member(torch.ones(2), torch.tensor([1.0, float("inf")]))])
    assert not local_grads_finite([Member(torch.tensor([float("nan"), 0.0]), None)])


def _nan_on_rank0(rank, world, stage):
    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": stage})
    optimizer = zcompile.optim.SGD(model.parameters(), lr=0.1, skip_nonfinite=True)
    spec = RunSpec(stage=stage, optimizer="sgd", lr=0.1)
    for step in range(3):
        (tokens, targets), = micro_batches(spec, step, rank, world)
        loss = compiled(tokens, targets)
        if step == NAN_STEP and rank == 0:
            loss = loss * float("nan")  # one rank's batch goes bad
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with zcompile.gathered(model):
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
    gathered = [None] * world
    dist.all_gather_object(gathered, params)
    return optimizer.skipped_steps, params, gathered


def test_nan_on_one_rank_skips_on_every_rank_like_a_reference_that_skips():
    """Stage 1 (NaN in a local full gradient) and stage 2 (in some shards only): both ranks skip step
    1, hold identical weights, equal to one process training on steps 0 and 2 only."""
    spec = RunSpec(optimizer="sgd", lr=0.1, steps=3)
    reference = _reference_skipping(spec, NAN_STEP)
    for stage in (1, 2):
        results = run_ranks(2, _nan_on_rank0, stage)
        assert [skipped for skipped, _, _ in results] == [1, 1]
        _, params, gathered = results[0]
        for name, value in params.items():
            torch.testing.assert_close(gathered[1][name], value, rtol=0, atol=0, msg=name)  # ranks agree exactly
            # data parallel vs one process: only the order of the cross-rank sum differs
            torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6, msg=name)


def _reference_skipping(spec: RunSpec, skipped: int) -> dict:
    model = build_model("gpt")
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr)
    for step in range(spec.steps):
        model(*global_batch(step, spec.batch_size)).backward()
        if step != skipped:
            optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}
