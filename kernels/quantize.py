"""Block-wise symmetric int8 / int4 quantization (ZeRO++ qwZ / qgZ): kernels, references and ops.

Layout. ``x`` (any shape, read flattened in row-major order; results are 1-D) is cut into
``num_blocks = ceil(numel / block)`` blocks, zero-padded inside the op. Per block, in fp32:
``absmax = max |x|``, ``scale = absmax / qmax`` and ``q = clamp(floor(x * (qmax / absmax) + 0.5),
-qmax, qmax)`` with qmax = 127 (8 bits, ``q`` int8, ``num_blocks * block`` elements) or 7 (4 bits,
``q`` uint8 with ``num_blocks * block / 2`` bytes: element 2i in the low nibble, 2i+1 in the high
nibble, each a 4-bit two's complement). An all-zero block has scale 0 and q 0. Padding is q 0.

Each op has three layers and a reference: a ``@triton.jit`` kernel, a host wrapper ``*_triton``
(checks, allocates, launches), a pure-torch ``*_reference`` with the same signature, and a
``torch.library.custom_op`` ``zcompile::<name>`` with a fake impl, dispatched by
:func:`zcompile.kernels.dispatch.use_triton`. Kernel and reference match bit for bit: both divide
with IEEE round-to-nearest (``div_rn``; a Python-scalar divide in torch may multiply by a
reciprocal, so the reference divides tensor by tensor), and the kernels are launched with
``enable_fp_fusion=False`` so that ``x * inv + 0.5`` and ``acc + q * scale`` are not fused into an
FMA that eager torch does not do. One program handles one block, held as two halves of
``block / 2`` elements: the first and second half (8 bits) or the even and odd elements (4 bits,
the low and high nibbles), so one code path serves both widths.
"""

import logging

import torch

from zcompile.kernels.dispatch import triton_available, use_triton

log = logging.getLogger(__name__)

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
QMAX = {8: 127, 4: 7}
MAX_BLOCK = 2**16  # a block lives in one program's registers

