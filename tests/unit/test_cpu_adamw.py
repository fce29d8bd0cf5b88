"""``kernels.cpu_adamw``: torch's fused CPU AdamW kernel over a list of shards, the sharded optimizer's
CPU update. Reference: ``torch.optim.AdamW(fused=True)`` on the same tensors, which runs the same
kernel: equal bit for bit (its single-tensor path differs in the last bits, hence not that one).
The gradient scale against ``optim_reference.adamw_reference`` (scaled first, then the same
arithmetic up to the kernels' last bits), and the caller's gradients are never written."""

from __future__ import annotations

import pytest
import torch

import zcompile
from zcompile.kernels.cpu_adamw import adamw_cpu_fused
from zcompile.kernels.optim_reference import adamw_reference

SIZES = (1, 7, 1000, 65537)
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _torch_fused_steps(params, grads_per_step, **arguments):
    tensors = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW(tensors, fused=True, **HYPER, **arguments)
    for grads in grads_per_step:
        for t, g in zip(tensors, grads):
            t.grad = g.clone()
        opt.step()
    return [t.detach() for t in tensors], [opt.state[t]["exp_avg"] for t in tensors], opt


@pytest.mark.parametrize("amsgrad, maximize", [(False, False), (True, True), (True, False), (False, True)])
def test_equals_torch_fused_adamw_bitwise_over_steps(amsgrad, maximize):
    """With amsgrad and maximize too (beta2 0.95 over 3 steps: the second moment falls somewhere, so the
    running maximum matters); the caller's gradients stay as they were."""
    torch.manual_seed(0)
    params = [torch.randn(n) for n in SIZES]
    grads_per_step = [[torch.randn(n) for n in SIZES] for _ in range(3)]
    kept = [[g.clone() for g in grads] for grads in grads_per_step]
    want, want_avg, opt = _torch_fused_steps(params, grads_per_step, amsgrad=amsgrad, maximize=maximize)
    got, exp_avgs, exp_avg_sqs = (
        [p.clone() for p in params],
        [torch.zeros(n) for n in SIZES],
        [torch.zeros(n) for n in SIZES],
    )
    maxima = [torch.zeros(n) for n in SIZES] if amsgrad else None
    for step, grads in enumerate(grads_per_step, start=1):
        adamw_cpu_fused(
            got,
            grads,
            exp_avgs,
            exp_avg_sqs,
            step,
            HYPER["lr"],
            *HYPER["betas"],
            HYPER["eps"],
            HYPER["weight_decay"],
            1.0,
            maxima,
            maximize,
        )
    for a, b in zip(got + exp_avgs, want + want_avg):
        assert torch.equal(a, b)
    if amsgrad:
        want_max = [opt.state[t]["max_exp_avg_sq"] for group in opt.param_groups for t in group["params"]]
        assert all(torch.equal(a, b) for a, b in zip(maxima, want_max))
        assert not all(torch.equal(a, b) for a, b in zip(maxima, exp_avg_sqs))
    assert not all(torch.equal(a, b) for a, b in zip(got, params))  # it moved
    assert all(torch.equal(g, k) for grads, ks in zip(grads_per_step, kept) for g, k in zip(grads, ks))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_grad_scale_and_dtype_leave_the_callers_gradients_alone(grad_dtype):
    torch.manual_seed(1)
    params = [torch.randn(n) for n in SIZES]
    grads = [torch.randn(n).to(grad_dtype) for n in SIZES]
    kept = [g.clone() for g in grads]
    got, exp_avgs, exp_avg_sqs = (
        [p.clone() for p in params],
        [torch.zeros(n) for n in SIZES],
        [torch.zeros(n) for n in SIZES],
    )
    adamw_cpu_fused(got, grads, exp_avgs, exp_avg_sqs, 1, 1e-2, 0.9, 0.999, 1e-8, 0.01, grad_scale=1 / 3)
    for g, k in zip(grads, kept):
        assert torch.equal(g, k)
    for p, g, out in zip(params, grads, got):
        want = p.clone()
        adamw_reference(want, g, torch.zeros_like(p), torch.zeros_like(p), 1, 1e-2, 0.9, 0.999, 1e-8, 0.01, 1 / 3)
        # fused and single-tensor arithmetic differ in the last bits: a few ulp of values of about 1
        torch.testing.assert_close(out, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bad", ["short", "strided"])
def test_a_gradient_the_kernel_would_misread_is_refused(bad):
    """torch's kernel checks neither: a shorter gradient is read past its end, a strided one in the
    wrong order (both silently, or a crash). Refused, naming the shard and the tensor."""
    params, moments = [torch.ones(10)], ([torch.zeros(10)], [torch.zeros(10)])
    grad = torch.ones(5) if bad == "short" else torch.ones(20)[::2]
    with pytest.raises(ValueError, match="shard 0: grad has"):
        adamw_cpu_fused(params, [grad], *moments, 1, 1e-2, 0.9, 0.999, 1e-8, 0.0)
    assert torch.equal(params[0], torch.ones(10))


def test_sharded_optimizer_steps_like_torch_fused_adamw():
    """zcompile.optim.AdamW at world 1, stage 1 (the shard is the whole parameter, padded): fed the
    gradients the compiled model made, its parameters equal torch.optim.AdamW(fused=True)'s on a copy
    of the model fed the same gradients, bit for bit, over 3 steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 17), torch.nn.GELU(), torch.nn.Linear(17, 5))
    reference = torch.nn.Sequential(torch.nn.Linear(13, 17), torch.nn.GELU(), torch.nn.Linear(17, 5))
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="zero", options={"stage": 1})
    opt = zcompile.optim.AdamW(model.parameters(), **HYPER)
    ref_opt = torch.optim.AdamW(reference.parameters(), fused=True, **HYPER)
    for step in range(3):
        compiled(torch.randn(8, 13, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        for p, r in zip(model.parameters(), reference.parameters()):
            r.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for p, r in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.detach(), r.detach())
