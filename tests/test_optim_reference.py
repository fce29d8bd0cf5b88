"""The per-shard update rules against torch.optim, bit for bit (same arithmetic, same order)."""

import pytest
import torch

from zcompile.kernels.optim_reference import adamw_reference, sgd_reference


@pytest.mark.parametrize("numel", [1, 7, 1000])
def test_adamw_reference_equals_torch_adamw(numel):
    torch.manual_seed(numel)
    weight = torch.randn(numel)
    ours = weight.clone()
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    param = torch.nn.Parameter(weight.clone())
    opt = torch.optim.AdamW([param], lr=1e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1, foreach=False)
    for step in range(1, 11):
        grad = torch.randn(numel)
        param.grad = grad.clone()
        opt.step()
        adamw_reference(ours, grad, exp_avg, exp_avg_sq, step, 1e-2, 0.8, 0.95, 1e-7, 0.1)
    assert torch.equal(ours, param.detach())


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_reference_equals_torch_sgd(nesterov):
    torch.manual_seed(0)
    weight = torch.randn(33)
    ours, buffer = weight.clone(), None
    param = torch.nn.Parameter(weight.clone())
    opt = torch.optim.SGD([param], lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=nesterov, foreach=False)
    for _ in range(10):
        grad = torch.randn(33)
        param.grad = grad.clone()
        opt.step()
        buffer = sgd_reference(ours, grad, buffer, 0.1, 0.9, 0.0, 0.01, nesterov)
    assert torch.equal(ours, param.detach())


def test_grad_scale_is_applied_before_the_update():
    param, scaled = torch.ones(4), torch.ones(4)
    grad = torch.tensor([1.0, -2.0, 3.0, 0.5])
    sgd_reference(param, grad * 0.25, None, 1.0, 0.0, 0.0, 0.0, False)
    sgd_reference(scaled, grad, None, 1.0, 0.0, 0.0, 0.0, False, grad_scale=0.25)
    assert torch.equal(param, scaled)
