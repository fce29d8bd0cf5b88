"""The Triton kernel of ``zcompile::cross_entropy_backward`` (``zcompile.kernels.cross_entropy``).

A module of its own so that importing the op (the passes do) does not import triton: the kernel is
loaded on first use, on CUDA or by the tests under ``TRITON_INTERPRET=1``.
"""

import triton
import triton.language as tl

from zcompile.kernels.lowp_cast import cast_rtne


@triton.jit
def cross_entropy_backward_kernel(
    log_probs_ptr, scale_ptr, target_ptr, out_ptr, classes, in_row_stride, BLOCK: tl.constexpr
):
    """Row ``program_id(0)``, classes block ``program_id(1)``: ``out = exp(log_probs) * s``, ``- s`` added
    at the target, in fp32, rounded once into ``out``'s dtype (``s``: the row's fp32 scale; an ignored
    row has ``s = 0``). Elementwise given the row's scale and target, so the grid covers rows and blocks
    of classes: a program per row looping over its classes would leave most of the GPU idle at a
    thousand rows."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.load(scale_ptr + row)
    target = tl.load(target_ptr + row)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < classes
    lp = tl.load(log_probs_ptr + row * in_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    grad = tl.exp(lp) * s
    grad = tl.where(cols == target, grad + -s, grad)
    tl.store(out_ptr + row * classes + cols, cast_rtne(grad, out_ptr.dtype.element_ty), mask=mask)
