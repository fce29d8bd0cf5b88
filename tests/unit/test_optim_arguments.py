"""zcompile.optim.AdamW and SGD take torch.optim's arguments: every argument of torch's signature at its
default, each at another value either training like torch's or refused by name (``differentiable``
only), torch's performance hints at any value (the update stays zcompile's fused kernel, so training
equals torch's), and AdamW's ``amsgrad`` / ``maximize`` and SGD's ``maximize`` as torch's at stages 1-3,
per param group, through a checkpoint.

Tolerances: on a CPU zcompile's AdamW runs torch's fused CPU kernel and its SGD torch's single-tensor
ops, and a world of one computes the gradients with the same ATen kernels as the eager copy, so the
weights equal ``torch.optim.AdamW(fused=True)``'s and ``torch.optim.SGD``'s bit for bit. Against
``torch.optim.AdamW``'s default (single-tensor) path the fused kernel rounds an ulp apart per step
(``test_cpu_adamw.py``), which the moments carry: rtol 1e-6 as the loss comparison below."""

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
def test_differentiable_is_refused_by_name_also_per_group(name):
    """The one torch argument zcompile's update cannot follow: refused with why and what to do."""
    message = f"zcompile.optim.{name}: differentiable=True is not supported: .+; leave it False"
    with pytest.raises(ValueError, match=message):
        getattr(zcompile.optim, name)(_model().parameters(), differentiable=True)
    with pytest.raises(ValueError, match=message):
        getattr(zcompile.optim, name)([{"params": _model().parameters(), "differentiable": True}])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_tensor_setting_of_several_elements_is_refused(name):
    with pytest.raises(ValueError, match=rf"zcompile.optim.{name}: lr=<tensor of shape \(2,\)> is not supported: "):
        getattr(zcompile.optim, name)(_model().parameters(), lr=torch.tensor([1e-2, 1e-3]))


# every argument of torch's signature at a value other than its default, in sets torch accepts together
# (SGD's nesterov needs dampening 0): zcompile's trains like torch's with each set (the hints compared
# with torch without them: torch refuses some combinations with tensor settings that zcompile ignores)
NON_DEFAULT = {
    "AdamW": [
        dict(
            lr=torch.tensor(2e-2),
            betas=(0.8, 0.5),
            eps=1e-6,
            weight_decay=0.1,
            amsgrad=True,
            maximize=True,
            foreach=True,
            capturable=True,
        ),
        dict(betas=(torch.tensor(0.8), torch.tensor(0.5)), fused=True),
    ],
    "SGD": [
        dict(lr=torch.tensor(2e-2), momentum=0.8, dampening=0.1, weight_decay=torch.tensor(0.05), maximize=True),
        dict(momentum=0.8, nesterov=True, foreach=True),
        dict(momentum=0.8, fused=True),
    ],
}
REFUSED = {"differentiable"}  # test_differentiable_is_refused_by_name_also_per_group
HINT_NAMES = ("foreach", "capturable", "fused")


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_torch_argument_trains_like_torch_or_is_refused(name):
    signature = set(_torch_defaults(name))
    covered = {key for arguments in NON_DEFAULT[name] for key in arguments} | REFUSED
    assert covered == signature  # a new torch argument makes this test name it
    for arguments in NON_DEFAULT[name]:
        plain = {k: v for k, v in arguments.items() if k not in HINT_NAMES}
        ours, theirs = _train_both(name, 2, arguments, plain, steps=3)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda text: f"{arguments}: {text}")


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


def _train_both(name, stage, arguments, torch_arguments, steps=4, groups=None):
    """``steps`` steps of zcompile's optimizer on a model compiled at ``stage`` and of torch's on an
    identical eager copy; returns both models' parameters (and the zcompile optimizer's state through
    ``_train_both.optimizer``). ``groups(params)`` makes param groups from a parameter list."""
    torch._dynamo.reset()
    model, copy = _model(), _model()
    make = groups or (lambda params: params)
    optimizer = getattr(zcompile.optim, name)(make(list(model.parameters())), **arguments)
    reference = getattr(torch.optim, name)(make(list(copy.parameters())), **torch_arguments)
    compiled = torch.compile(model, backend="zero", options={"stage": stage})
    for step in range(steps):
        compiled(_batch(step)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        copy(_batch(step)).square().mean().backward()
        reference.step()
        reference.zero_grad()
    _train_both.optimizer = optimizer
    with zcompile.gathered(model):
        ours = [p.detach().clone() for p in model.parameters()]
    return ours, [p.detach().clone() for p in copy.parameters()]


def _assert_exercised_amsgrad(optimizer):
    """The AMSGrad maximum differs from the second moment somewhere: the test can tell it from Adam."""
    states = [s for s in optimizer.state.values() if "max_exp_avg_sq" in s]
    assert states and any(not torch.equal(s["max_exp_avg_sq"], s["exp_avg_sq"]) for s in states)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
def test_adamw_amsgrad_and_maximize_train_like_torch(stage, amsgrad, maximize):
    """beta2 0.5 makes the second moment fall between steps, so AMSGrad's maximum matters."""
    arguments = dict(lr=1e-2, betas=(0.9, 0.5), weight_decay=0.05, amsgrad=amsgrad, maximize=maximize)
    ours, fused = _train_both("AdamW", stage, arguments, arguments | {"fused": True})
    assert all(torch.equal(a, b) for a, b in zip(ours, fused))  # the same kernel: bitwise (module doc)
    assert ("max_exp_avg_sq" in next(iter(_train_both.optimizer.state.values()))) == amsgrad
    if amsgrad:
        _assert_exercised_amsgrad(_train_both.optimizer)
    ours, plain = _train_both("AdamW", stage, arguments, arguments)
    for a, b in zip(ours, plain):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("stage", [1, 3])
def test_adamw_per_shard_update_takes_amsgrad_and_maximize(monkeypatch, stage):
    """The per-shard update (``AdamW._update``: on a GPU without Triton or inside a compiled step the
    ``zcompile::fused_adamw`` op, on a CPU its reference) forced on a CPU: torch's single-tensor
    arithmetic op for op, so bitwise torch.optim.AdamW's default path."""
    monkeypatch.setattr(zcompile.optim.AdamW, "_update_many", zcompile.optim.ShardedOptimizer._update_many)
    arguments = dict(lr=1e-2, betas=(0.9, 0.5), amsgrad=True, maximize=True)
    ours, theirs = _train_both("AdamW", stage, arguments, arguments | {"foreach": False})
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    _assert_exercised_amsgrad(_train_both.optimizer)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize(
    "momentum, nesterov, weight_decay, dampening",
    [(0.0, False, 0.0, 0.0), (0.9, False, 0.0, 0.1), (0.9, False, 0.05, 0.0), (0.9, True, 0.05, 0.0)],
)
def test_sgd_maximize_trains_like_torch(stage, momentum, nesterov, weight_decay, dampening):
    arguments = dict(
        lr=1e-2, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, dampening=dampening, maximize=True
    )
    ours, theirs = _train_both("SGD", stage, arguments, arguments)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))  # the same single-tensor ops (module doc)


