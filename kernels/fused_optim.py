"""Fused optimizer updates over one flat fp32 shard: AdamW and SGD with momentum.

One pass reads the gradient (fp32 or bf16/fp16) and multiplies it by ``grad_scale`` (1/N for a
mean over ranks, a clipping coefficient), updates the moments and the fp32 master weights, and
optionally writes the updated weights in a low-precision dtype into ``lowp_out`` (the buffer the
next all-gather sends), so the cast costs no extra pass over memory.

Three layers per update, as for every kernel here: the ``@triton.jit`` kernel, a host wrapper
(``*_triton``) that checks and launches, and a ``torch.library`` custom op (``zcompile::fused_*``)
that dispatches to the wrapper or to the pure-torch reference in ``optim_reference`` (same
signature). On CPU the reference runs in production; tests run the kernels on CPU through
``TRITON_INTERPRET=1``.
"""

import logging
import math

import torch

from zcompile.kernels.dispatch import triton_available, use_triton
from zcompile.kernels.lowp_cast import cast_rtne
from zcompile.kernels.optim_reference import adamw_reference, sgd_reference

log = logging.getLogger(__name__)

BLOCK_SIZE = 1024

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _block_and_grad(grad_ptr, numel, grad_scale, BLOCK: tl.constexpr, SCALE_GRAD: tl.constexpr):
        """This program's offsets and mask, and its slice of the gradient in fp32, scaled."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
        if SCALE_GRAD:
            grad = grad * grad_scale
        return offsets, mask, grad

    @triton.jit
    def _adamw_kernel(
        param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, lowp_ptr, numel,
        decay, one_minus_beta1, beta2, one_minus_beta2, step_size, bias_correction2_sqrt, eps, grad_scale,
        BLOCK: tl.constexpr, WRITE_LOWP: tl.constexpr, SCALE_GRAD: tl.constexpr,
    ):
        offsets, mask, grad = _block_and_grad(grad_ptr, numel, grad_scale, BLOCK, SCALE_GRAD)
        param = tl.load(param_ptr + offsets, mask=mask)
        exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask)
        exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask)
        # the order of torch.optim.AdamW's single-tensor path: decay, lerp, mul+addcmul, addcdiv
        param = param * decay
        exp_avg = exp_avg + one_minus_beta1 * (grad - exp_avg)
        exp_avg_sq = exp_avg_sq * beta2 + one_minus_beta2 * grad * grad
        denom = tl.div_rn(tl.sqrt_rn(exp_avg_sq), bias_correction2_sqrt) + eps
        param = param - step_size * tl.div_rn(exp_avg, denom)
        tl.store(param_ptr + offsets, param, mask=mask)
        tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)
        if WRITE_LOWP:
            tl.store(lowp_ptr + offsets, cast_rtne(param, lowp_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _sgd_kernel(
        param_ptr, grad_ptr, momentum_ptr, lowp_ptr, numel,
        lr, momentum, one_minus_dampening, weight_decay, grad_scale,
        BLOCK: tl.constexpr, USE_MOMENTUM: tl.constexpr, FIRST_STEP: tl.constexpr, NESTEROV: tl.constexpr,
        WRITE_LOWP: tl.constexpr, SCALE_GRAD: tl.constexpr, DECAY: tl.constexpr,
    ):
        offsets, mask, grad = _block_and_grad(grad_ptr, numel, grad_scale, BLOCK, SCALE_GRAD)
        param = tl.load(param_ptr + offsets, mask=mask)
        if DECAY:
            grad = grad + weight_decay * param
        if USE_MOMENTUM:
            if FIRST_STEP:
                buf = grad
            else:
                buf = tl.load(momentum_ptr + offsets, mask=mask)
                buf = buf * momentum + one_minus_dampening * grad
            tl.store(momentum_ptr + offsets, buf, mask=mask)
            if NESTEROV:
                grad = grad + momentum * buf
            else:
                grad = buf
        param = param - lr * grad
        tl.store(param_ptr + offsets, param, mask=mask)
        if WRITE_LOWP:
            tl.store(lowp_ptr + offsets, cast_rtne(param, lowp_ptr.dtype.element_ty), mask=mask)


def _check_shard(name: str, tensor: torch.Tensor, param: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in dtypes:
        raise TypeError(f"fused optimizer: {name} must have dtype in {dtypes}, got {tensor.dtype}")
    if tensor.device != param.device or tensor.numel() != param.numel() or not tensor.is_contiguous():
        raise ValueError(
            f"fused optimizer: {name} must be a contiguous tensor of {param.numel()} elements on {param.device} "
            f"(got {tensor.numel()} elements on {tensor.device}, contiguous={tensor.is_contiguous()})"
        )


def _check_common(param, grad, lowp_out) -> None:
    if param.dtype != torch.float32 or not param.is_contiguous() or param.dim() != 1:
        raise TypeError(
            f"fused optimizer: param must be a flat contiguous fp32 shard, got {param.dtype} shape {tuple(param.shape)}"
        )
    _check_shard("grad", grad, param, (torch.float32, torch.bfloat16, torch.float16))
    if lowp_out is not None:
        _check_shard("lowp_out", lowp_out, param, (torch.bfloat16, torch.float16, torch.float32))


def fused_adamw_triton(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int,
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, grad_scale: float = 1.0,
    lowp_out: torch.Tensor | None = None,
) -> None:
    """The Triton AdamW step (same signature and semantics as ``adamw_reference``)."""
    _check_common(param, grad, lowp_out)
    _check_shard("exp_avg", exp_avg, param, (torch.float32,))
    _check_shard("exp_avg_sq", exp_avg_sq, param, (torch.float32,))
    if step < 1:
        raise ValueError(f"fused_adamw: step counts from 1, got {step}")
    numel = param.numel()
    grid = (triton.cdiv(numel, BLOCK_SIZE),)
    _adamw_kernel[grid](
        param, grad, exp_avg, exp_avg_sq, lowp_out if lowp_out is not None else param, numel,
        1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, lr / (1 - beta1**step),
        math.sqrt(1 - beta2**step), eps, grad_scale,
        BLOCK=BLOCK_SIZE, WRITE_LOWP=lowp_out is not None, SCALE_GRAD=grad_scale != 1.0,
    )


def fused_sgd_triton(
    param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor | None, first_step: bool, lr: float,
    momentum: float, dampening: float, weight_decay: float, nesterov: bool, grad_scale: float = 1.0,
    lowp_out: torch.Tensor | None = None,
) -> None:
    """The Triton SGD step; ``momentum_buffer`` is updated in place (filled on ``first_step``)."""
    _check_common(param, grad, lowp_out)
    if momentum != 0:
        if momentum_buffer is None:
            raise ValueError("fused_sgd: momentum != 0 needs a momentum_buffer (allocate it with torch.empty_like(param))")
        _check_shard("momentum_buffer", momentum_buffer, param, (torch.float32,))
    numel = param.numel()
    grid = (triton.cdiv(numel, BLOCK_SIZE),)
    _sgd_kernel[grid](
        param, grad, momentum_buffer if momentum_buffer is not None else param,
        lowp_out if lowp_out is not None else param, numel,
        lr, momentum, 1 - dampening, weight_decay, grad_scale,
        BLOCK=BLOCK_SIZE, USE_MOMENTUM=momentum != 0, FIRST_STEP=first_step, NESTEROV=nesterov,
        WRITE_LOWP=lowp_out is not None, SCALE_GRAD=grad_scale != 1.0, DECAY=weight_decay != 0,
    )


def fused_sgd_reference(
    param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor | None, first_step: bool, lr: float,
    momentum: float, dampening: float, weight_decay: float, nesterov: bool, grad_scale: float = 1.0,
    lowp_out: torch.Tensor | None = None,
) -> None:
    """``sgd_reference`` with the fused kernel's signature (buffer updated in place)."""
    buffer = momentum_buffer if (momentum != 0 and not first_step) else None
    new_buffer = sgd_reference(param, grad, buffer, lr, momentum, dampening, weight_decay, nesterov, grad_scale)
    if momentum != 0 and first_step:
        momentum_buffer.copy_(new_buffer)
    if lowp_out is not None:
        lowp_out.copy_(param)


