"""Cross-entropy's backward in one buffer the size of the logits, not two.

``F.cross_entropy`` is ``log_softmax`` then ``nll_loss``; their backward, as AOTAutograd writes it,
is ``nll_loss_backward`` (a zero tensor the size of the logits with ``-w[t] * g`` at each row's
target) and then ``_log_softmax_backward_data`` on it (``grad - exp(log_probs) * grad.sum(dim)``,
a second tensor the size of the logits). Both live at once, beside the saved log-probabilities:
for a language model the logits are the largest activation there is (``rows x vocabulary``: 64 x
4096 fp32 rows make 1 MiB; a 128k vocabulary at 8k tokens makes 4 GiB), so the loss's backward is
often the step's peak.

With one nonzero per row in ``grad`` (its sum is that value), the result is
``exp(log_probs) * s`` with ``-s`` added at the target, ``s = w[t] * g`` per row (``g`` divided
by the total weight under ``mean``; 0 for an ignored row). ``zcompile::cross_entropy_backward``
computes exactly that into the one output buffer: ``exp`` into it, scaled in place, the target's
term added in place. Every rounding step is the one ATen makes (``-s - exp * -s`` is
``exp * s + -s`` bit for bit) but the ``exp``: ATen's CPU softmax kernels use a faster one than
``torch.exp`` (1 ulp apart on about 1 in 10 elements), so the result equals the two ops' to an ulp
(``tests/test_loss_backward.py``).
When the output's dtype differs from the log-probabilities' (CUDA's half-to-float softmax), or they
are in half precision (worked on in fp32, as ATen does), the rows are worked on in chunks of
about ``CHUNK_ELEMENTS`` elements, then cast into the output.

Two implementations. On CUDA (with triton), one Triton program per row reads the log-probabilities
once and writes the result once, in fp32 registers, rounded once into the output. Elsewhere, pure
torch: ``exp`` into the output, ``mul_``, ``scatter_add_`` (three passes over the buffer; on the
CPU that is what runs, the interpreter being for the tests: ``cross_entropy_backward_triton`` is
tested under ``TRITON_INTERPRET=1`` against the torch path, and compiled for a GPU by
``benchmarks/gpu_check.py``).
"""

from __future__ import annotations

from typing import Optional

import torch

from zcompile.kernels.dispatch import triton_available

CHUNK_ELEMENTS = 1 << 20
REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # ATen's reduction enum, as nll_loss_backward takes it


