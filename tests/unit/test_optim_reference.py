"""The per-shard update rules against torch.optim, bit for bit (same arithmetic, same order)."""

import pytest
import torch

from zcompile.kernels.optim_reference import adamw_reference, adamw_reference_foreach, sgd_reference


@pytest.mark.parametrize("numel", [1, 7, 1000])
@pytest.mark.parametrize("amsgrad, maximize", [(False, False), (True, False), (False, True), (True, True)])
def test_adamw_reference_equals_torch_adamw(numel, amsgrad, maximize):
    """beta2 0.5 (with amsgrad): the second moment falls between steps, so the running maximum matters."""
    beta2 = 0.5 if amsgrad else 0.95
    torch.manual_seed(numel)
    weight = torch.randn(numel)
    ours = weight.clone()
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    maximum = torch.zeros(numel) if amsgrad else None
    param = torch.nn.Parameter(weight.clone())
    opt = torch.optim.AdamW(
        [param],
        lr=1e-2,
        betas=(0.8, beta2),
        eps=1e-7,
        weight_decay=0.1,
        amsgrad=amsgrad,
        maximize=maximize,
        foreach=False,
    )
    for step in range(1, 11):
        grad = torch.randn(numel)
        param.grad = grad.clone()
        opt.step()
        adamw_reference(ours, grad, exp_avg, exp_avg_sq, step, 1e-2, 0.8, beta2, 1e-7, 0.1, 1.0, maximum, maximize)
    assert torch.equal(ours, param.detach())
    if amsgrad:
        assert torch.equal(maximum, opt.state[param]["max_exp_avg_sq"])
        assert not torch.equal(maximum, exp_avg_sq)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
def test_sgd_reference_equals_torch_sgd(nesterov, maximize):
    torch.manual_seed(0)
    weight = torch.randn(33)
    ours, buffer = weight.clone(), None
    param = torch.nn.Parameter(weight.clone())
    opt = torch.optim.SGD(
        [param], lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=nesterov, maximize=maximize, foreach=False
    )
    for _ in range(10):
        grad = torch.randn(33)
        param.grad = grad.clone()
        opt.step()
        buffer = sgd_reference(ours, grad, buffer, 0.1, 0.9, 0.0, 0.01, nesterov, 1.0, maximize)
    assert torch.equal(ours, param.detach())


def test_grad_scale_is_applied_before_the_update():
    param, scaled = torch.ones(4), torch.ones(4)
    grad = torch.tensor([1.0, -2.0, 3.0, 0.5])
    sgd_reference(param, grad * 0.25, None, 1.0, 0.0, 0.0, 0.0, False)
    sgd_reference(scaled, grad, None, 1.0, 0.0, 0.0, 0.0, False, grad_scale=0.25)
    assert torch.equal(param, scaled)


def test_foreach_adamw_reference_is_bitwise_the_per_shard_one():
    """The foreach reference (the CPU update before ``cpu_adamw``, bench_cpu_adamw's baseline) must
    give the bits of ``adamw_reference`` run shard by shard (which equals torch.optim.AdamW's single-tensor
    path), over steps, with a gradient scale and with bf16 gradients."""
    torch.manual_seed(0)
    sizes = [1, 7, 1000, 65537]
    for grad_scale, grad_dtype in [(1.0, torch.float32), (0.5, torch.float32), (1.0, torch.bfloat16)]:
        states = [[torch.randn(n), torch.randn(n), torch.rand(n)] for n in sizes]
        one_by_one = [[t.clone() for t in state] for state in states]
        grads = [torch.randn(n).to(grad_dtype) for n in sizes]
        for step in (1, 2, 3):
            for (param, exp_avg, exp_avg_sq), grad in zip(one_by_one, grads):
                adamw_reference(param, grad, exp_avg, exp_avg_sq, step, 1e-3, 0.9, 0.999, 1e-8, 0.01, grad_scale)
            adamw_reference_foreach(
                [state[0] for state in states],
                grads,
                [state[1] for state in states],
                [state[2] for state in states],
                step,
                1e-3,
                0.9,
                0.999,
                1e-8,
                0.01,
                grad_scale,
            )
        for foreach, single in zip(states, one_by_one):
            for a, b in zip(foreach, single):
                assert torch.equal(a, b)
