"""Pure-torch references of the sharded optimizer updates (one flat fp32 shard at a time).

The arithmetic follows ``torch.optim.AdamW`` / ``torch.optim.SGD`` (single-tensor path) op for op,
so that on the same gradients a shard is updated to the same bits as the corresponding slice of
an unsharded parameter. They are what the Triton kernels are tested against; SGD's runs in
production on a CPU, AdamW's there is torch's fused kernel (``cpu_adamw``), and the foreach
reference is ``benchmarks/bench_cpu_adamw.py``'s baseline.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def adamw_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: float = 1.0,
    max_exp_avg_sq: torch.Tensor | None = None,
    maximize: bool = False,
) -> None:
    """One AdamW step on ``param`` in place; ``step`` counts from 1; ``grad`` is multiplied by ``grad_scale``.
    ``max_exp_avg_sq`` given: AMSGrad (the running maximum of ``exp_avg_sq`` divides the update);
    ``maximize``: the gradient negated (an ascent), as ``torch.optim.AdamW(amsgrad=, maximize=)``."""
    if grad.dtype != param.dtype:
        grad = grad.to(param.dtype)
    if grad_scale != 1.0:
        grad = grad * grad_scale
    if maximize:
        grad = grad.neg()  # exact: the same bits whether negated before or after the scale
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    if max_exp_avg_sq is not None:
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        denom = (max_exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    else:
        denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


@torch.no_grad()
def adamw_reference_foreach(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: float = 1.0,
) -> None:
    """``adamw_reference`` on lists of shards (all at the same ``step``), one ``torch._foreach_*`` call
    per op: the same ops in the same order, so the same bits (torch runs a foreach op on a CPU as
    the per-tensor kernel over the list), with one dispatch from Python per op instead of one per
    op and shard."""
    grads = [g.to(p.dtype) if g.dtype != p.dtype else g for g, p in zip(grads, params)]
    if grad_scale != 1.0:
        grads = torch._foreach_mul(grads, grad_scale)
    torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2**0.5)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-step_size)


@torch.no_grad()
def sgd_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    grad_scale: float = 1.0,
    maximize: bool = False,
) -> torch.Tensor | None:
    """One SGD step on ``param`` in place (``maximize``: the gradient negated); returns the (new) momentum buffer."""
    if grad.dtype != param.dtype:
        grad = grad.to(param.dtype)
    if grad_scale != 1.0:
        grad = grad * grad_scale
    if maximize:
        grad = grad.neg()
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    if momentum != 0:
        if momentum_buffer is None:
            momentum_buffer = torch.clone(grad).detach()
        else:
            momentum_buffer.mul_(momentum).add_(grad, alpha=1 - dampening)
        grad = grad.add(momentum_buffer, alpha=momentum) if nesterov else momentum_buffer
    param.add_(grad, alpha=-lr)
    return momentum_buffer