if triton_available():
    import triton
    import triton.language as tl

    from zcompile.kernels.lowp_cast import cast_rtne  # a @triton.jit helper: there only with triton

    @triton.jit
    def _block_offsets(pid, BLOCK: tl.constexpr, BITS: tl.constexpr):
        """Element offsets of the two halves of block ``pid``."""
        i = tl.arange(0, BLOCK // 2)
        if BITS == 8:
            offs_a = pid * BLOCK + i
            offs_b = pid * BLOCK + BLOCK // 2 + i
        else:
            offs_a = pid * BLOCK + 2 * i
            offs_b = pid * BLOCK + 2 * i + 1
        return offs_a, offs_b

    @triton.jit
    def _quantize_store(q_ptr, scales_ptr, pid, a, b, BLOCK: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr):
        """Quantizes the fp32 halves ``a``, ``b`` of block ``pid`` and stores its q and scale."""
        absmax = tl.maximum(tl.max(tl.abs(a), axis=0), tl.max(tl.abs(b), axis=0))
        inv = tl.where(absmax > 0, tl.math.div_rn(QMAX, tl.where(absmax > 0, absmax, 1.0)), 0.0)
        qa = tl.minimum(tl.maximum(tl.floor(a * inv + 0.5), -QMAX), QMAX).to(tl.int32)
        qb = tl.minimum(tl.maximum(tl.floor(b * inv + 0.5), -QMAX), QMAX).to(tl.int32)
        i = tl.arange(0, BLOCK // 2)
        if BITS == 8:
            tl.store(q_ptr + pid * BLOCK + i, qa.to(tl.int8))
            tl.store(q_ptr + pid * BLOCK + BLOCK // 2 + i, qb.to(tl.int8))
        else:
            packed = (qa & 0xF) | ((qb & 0xF) << 4)
            tl.store(q_ptr + pid * (BLOCK // 2) + i, packed.to(tl.uint8))
        tl.store(scales_ptr + pid, tl.math.div_rn(absmax, QMAX))

    @triton.jit
    def _load_dequantized(q_ptr, scales_ptr, pid, BLOCK: tl.constexpr, BITS: tl.constexpr):
        """The two halves of block ``pid`` dequantized to fp32 (``q * scale``)."""
        i = tl.arange(0, BLOCK // 2)
        scale = tl.load(scales_ptr + pid)
        if BITS == 8:
            qa = tl.load(q_ptr + pid * BLOCK + i).to(tl.float32)
            qb = tl.load(q_ptr + pid * BLOCK + BLOCK // 2 + i).to(tl.float32)
        else:
            byte = tl.load(q_ptr + pid * (BLOCK // 2) + i).to(tl.int32)
            lo = byte & 0xF
            hi = (byte >> 4) & 0xF
            qa = tl.where(lo >= 8, lo - 16, lo).to(tl.float32)
            qb = tl.where(hi >= 8, hi - 16, hi).to(tl.float32)
        return qa * scale, qb * scale

    @triton.jit
    def _store_cast(ptrs, x, mask):
        """Stores fp32 ``x`` cast, round-to-nearest-even, to the element type of ``ptrs``."""
        tl.store(ptrs, cast_rtne(x, ptrs.dtype.element_ty), mask=mask)

    # 4 bits: the block is read and written in one contiguous access and split into (or joined
    # from) its even and odd elements in registers. Two stride-2 accesses, one per half, would each
    # touch every cache line of the block: twice the memory traffic.
    @triton.jit
    def _load_halves(x_ptr, pid, numel, BLOCK: tl.constexpr, BITS: tl.constexpr):
        """The two halves of block ``pid`` of ``x`` (first and second, or even and odd) in fp32."""
        if BITS == 8:
            offs_a, offs_b = _block_offsets(pid, BLOCK, BITS)
            a = tl.load(x_ptr + offs_a, mask=offs_a < numel, other=0.0).to(tl.float32)
            b = tl.load(x_ptr + offs_b, mask=offs_b < numel, other=0.0).to(tl.float32)
        else:
            offs = pid * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
            a, b = tl.split(tl.reshape(x, [BLOCK // 2, 2]))
        return a, b

    @triton.jit
    def _store_halves(out_ptr, pid, a, b, numel, BLOCK: tl.constexpr, BITS: tl.constexpr):
        """Stores the fp32 halves of block ``pid``, cast to ``out_ptr``'s type, in place of the elements."""
        if BITS == 8:
            offs_a, offs_b = _block_offsets(pid, BLOCK, BITS)
            _store_cast(out_ptr + offs_a, a, offs_a < numel)
            _store_cast(out_ptr + offs_b, b, offs_b < numel)
        else:
            offs = pid * BLOCK + tl.arange(0, BLOCK)
            _store_cast(out_ptr + offs, tl.reshape(tl.join(a, b), [BLOCK]), offs < numel)

    @triton.jit
    def _quantize_kernel(x_ptr, q_ptr, scales_ptr, numel, BLOCK: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        a, b = _load_halves(x_ptr, pid, numel, BLOCK, BITS)
        _quantize_store(q_ptr, scales_ptr, pid, a, b, BLOCK, BITS, QMAX)

    @triton.jit
    def _dequantize_kernel(q_ptr, scales_ptr, out_ptr, numel, BLOCK: tl.constexpr, BITS: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        a, b = _load_dequantized(q_ptr, scales_ptr, pid, BLOCK, BITS)
        _store_halves(out_ptr, pid, a, b, numel, BLOCK, BITS)

    @triton.jit
    def _dequantize_reduce_kernel(
        q_ptr,
        scales_ptr,
        out_ptr,
        q_out_ptr,
        scales_out_ptr,
        numel,
        q_stride,
        scales_stride,
        scale_by,
        BLOCK: tl.constexpr,
        BITS: tl.constexpr,
        QMAX: tl.constexpr,
        REQUANTIZE: tl.constexpr,
        NUM_PARTITIONS: tl.constexpr,
    ):
        # NUM_PARTITIONS (the ranks summed: a few values per job) is a constexpr: Triton 3.6's
        # interpreter cannot loop over a runtime scalar under NumPy 2.5 (int() of a 1-element array)
        pid = tl.program_id(0).to(tl.int64)
        acc_a = tl.zeros([BLOCK // 2], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK // 2], dtype=tl.float32)
        for _ in range(0, NUM_PARTITIONS):  # same order as the reference: partition 0 first
            a, b = _load_dequantized(q_ptr, scales_ptr, pid, BLOCK, BITS)
            acc_a = acc_a + a
            acc_b = acc_b + b
            q_ptr += q_stride
            scales_ptr += scales_stride
        offs_a, offs_b = _block_offsets(pid, BLOCK, BITS)
        acc_a = tl.where(offs_a < numel, acc_a * scale_by, 0.0)
        acc_b = tl.where(offs_b < numel, acc_b * scale_by, 0.0)
        if REQUANTIZE:
            _quantize_store(q_out_ptr, scales_out_ptr, pid, acc_a, acc_b, BLOCK, BITS, QMAX)
        else:
            _store_halves(out_ptr, pid, acc_a, acc_b, numel, BLOCK, BITS)


# ----------------------------------------------------------------------------- checks and shapes
def num_blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def q_numel(numel: int, bits: int, block: int) -> int:
    """Elements of ``q`` for ``numel`` values: padded to whole blocks, two per byte for 4 bits."""
    return num_blocks(numel, block) * block * bits // 8


def _check_format(bits: int, block: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"bits must be 8 (int8) or 4 (packed int4), got {bits!r}")
    if not isinstance(block, int) or block < 2 or block & (block - 1) or block > MAX_BLOCK:
        raise ValueError(
            f"block must be a power of two in [2, {MAX_BLOCK}] (tl.arange needs a power-of-two length, "
            f"and a block is held in one program's registers), got {block!r}"
        )


def _check_float(name: str, dtype: torch.dtype) -> None:
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {dtype}; cast it first (.float())")


def _flat_input(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """Checks the arguments of quantize_blockwise; returns ``x`` flattened (row-major), contiguous."""
    _check_format(bits, block)
    _check_float("x", x.dtype)
    if x.numel() == 0:
        raise ValueError("x is empty; quantize_blockwise needs at least one element")
    return x.reshape(-1).contiguous()


def _check_quantized(q: torch.Tensor, scales: torch.Tensor, numel: int, bits: int, block: int) -> int:
    """Checks ``q`` [P, q_len] and ``scales`` [P, num_blocks] (P may be absent); returns P."""
    _check_format(bits, block)
    if numel < 1:
        raise ValueError(f"numel must be >= 1, got {numel}")
    want_dtype = torch.int8 if bits == 8 else torch.uint8
    if q.dtype != want_dtype:
        raise TypeError(f"q must be {want_dtype} for {bits} bits, got {q.dtype}")
    if scales.dtype != torch.float32:
        raise TypeError(f"scales must be float32, got {scales.dtype}")
    parts = q.shape[0] if q.dim() == 2 else 1
    q_len, blocks = q_numel(numel, bits, block), num_blocks(numel, block)
    if q.dim() > 2 or q.numel() != parts * q_len or scales.numel() != parts * blocks:
        raise ValueError(
            f"q {tuple(q.shape)} and scales {tuple(scales.shape)} do not fit numel={numel}, bits={bits}, "
            f"block={block}: expected {q_len} q elements and {blocks} scales per partition"
        )
    return parts


def _check_device(*tensors: torch.Tensor) -> None:
    if len({t.device for t in tensors}) > 1:
        raise ValueError(f"tensors on different devices: {[str(t.device) for t in tensors]}")
    if not use_triton(tensors[0]):
        raise ValueError(
            f"the Triton kernels need triton and a CUDA tensor, or TRITON_INTERPRET=1 (set before importing "
            f"triton) for CPU tensors; got a {tensors[0].device} tensor: use the *_reference function instead"
        )


# ----------------------------------------------------------------------------- references
def _quantize_rows(rows: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes fp32 ``rows`` [num_blocks, block]; returns (flat q, scales)."""
    absmax = rows.abs().amax(dim=1)
    qmax = torch.full_like(absmax, QMAX[bits])
    inv = torch.where(absmax > 0, qmax / torch.where(absmax > 0, absmax, 1.0), 0.0)
    q = torch.floor(rows * inv[:, None] + 0.5).clamp_(-QMAX[bits], QMAX[bits]).to(torch.int32)
    if bits == 4:
        q = (q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)
    return q.to(torch.int8 if bits == 8 else torch.uint8).reshape(-1), absmax / qmax


def _dequantize_rows(q: torch.Tensor, scales: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """``q * scale`` in fp32 as [num_blocks, block] rows."""
    if bits == 4:
        byte = q.to(torch.int32)
        lo, hi = byte & 0xF, (byte >> 4) & 0xF
        q = torch.stack([torch.where(lo >= 8, lo - 16, lo), torch.where(hi >= 8, hi - 16, hi)], dim=1)
    return q.to(torch.float32).reshape(-1, block) * scales.reshape(-1, 1)


def _padded_rows(flat: torch.Tensor, block: int) -> torch.Tensor:
    rows = flat.new_zeros(num_blocks(flat.numel(), block) * block, dtype=torch.float32)
    rows[: flat.numel()] = flat
    return rows.view(-1, block)


@torch.no_grad()
def quantize_blockwise_reference(x: torch.Tensor, bits: int = 8, block: int = 2048):
    x = _flat_input(x, bits, block)
    return _quantize_rows(_padded_rows(x, block), bits)


@torch.no_grad()
def dequantize_blockwise_reference(q, scales, numel, bits, block, dtype=torch.float32):
    _check_quantized(q, scales, numel, bits, block)
    _check_float("dtype", dtype)
    return _dequantize_rows(q, scales, bits, block).reshape(-1)[:numel].to(dtype)


@torch.no_grad()
def dequantize_reduce_reference(q, scales, numel, bits, block, scale_by=1.0, requantize=False):
    parts = _check_quantized(q, scales, numel, bits, block)
    acc = torch.zeros(num_blocks(numel, block), block, dtype=torch.float32, device=q.device)
    for p in range(parts):
        acc = acc + _dequantize_rows(q.reshape(parts, -1)[p], scales.reshape(parts, -1)[p], bits, block)
    acc = acc.reshape(-1)[:numel] * torch.tensor(scale_by, dtype=torch.float32, device=q.device)
    return _quantize_rows(_padded_rows(acc, block), bits) if requantize else acc


# ----------------------------------------------------------------------------- Triton wrappers
@torch.no_grad()
def quantize_blockwise_triton(x: torch.Tensor, bits: int = 8, block: int = 2048):
    x = _flat_input(x, bits, block)
    _check_device(x)
    blocks = num_blocks(x.numel(), block)
    q = torch.empty(q_numel(x.numel(), bits, block), dtype=torch.int8 if bits == 8 else torch.uint8, device=x.device)
    scales = torch.empty(blocks, dtype=torch.float32, device=x.device)
    _quantize_kernel[(blocks,)](
        x, q, scales, x.numel(), BLOCK=block, BITS=bits, QMAX=float(QMAX[bits]), enable_fp_fusion=False
    )
    return q, scales


@torch.no_grad()
def dequantize_blockwise_triton(q, scales, numel, bits, block, dtype=torch.float32):
    _check_quantized(q, scales, numel, bits, block)
    _check_float("dtype", dtype)
    _check_device(q, scales)
    out = torch.empty(numel, dtype=dtype, device=q.device)
    _dequantize_kernel[(scales.numel(),)](
        q.contiguous(), scales.contiguous(), out, numel, BLOCK=block, BITS=bits, enable_fp_fusion=False
    )
    return out


@torch.no_grad()
def dequantize_reduce_triton(q, scales, numel, bits, block, scale_by=1.0, requantize=False):
    parts = _check_quantized(q, scales, numel, bits, block)
    _check_device(q, scales)
    q, scales = q.reshape(parts, -1).contiguous(), scales.reshape(parts, -1).contiguous()
    blocks = scales.shape[1]
    if requantize:
        out = q  # unused by the kernel
        q_out = torch.empty(q.shape[1], dtype=q.dtype, device=q.device)
        scales_out = torch.empty(blocks, dtype=torch.float32, device=q.device)
    else:
        out = torch.empty(numel, dtype=torch.float32, device=q.device)
        q_out, scales_out = q, scales  # unused by the kernel
    _dequantize_reduce_kernel[(blocks,)](
        q,
        scales,
        out,
        q_out,
        scales_out,
        numel,
        q.shape[1],
        blocks,
        float(scale_by),
        BLOCK=block,
        BITS=bits,
        QMAX=float(QMAX[bits]),
        REQUANTIZE=requantize,
        NUM_PARTITIONS=parts,
        enable_fp_fusion=False,
    )
    return (q_out, scales_out) if requantize else out


# ----------------------------------------------------------------------------- custom ops
def _path(name: str, t: torch.Tensor) -> bool:
    triton_path = use_triton(t)
    log.debug("%s: %s on %s", name, "triton" if triton_path else "reference", t.device)
    return triton_path


@torch.library.custom_op("zcompile::quantize_blockwise", mutates_args=())
def _quantize_op(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    if _path("quantize_blockwise", x):
        return quantize_blockwise_triton(x, bits, block)
    return quantize_blockwise_reference(x, bits, block)


@_quantize_op.register_fake
def _(x, bits, block):
    n = _flat_input(x, bits, block).numel()
    q = x.new_empty(q_numel(n, bits, block), dtype=torch.int8 if bits == 8 else torch.uint8)
    return q, x.new_empty(num_blocks(n, block), dtype=torch.float32)


@torch.library.custom_op("zcompile::dequantize_blockwise", mutates_args=())
def _dequantize_op(
    q: torch.Tensor, scales: torch.Tensor, numel: int, bits: int, block: int, dtype: torch.dtype
) -> torch.Tensor:
    if _path("dequantize_blockwise", q):
        return dequantize_blockwise_triton(q, scales, numel, bits, block, dtype)
    return dequantize_blockwise_reference(q, scales, numel, bits, block, dtype)


@_dequantize_op.register_fake
def _(q, scales, numel, bits, block, dtype):
    _check_quantized(q, scales, numel, bits, block)
    return q.new_empty(numel, dtype=dtype)


@torch.library.custom_op("zcompile::dequantize_reduce", mutates_args=())
def _reduce_op(
    q: torch.Tensor, scales: torch.Tensor, numel: int, bits: int, block: int, scale_by: float
) -> torch.Tensor:
    if _path("dequantize_reduce", q):
        return dequantize_reduce_triton(q, scales, numel, bits, block, scale_by)
    return dequantize_reduce_reference(q, scales, numel, bits, block, scale_by)


@_reduce_op.register_fake
def _(q, scales, numel, bits, block, scale_by):
    _check_quantized(q, scales, numel, bits, block)
    return q.new_empty(numel, dtype=torch.float32)


@torch.library.custom_op("zcompile::dequantize_reduce_requantize", mutates_args=())
def _reduce_requantize_op(
    q: torch.Tensor, scales: torch.Tensor, numel: int, bits: int, block: int, scale_by: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if _path("dequantize_reduce_requantize", q):
        return dequantize_reduce_triton(q, scales, numel, bits, block, scale_by, requantize=True)
    return dequantize_reduce_reference(q, scales, numel, bits, block, scale_by, requantize=True)


@_reduce_requantize_op.register_fake
def _(q, scales, numel, bits, block, scale_by):
    _check_quantized(q, scales, numel, bits, block)
    return q.new_empty(q_numel(numel, bits, block)), scales.new_empty(num_blocks(numel, block))


# ----------------------------------------------------------------------------- public API
def quantize_blockwise(x: torch.Tensor, bits: int = 8, block: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)`` of ``x`` (flattened) in the layout of the module docstring."""
    return _quantize_op(x, bits, block)


def dequantize_blockwise(q, scales, numel: int, bits: int, block: int, dtype=torch.float32) -> torch.Tensor:
    """The ``numel`` values ``q * scale`` (computed in fp32, then cast to ``dtype``) as a 1-D tensor."""
    return _dequantize_op(q, scales, numel, bits, block, dtype)


def dequantize_reduce(q, scales, numel: int, bits: int, block: int, scale_by: float = 1.0, requantize=False):
    """Sum over the P partitions of ``q`` [P, q_len] / ``scales`` [P, num_blocks], dequantized and
    accumulated in fp32 in partition order, times ``scale_by`` (1/P gives the mean): the fp32 sum of
    ``numel`` elements, or with ``requantize`` its ``(q, scales)`` in the same format (ZeRO++ qgZ)."""
    if requantize:
        return _reduce_requantize_op(q, scales, numel, bits, block, float(scale_by))
    return _reduce_op(q, scales, numel, bits, block, float(scale_by))
