"""zcompile.optim.AdamW and SGD take torch.optim's arguments: every argument of torch's signature at its
default, torch's performance hints at any value (the update stays zcompile's fused kernel, so training
equals torch's), and the arguments that change the update where zcompile's cannot refused by name."""

from __future__ import annotations

import inspect

import pytest
import torch

import zcompile

OPTIMIZERS = {"AdamW": dict(lr=1e-2), "SGD": dict(lr=1e-2, momentum=0.9)}
HINTS = {"AdamW": dict(foreach=True, fused=True, capturable=True), "SGD": dict(foreach=True, fused=True)}


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))


def _torch_defaults(name: str) -> dict:
    signature = inspect.signature(getattr(torch.optim, name).__init__)
    return {p.name: p.default for p in signature.parameters.values() if p.default is not inspect.Parameter.empty}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_torch_argument_at_its_default_is_accepted(name):
    arguments = _torch_defaults(name)
    assert {"maximize", "foreach", "differentiable", "fused"} <= set(arguments)  # torch's, read from torch
    optimizer = getattr(zcompile.optim, name)(_model().parameters(), **arguments)
    assert optimizer.param_groups[0]["lr"] == arguments["lr"]


def _train(name: str, zero: bool, arguments: dict) -> list[float]:
    model = _model()
    optimizer = (getattr(zcompile.optim, name) if zero else getattr(torch.optim, name))(
        model.parameters(), **OPTIMIZERS[name], **arguments
    )
    if zero:
        model = torch.compile(model, backend="zero", options={"stage": 3})
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(3):
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_performance_hints_train_like_torch(name):
    """foreach / fused / capturable set: a stage-3 world-of-one run equals torch's optimizer without
    them (tolerance: the fused kernel's float order, as in the layering test)."""
    torch._dynamo.reset()
    zero, plain = _train(name, True, HINTS[name]), _train(name, False, {})
    assert max(abs(a - b) for a, b in zip(zero, plain)) <= 1e-6 * max(map(abs, plain)), (zero, plain)
    assert zero[-1] < zero[0]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("argument", ["maximize", "differentiable"])
def test_arguments_that_change_the_update_are_refused_by_name(name, argument):
    with pytest.raises(ValueError, match=f"zcompile.optim.{name}: {argument}=True is not supported"):
        getattr(zcompile.optim, name)(_model().parameters(), **{argument: True})


def test_an_unknown_argument_is_named():
    with pytest.raises(TypeError, match=r"unsupported arguments \['betass'\]"):
        zcompile.optim.AdamW(_model().parameters(), betass=(0.9, 0.99))
