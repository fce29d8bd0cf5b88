"""Cross-entropy's backward in one buffer the size of the logits, not two.

``F.cross_entropy`` is ``log_softmax`` then ``nll_loss``; their backward, as AOTAutograd writes it,
is ``nll_loss_backward`` (a zero tensor the size of the logits with ``-w[t] * g`` at each row's
target) and then ``_log_softmax_backward_data`` on it (``grad - exp(log_probs) * grad.sum(dim)``,
a second tensor the size of the logits). Both live at once, beside the saved log-probabilities:
for a language model the logits are the largest activation there is (``rows x vocabulary``: 64 x
4096 fp32 rows make 1 MiB; a 128k vocabulary at 8k tokens makes 4 GiB), so the loss's backward is
often the step's peak.

``zcompile::cross_entropy_backward`` computes the same values holding one such buffer, the output:

- the torch path (the CPU's, and any device's without triton) runs ATen's own two ops a block of
  rows at a time, ``nll_loss_backward`` into a buffer of ``chunk_rows`` rows (at most a sixteenth
  of the logits, and ``CHUNK_ELEMENTS``), then ``_log_softmax_backward_data`` from it into the
  output's rows. Rows are independent in both ops, so the result is theirs bit for bit
  (``tests/unit/test_loss_backward.py``; an ``exp``-``mul``-``scatter`` of its own would differ by an
  ulp: ATen's softmax kernels use a faster ``exp`` than ``torch.exp``);
- on CUDA (with triton), one Triton pass reads the log-probabilities once and writes the result
  once (a program per row and block of ``TRITON_BLOCK`` classes): with one nonzero per row in the
  nll gradient (its row sum is that value), the result is ``exp(log_probs) * s`` with ``-s`` added at the target, ``s = w[t] * g`` (``g`` divided by the
  total weight under ``mean``; 0 for an ignored row), worked in fp32 and rounded once into the
  output; equal to the torch path to an ulp of ``s`` (the device's ``exp``). The kernel is tested
  under ``TRITON_INTERPRET=1`` (``tests/unit/test_cross_entropy_kernel.py``) and compiled for a GPU by
  ``benchmarks/gpu_check.py``; on the CPU the interpreter is for the tests only.
"""

from __future__ import annotations

import torch

from zcompile.kernels.dispatch import triton_available

CHUNK_ELEMENTS = 1 << 20