def row_scales(grad_loss: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor], reduction: int,
               ignore_index: int, total_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, target)``: per row, ``s`` such that ``nll_loss_backward`` writes ``-s`` at the row's
    target (in ATen's order of operations), and the target with ignored rows pointed at class 0
    (their ``s`` is 0)."""
    kept = target != ignore_index
    safe_target = torch.where(kept, target, 0)
    grad = grad_loss / total_weight if reduction == 1 else grad_loss  # ATen: -(g / total_weight)
    scale = grad.expand(target.shape) if grad.dim() == 0 else grad
    if weight is not None:
        scale = weight[safe_target] * scale
    return torch.where(kept, scale, 0), safe_target


@torch.library.custom_op("zcompile::cross_entropy_backward", mutates_args=())
def cross_entropy_backward(grad_loss: torch.Tensor, log_probs: torch.Tensor, target: torch.Tensor,
                           weight: Optional[torch.Tensor], reduction: int, ignore_index: int,
                           total_weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``_log_softmax_backward_data(nll_loss_backward(grad_loss, log_probs, target, weight, reduction,
    ignore_index, total_weight), log_probs, dim=-1, input_dtype)``, holding one logits-sized buffer
    (module doc). ``log_probs``: ``[rows, classes]`` or ``[classes]``; the class dimension is the last.
    ``out_dtype``: the dtype the replaced op returns, which depends on the device where it differs
    from ``log_probs``'s (``input_dtype`` is half: CUDA returns it, CPU returns fp32)."""
    if log_probs.device.type == "cuda" and log_probs.dtype in TRITON_DTYPES and triton_available():
        return cross_entropy_backward_triton(grad_loss, log_probs, target, weight, reduction, ignore_index,
                                             total_weight, out_dtype)
    return cross_entropy_backward_torch(grad_loss, log_probs, target, weight, reduction, ignore_index, total_weight,
                                        out_dtype)


def cross_entropy_backward_torch(grad_loss, log_probs, target, weight, reduction, ignore_index, total_weight,
                                 out_dtype) -> torch.Tensor:
    """The torch path (module doc): the CPU's, and any device's without triton."""
    rows = log_probs if log_probs.dim() == 2 else log_probs.unsqueeze(0)
    scale, safe_target = row_scales(grad_loss, target.reshape(-1), weight, reduction, ignore_index, total_weight)
    # nll_loss_backward rounds -s to the log-probabilities' dtype; the softmax backward then works in
    # at least fp32 (ATen's accumulate type), rounding once into the output
    work_dtype = torch.promote_types(rows.dtype, torch.float32)
    scale, safe_target = scale.to(rows.dtype).to(work_dtype).unsqueeze(1), safe_target.unsqueeze(1)
    out = torch.empty(rows.shape, dtype=out_dtype, device=rows.device)
    if out_dtype == rows.dtype == work_dtype:
        _fill(out, rows, scale, safe_target)
    else:
        step = max(1, CHUNK_ELEMENTS // max(1, rows.shape[1]))
        for start in range(0, rows.shape[0], step):
            part = slice(start, start + step)
            work = torch.empty(rows[part].shape, dtype=work_dtype, device=rows.device)
            _fill(work, rows[part].to(work_dtype), scale[part], safe_target[part])
            out[part].copy_(work)
    return out.view(log_probs.shape)


TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # fp64 runs the torch path
TRITON_BLOCK = 1024  # classes per iteration of a row's program


def cross_entropy_backward_triton(grad_loss, log_probs, target, weight, reduction, ignore_index, total_weight,
                                  out_dtype) -> torch.Tensor:
    """The Triton kernel (module doc): one program per row, one read and one write of the logits."""
    if log_probs.dtype not in TRITON_DTYPES or out_dtype not in TRITON_DTYPES:
        raise ValueError(f"cross_entropy_backward_triton: log-probabilities and output must be one of "
                         f"{TRITON_DTYPES}, got {log_probs.dtype} -> {out_dtype}")
    rows = log_probs if log_probs.dim() == 2 else log_probs.unsqueeze(0)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    scale, safe_target = row_scales(grad_loss, target.reshape(-1), weight, reduction, ignore_index, total_weight)
    scale = scale.to(rows.dtype).to(torch.float32).contiguous()  # -s as nll_loss_backward rounds it
    out = torch.empty(rows.shape, dtype=out_dtype, device=rows.device)
    if rows.numel():
        from zcompile.kernels.cross_entropy_triton import cross_entropy_backward_kernel

        cross_entropy_backward_kernel[(rows.shape[0],)](
            rows, scale, safe_target.contiguous(), out, rows.shape[1], rows.stride(0),
            BLOCK=TRITON_BLOCK, enable_fp_fusion=False)  # exp * s + -s rounded twice, as the torch path
    return out.view(log_probs.shape)


def _fill(out: torch.Tensor, log_probs: torch.Tensor, scale: torch.Tensor, target: torch.Tensor) -> None:
    torch.exp(log_probs, out=out)
    out.mul_(scale)
    out.scatter_add_(1, target, -scale)


@cross_entropy_backward.register_fake
def _cross_entropy_backward_fake(grad_loss, log_probs, target, weight, reduction, ignore_index, total_weight,
                                 out_dtype):
    return log_probs.new_empty(log_probs.shape, dtype=out_dtype)


def cross_entropy_backward_reference(grad_loss, log_probs, target, weight, reduction, ignore_index, total_weight,
                                     input_dtype) -> torch.Tensor:
    """The two ATen ops the custom op replaces, for the tests."""
    aten = torch.ops.aten
    grad = aten.nll_loss_backward(grad_loss, log_probs, target, weight, reduction, ignore_index, total_weight)
    return aten._log_softmax_backward_data(grad, log_probs, log_probs.dim() - 1, input_dtype)


CROSS_ENTROPY_BACKWARD = torch.ops.zcompile.cross_entropy_backward.default
