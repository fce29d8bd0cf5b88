"""A Triton helper: fp32 -> bf16/fp16 rounded to nearest even on every Triton backend.

Triton's interpreter (``TRITON_INTERPRET=1``) truncates fp32 -> bf16 casts instead of rounding
them as the GPU does, so kernels tested on CPU would disagree with torch by an ulp on half the
elements. Rounding by hand on the bits gives torch's result on both, for a few integer ops in
kernels that are bound by memory anyway.
"""

from zcompile.kernels.dispatch import triton_available

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def cast_rtne(x, DST: tl.constexpr):
        """``x`` (fp32) as ``DST``, rounded to nearest even; NaN becomes torch's canonical bf16 NaN."""
        if DST == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            rounded = tl.where(x == x, rounded, 0x7FC0)
            return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(DST)