def row_scales(
    grad_loss: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    reduction: int,
    ignore_index: int,
    total_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
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
def cross_entropy_backward(
    grad_loss: torch.Tensor,
    log_probs: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    reduction: int,
    ignore_index: int,
    total_weight: torch.Tensor,
    input_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``_log_softmax_backward_data(nll_loss_backward(grad_loss, log_probs, target, weight, reduction,
    ignore_index, total_weight), log_probs, dim=-1, input_dtype)``, holding one logits-sized buffer
    (module doc). ``log_probs``: ``[rows, classes]`` or ``[classes]``; the class dimension is the last.
    ``input_dtype``: the softmax backward's (the dtype of the logits the log-softmax read);
    ``out_dtype``: the dtype the replaced op returns, which depends on the device where it differs
    from ``log_probs``'s (``input_dtype`` half: CUDA returns it, CPU returns fp32)."""
    if log_probs.device.type == "cuda" and log_probs.dtype in TRITON_DTYPES and triton_available():
        return cross_entropy_backward_triton(
            grad_loss, log_probs, target, weight, reduction, ignore_index, total_weight, input_dtype, out_dtype
        )
    return cross_entropy_backward_torch(
        grad_loss, log_probs, target, weight, reduction, ignore_index, total_weight, input_dtype, out_dtype
    )


def cross_entropy_backward_torch(
    grad_loss, log_probs, target, weight, reduction, ignore_index, total_weight, input_dtype, out_dtype
) -> torch.Tensor:
    """The torch path (module doc): ATen's two ops over blocks of rows, into one output."""
    aten = torch.ops.aten
    rows = log_probs if log_probs.dim() == 2 else log_probs.unsqueeze(0)
    targets = target.reshape(-1)
    per_row = reduction == 0  # "none": one gradient per row
    out = torch.empty(rows.shape, dtype=out_dtype, device=rows.device)
    step = chunk_rows(*rows.shape)
    buffer = torch.empty((min(step, rows.shape[0]), rows.shape[1]), dtype=rows.dtype, device=rows.device)
    for start in range(0, rows.shape[0], step):
        part = slice(start, start + step)
        count = rows[part].shape[0]
        grad = grad_loss.reshape(-1)[part] if per_row else grad_loss
        nll = aten.nll_loss_backward.grad_input(
            grad, rows[part], targets[part], weight, reduction, ignore_index, total_weight, grad_input=buffer[:count]
        )
        aten._log_softmax_backward_data.out(nll, rows[part], 1, input_dtype, out=out[part])
    return out.view(log_probs.shape)


def chunk_rows(rows: int, classes: int) -> int:
    """Rows per block of the torch path: at most a sixteenth of them and ``CHUNK_ELEMENTS`` elements."""
    return max(1, min(-(-rows // 16), CHUNK_ELEMENTS // max(1, classes)))


TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # fp64 runs the torch path
# classes per program (a row has cdiv(classes, TRITON_BLOCK) programs): blocks this large keep the rows
# of a large vocabulary near the copy bandwidth
TRITON_BLOCK = 8192


def cross_entropy_backward_triton(
    grad_loss, log_probs, target, weight, reduction, ignore_index, total_weight, input_dtype, out_dtype
) -> torch.Tensor:
    """The Triton kernel (module doc): one read and one write of the logits."""
    if log_probs.dtype not in TRITON_DTYPES or out_dtype not in TRITON_DTYPES:
        raise ValueError(
            f"cross_entropy_backward_triton: log-probabilities and output must be one of "
            f"{TRITON_DTYPES}, got {log_probs.dtype} -> {out_dtype}"
        )
    rows = log_probs if log_probs.dim() == 2 else log_probs.unsqueeze(0)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    scale, safe_target = row_scales(grad_loss, target.reshape(-1), weight, reduction, ignore_index, total_weight)
    scale = scale.to(rows.dtype).to(torch.float32).contiguous()  # -s as nll_loss_backward rounds it
    out = torch.empty(rows.shape, dtype=out_dtype, device=rows.device)
    if rows.numel():
        import triton

        from zcompile.kernels.cross_entropy_triton import cross_entropy_backward_kernel

        cross_entropy_backward_kernel[(rows.shape[0], triton.cdiv(rows.shape[1], TRITON_BLOCK))](
            rows,
            scale,
            safe_target.contiguous(),
            out,
            rows.shape[1],
            rows.stride(0),
            BLOCK=TRITON_BLOCK,
            enable_fp_fusion=False,
        )  # exp * s + -s rounded twice, as the torch path
    return out.view(log_probs.shape)


@cross_entropy_backward.register_fake
def _cross_entropy_backward_fake(
    grad_loss, log_probs, target, weight, reduction, ignore_index, total_weight, input_dtype, out_dtype
):
    return log_probs.new_empty(log_probs.shape, dtype=out_dtype)


def cross_entropy_backward_reference(
    grad_loss, log_probs, target, weight, reduction, ignore_index, total_weight, input_dtype
) -> torch.Tensor:
    """The two ATen ops the custom op replaces, for the tests."""
    aten = torch.ops.aten
    grad = aten.nll_loss_backward(grad_loss, log_probs, target, weight, reduction, ignore_index, total_weight)
    return aten._log_softmax_backward_data(grad, log_probs, log_probs.dim() - 1, input_dtype)


CROSS_ENTROPY_BACKWARD = torch.ops.zcompile.cross_entropy_backward.default
