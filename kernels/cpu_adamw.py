"""torch's own fused AdamW kernel on a CPU, over a list of shards: the sharded optimizer's CPU update.

``aten::_fused_adamw_`` is what ``torch.optim.AdamW(fused=True)`` runs: one vectorized pass over
each tensor that reads the gradient and the two moments and writes the parameter and the moments.
``optim_reference.adamw_reference_foreach`` runs AdamW's eight elementwise ops one after another
(eight passes over memory, two temporaries the size of the shards), several times slower than this
one pass (``benchmarks/bench_cpu_adamw.py``). The arithmetic is torch's fused kernel's, not its
single-tensor path's: the two differ in the last bits, and a shard updated here equals the slice of
a parameter ``torch.optim.AdamW(fused=True)`` updates, bit for bit (``tests/unit/test_cpu_adamw.py``).

The kernel also writes the gradient back divided by its ``grad_scale`` (mixed-precision
unscaling); the gradients here are scaled first into tensors of their own and the kernel gets no
scale, so the caller's gradients are never written. The one module that calls the aten op (CPU
kernel since torch 2.4; zcompile needs 2.11).
"""

from __future__ import annotations

import torch


@torch.no_grad()
def adamw_cpu_fused(
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
    max_exp_avg_sqs: list[torch.Tensor] | None = None,
    maximize: bool = False,
) -> None:
    """One AdamW step, in place, on lists of fp32 CPU shards all at ``step`` (counted from 1);
    each gradient (any float dtype, read only) is multiplied by ``grad_scale`` first, as
    ``optim_reference.adamw_reference`` takes it. ``max_exp_avg_sqs`` given: AMSGrad;
    ``maximize``: an ascent (the kernel negates the gradient as it reads it, never writing it)."""
    _check_layout(params, grads, exp_avgs, exp_avg_sqs, *([max_exp_avg_sqs] if max_exp_avg_sqs is not None else []))
    cast = all(g.dtype != p.dtype for g, p in zip(grads, params))
    grads = [g.to(p.dtype) if g.dtype != p.dtype else g for g, p in zip(grads, params)]
    if grad_scale != 1.0 and cast:
        torch._foreach_mul_(grads, grad_scale)  # the cast copies are ours: scaled in place, no second copy
    elif grad_scale != 1.0:
        grads = torch._foreach_mul(grads, grad_scale)  # tensors of our own: the kernel reads them only
    steps = [torch.tensor(float(step))] * len(params)  # read, not advanced: the optimizer counts steps
    torch._fused_adamw_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs if max_exp_avg_sqs is not None else [],
        steps,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=max_exp_avg_sqs is not None,
        maximize=maximize,
        grad_scale=None,
        found_inf=None,
    )


def _check_layout(*lists: list[torch.Tensor]) -> None:
    """The aten kernel checks neither sizes nor strides: it walks each tensor's memory as dense and
    as long as its parameter, so a shorter gradient reads (and a shorter moment writes) past its end
    and a strided one is read in the wrong order. Refused here instead, naming the tensor. On the
    step's path, so cheap: a list's sizes compared at once and its strides read by ``map``, not a
    generator a shard; the loop below only names what is wrong."""
    sizes = [t.numel() for t in lists[0]]
    if all(
        [t.numel() for t in tensors] == sizes and all(map(torch.Tensor.is_contiguous, tensors)) for tensors in lists
    ):
        return
    for index, tensors in enumerate(zip(*lists)):
        numel = tensors[0].numel()
        if all(t.numel() == numel and t.is_contiguous() for t in tensors):
            continue
        name, bad = next(
            (n, t)
            for n, t in zip(("param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), tensors)
            if t.numel() != numel or not t.is_contiguous()
        )
        raise ValueError(
            f"adamw_cpu_fused: shard {index}: {name} has {bad.numel()} elements (contiguous: "
            f"{bad.is_contiguous()}) where the parameter has {numel}; the fused kernel needs dense "
            "tensors of the parameter's size"
        )