def fused_adamw_reference(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int,
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, grad_scale: float = 1.0,
    lowp_out: torch.Tensor | None = None,
) -> None:
    """``adamw_reference`` with the fused kernel's signature (writes ``lowp_out`` too)."""
    adamw_reference(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, grad_scale)
    if lowp_out is not None:
        lowp_out.copy_(param)


# Each op is called through a plain function that passes every argument by position. torch 2.11's
# ADInplaceOrView kernel for custom ops bumps the version of each mutated argument by its position in
# the call (``args[idx]``), so a mutated argument left to its default or passed by keyword (``lowp_out``)
# raised IndexError on every step (found by gpu_check on torch 2.11; 2.13 fills in defaults first).
# The ops' schemas have no defaults, so a direct caller must pass everything too.


def fused_adamw(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int,
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, grad_scale: float = 1.0,
    lowp_out: torch.Tensor | None = None,
) -> None:
    """One AdamW step over a flat fp32 shard, in place (``zcompile::fused_adamw``)."""
    _fused_adamw_op(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, grad_scale,
                    lowp_out)


def fused_sgd(
    param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor | None, first_step: bool, lr: float,
    momentum: float, dampening: float, weight_decay: float, nesterov: bool, grad_scale: float = 1.0,
    lowp_out: torch.Tensor | None = None,
) -> None:
    """One SGD step over a flat fp32 shard, in place (``zcompile::fused_sgd``)."""
    _fused_sgd_op(param, grad, momentum_buffer, first_step, lr, momentum, dampening, weight_decay, nesterov,
                  grad_scale, lowp_out)


@torch.library.custom_op("zcompile::fused_adamw", mutates_args=("param", "exp_avg", "exp_avg_sq", "lowp_out"))
def _fused_adamw_op(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int,
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, grad_scale: float,
    lowp_out: torch.Tensor | None,
) -> None:
    """One AdamW step over a flat fp32 shard, in place: Triton where it runs, else the reference."""
    if use_triton(param):
        fused_adamw_triton(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay,
                           grad_scale, lowp_out)
    else:
        fused_adamw_reference(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay,
                              grad_scale, lowp_out)


@_fused_adamw_op.register_fake
def _(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, grad_scale, lowp_out):
    return None


@torch.library.custom_op("zcompile::fused_sgd", mutates_args=("param", "momentum_buffer", "lowp_out"))
def _fused_sgd_op(
    param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor | None, first_step: bool, lr: float,
    momentum: float, dampening: float, weight_decay: float, nesterov: bool, grad_scale: float,
    lowp_out: torch.Tensor | None,
) -> None:
    """One SGD step over a flat fp32 shard, in place: Triton where it runs, else the reference."""
    if use_triton(param):
        fused_sgd_triton(param, grad, momentum_buffer, first_step, lr, momentum, dampening, weight_decay,
                         nesterov, grad_scale, lowp_out)
    else:
        fused_sgd_reference(param, grad, momentum_buffer, first_step, lr, momentum, dampening, weight_decay,
                            nesterov, grad_scale, lowp_out)


@_fused_sgd_op.register_fake
def _(param, grad, momentum_buffer, first_step, lr, momentum, dampening, weight_decay, nesterov, grad_scale,
      lowp_out):
    return None