def _two_groups(settings):
    """The first linear layer in one param group, the rest in another, each with its own ``settings``."""
    return lambda params: [{"params": params[:2], **settings[0]}, {"params": params[2:], **settings[1]}]


@pytest.mark.parametrize("stage", [1, 3])
def test_per_group_amsgrad_and_maximize_like_torch(stage):
    settings = [dict(amsgrad=True, maximize=False), dict(amsgrad=False, maximize=True)]
    arguments = dict(lr=1e-2, betas=(0.9, 0.5))
    ours, theirs = _train_both("AdamW", stage, arguments, arguments | {"fused": True}, groups=_two_groups(settings))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    optimizer = _train_both.optimizer
    assert [sorted(optimizer.state[p]) for p in optimizer.param_groups[1]["params"]] == [
        ["exp_avg", "exp_avg_sq", "step"]
    ] * 2
    _assert_exercised_amsgrad(optimizer)
    groups = _two_groups([dict(maximize=True), dict(maximize=False)])
    ours, theirs = _train_both("SGD", stage, dict(lr=1e-2, momentum=0.9), dict(lr=1e-2, momentum=0.9), groups=groups)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def _resumable(stage, arguments, weights=None):
    torch._dynamo.reset()
    model = _model()
    if weights is not None:
        with torch.no_grad():
            for p, w in zip(model.parameters(), weights):
                p.copy_(w)
    compiled = torch.compile(model, backend="zero", options={"stage": stage})
    return model, compiled, zcompile.optim.AdamW(model.parameters(), **arguments)


def _step(compiled, optimizer, step):
    compiled(_batch(step)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _weights(model):
    with zcompile.gathered(model):
        return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("route", ["checkpoint", "state_dict"])
def test_max_exp_avg_sq_survives_a_save_and_load(stage, route, tmp_path):
    """AMSGrad's maximum is saved and restored with the moments (zcompile.checkpoint, or the optimizer's
    state dict): a fresh model and optimizer loaded after 3 steps take a 4th equal to the uninterrupted
    run's, bit for bit (one rank, the same kernels)."""
    import zcompile.checkpoint

    arguments = dict(lr=1e-2, betas=(0.9, 0.5), amsgrad=True, maximize=True)
    model, compiled, optimizer = _resumable(stage, arguments)
    for step in range(3):
        _step(compiled, optimizer, step)
    _assert_exercised_amsgrad(optimizer)
    assert all("max_exp_avg_sq" in entry for entry in optimizer.state_dict()["state"].values())
    if route == "checkpoint":
        zcompile.checkpoint.save(tmp_path / "ckpt", model, optimizer)
    else:  # torch.save of the state dict (which, as torch's, holds the live state tensors)
        torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
        weights = _weights(model)
    _step(compiled, optimizer, 3)
    uninterrupted = _weights(model)

    plain = dict(lr=1e-2, betas=(0.9, 0.5))  # the settings come from the saved param groups
    if route == "checkpoint":
        fresh, fresh_compiled, fresh_optimizer = _resumable(stage, plain)
        zcompile.checkpoint.load(tmp_path / "ckpt", fresh, fresh_optimizer)
    else:
        fresh, fresh_compiled, fresh_optimizer = _resumable(stage, plain, weights)
        fresh_optimizer.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    assert all(group["amsgrad"] and group["maximize"] for group in fresh_optimizer.param_groups)  # the saved ones
    _step(fresh_compiled, fresh_optimizer, 3)
    assert all(torch.equal(a, b) for a, b in zip(_weights(fresh), uninterrupted))


def test_an_unknown_argument_is_named():
    with pytest.raises(TypeError, match=r"unsupported arguments \['betass'\]"):
        zcompile.optim.AdamW(_model().parameters(), betass=(0.9, 0.99))
