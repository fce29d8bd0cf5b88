"""``loss.backward(inputs=...)`` and ``torch.autograd.grad`` over zcompile parameters
(``zcompile/autograd_route.py``), at one rank against eager torch.

Before: at stage 2 ``backward(inputs=list(model.parameters()))`` accumulated nothing where the step
reads it, and no weight moved, with no word; at stage 3 it raised the eager-use error naming
``gathered``; ``torch.autograd.grad(..., allow_unused=True)`` returned None for stage-2 parameters.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import zcompile
import zcompile.optim
from zcompile.sharding.sharded_parameter import ShardedParameterError

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


def _train_listed(stage: int | None, options: dict | None = None) -> list[torch.Tensor]:
    """Weights after STEPS SGD steps whose backward lists only the last layer's parameters;
    ``stage`` None: eager torch."""
    torch._dynamo.reset()
    model = _model()
    listed = list(model[2].parameters())
    if stage is None:
        module, optimizer = model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        module = torch.compile(model, backend="zero", options={"stage": stage, **(options or {})})
        optimizer = zcompile.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        module(_batch(step)).square().mean().backward(inputs=listed)
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad() if stage is None else zcompile.gathered(model):
        return [p.detach().float().clone() for p in model.parameters()]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_backward_with_inputs_trains_the_listed_parameters_as_torch_does(stage):
    reference, got = _train_listed(None), _train_listed(stage)
    initial = [p.detach() for p in _model().parameters()]
    for index, (weight, expected, start) in enumerate(zip(got, reference, initial)):
        torch.testing.assert_close(weight, expected, rtol=1e-5, atol=1e-6, msg=f"weight {index}")
        assert torch.equal(weight, start) == (index < 2), index  # the unlisted layer never moves
    torch._dynamo.reset()


def test_backward_with_inputs_reaches_the_replica_under_param_dtype_at_stage_1():
    """Stage 1 under ``param_dtype``: the graph differentiates the bf16 replica, which the route lists."""
    got = _train_listed(1, {"param_dtype": "bf16"})
    initial = [p.detach() for p in _model().parameters()]
    assert [torch.equal(weight, start) for weight, start in zip(got, initial)] == [True, True, False, False]
    torch._dynamo.reset()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_autograd_grad_of_parameters_is_torch_s_at_stage_1_and_named_at_stages_2_and_3(stage):
    torch._dynamo.reset()
    model, reference = _model(), _model()
    compiled = torch.compile(model, backend="zero", options={"stage": stage})
    out = compiled(_batch(0)).square().mean()
    if stage == 1:
        expected = torch.autograd.grad(reference(_batch(0)).square().mean(), list(reference.parameters()))
        for got, want in zip(torch.autograd.grad(out, list(model.parameters())), expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    else:
        with pytest.raises(ShardedParameterError, match=f"parameter '0.weight' at ZeRO stage {stage}.*gathered"):
            torch.autograd.grad(out, list(model.parameters()), allow_unused=True)
        # with respect to the input, as a gradient penalty takes it: torch's answer
        x = _batch(1).requires_grad_()
        (got,) = torch.autograd.grad(compiled(x).square().mean(), x)
        x_ref = _batch(1).requires_grad_()
        (want,) = torch.autograd.grad(reference(x_ref).square().mean(), x_ref)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    torch._dynamo.reset()
