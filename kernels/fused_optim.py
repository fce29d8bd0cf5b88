"""Fused optimizer updates over one flat fp32 shard: AdamW and SGD with momentum, with torch's
``amsgrad`` (AdamW) and ``maximize`` as compile-time switches of the same kernels.

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
from dataclasses import dataclass

import torch

from zcompile.kernels.dispatch import triton_available, use_triton
from zcompile.kernels.optim_reference import adamw_reference, sgd_reference

log = logging.getLogger(__name__)

BLOCK_SIZE = 1024
# a shard's row in the multi-tensor table: param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, lowp, numel
TABLE_COLUMNS = 7

if triton_available():
    import triton
    import triton.language as tl

    from zcompile.kernels.lowp_cast import cast_rtne  # a @triton.jit helper: there only with triton

    _TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def _block_and_grad(
        grad_ptr, block, numel, grad_scale, BLOCK: tl.constexpr, SCALE_GRAD: tl.constexpr, MAXIMIZE: tl.constexpr
    ):
        """Block ``block``'s offsets and mask, and its slice of the gradient in fp32, scaled (and
        negated for ``maximize``: exact, so the same bits as torch negating first)."""
        offsets = block * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
        if SCALE_GRAD:
            grad = grad * grad_scale
        if MAXIMIZE:
            grad = -grad
        return offsets, mask, grad

    @triton.jit
    def _adamw_kernel(
        param_ptr,
        grad_ptr,
        exp_avg_ptr,
        exp_avg_sq_ptr,
        max_exp_avg_sq_ptr,
        lowp_ptr,
        numel,
        decay,
        one_minus_beta1,
        beta2,
        one_minus_beta2,
        step_size,
        bias_correction2_sqrt,
        eps,
        grad_scale,
        BLOCK: tl.constexpr,
        WRITE_LOWP: tl.constexpr,
        SCALE_GRAD: tl.constexpr,
        AMSGRAD: tl.constexpr,
        MAXIMIZE: tl.constexpr,
    ):
        offsets, mask, grad = _block_and_grad(
            grad_ptr, tl.program_id(0).to(tl.int64), numel, grad_scale, BLOCK, SCALE_GRAD, MAXIMIZE
        )
        _adamw_block(
            param_ptr,
            grad,
            exp_avg_ptr,
            exp_avg_sq_ptr,
            max_exp_avg_sq_ptr,
            lowp_ptr,
            offsets,
            mask,
            decay,
            one_minus_beta1,
            beta2,
            one_minus_beta2,
            step_size,
            bias_correction2_sqrt,
            eps,
            WRITE_LOWP,
            AMSGRAD,
        )

    @triton.jit
    def _adamw_multi_kernel(
        table_ptr,
        chunk_ptr,
        decay,
        one_minus_beta1,
        beta2,
        one_minus_beta2,
        step_size,
        bias_correction2_sqrt,
        eps,
        grad_scale,
        GRAD_DTYPE: tl.constexpr,
        LOWP_DTYPE: tl.constexpr,
        COLUMNS: tl.constexpr,
        BLOCK: tl.constexpr,
        WRITE_LOWP: tl.constexpr,
        SCALE_GRAD: tl.constexpr,
        AMSGRAD: tl.constexpr,
        MAXIMIZE: tl.constexpr,
    ):
        """``_adamw_kernel`` over many shards in one launch. ``table`` holds per shard the addresses of
        its param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq and lowp tensors and its numel (int64,
        ``COLUMNS`` a row); ``chunk`` holds per program its shard's row and its block within the shard."""
        param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr, lowp_ptr, block, numel = _table_entry(
            table_ptr, chunk_ptr, GRAD_DTYPE, LOWP_DTYPE, COLUMNS
        )
        offsets, mask, grad = _block_and_grad(grad_ptr, block, numel, grad_scale, BLOCK, SCALE_GRAD, MAXIMIZE)
        _adamw_block(
            param_ptr,
            grad,
            exp_avg_ptr,
            exp_avg_sq_ptr,
            max_exp_avg_sq_ptr,
            lowp_ptr,
            offsets,
            mask,
            decay,
            one_minus_beta1,
            beta2,
            one_minus_beta2,
            step_size,
            bias_correction2_sqrt,
            eps,
            WRITE_LOWP,
            AMSGRAD,
        )

    @triton.jit
    def _table_entry(table_ptr, chunk_ptr, GRAD_DTYPE: tl.constexpr, LOWP_DTYPE: tl.constexpr, COLUMNS: tl.constexpr):
        """This program's shard in a multi-tensor launch: the pointers of its row of ``table`` (param,
        grad, three state tensors, lowp), the block ``chunk`` gives it, and the shard's numel."""
        row = tl.load(chunk_ptr + 2 * tl.program_id(0)) * COLUMNS
        block = tl.load(chunk_ptr + 2 * tl.program_id(0) + 1)
        return (
            tl.load(table_ptr + row).to(tl.pointer_type(tl.float32)),
            tl.load(table_ptr + row + 1).to(tl.pointer_type(GRAD_DTYPE)),
            tl.load(table_ptr + row + 2).to(tl.pointer_type(tl.float32)),
            tl.load(table_ptr + row + 3).to(tl.pointer_type(tl.float32)),
            tl.load(table_ptr + row + 4).to(tl.pointer_type(tl.float32)),
            tl.load(table_ptr + row + 5).to(tl.pointer_type(LOWP_DTYPE)),
            block,
            tl.load(table_ptr + row + 6),
        )

    @triton.jit
    def _adamw_block(
        param_ptr,
        grad,
        exp_avg_ptr,
        exp_avg_sq_ptr,
        max_exp_avg_sq_ptr,
        lowp_ptr,
        offsets,
        mask,
        decay,
        one_minus_beta1,
        beta2,
        one_minus_beta2,
        step_size,
        bias_correction2_sqrt,
        eps,
        WRITE_LOWP: tl.constexpr,
        AMSGRAD: tl.constexpr,
    ):
        """The AdamW update of one block of a shard, given its fp32 (scaled) gradient; with ``AMSGRAD``
        the running maximum of ``exp_avg_sq`` (NaN kept, as ``torch.maximum``) divides the update."""
        param = tl.load(param_ptr + offsets, mask=mask)
        exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask)
        exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask)
        # the order of torch.optim.AdamW's single-tensor path: decay, lerp, mul+addcmul, addcdiv
        param = param * decay
        exp_avg = exp_avg + one_minus_beta1 * (grad - exp_avg)
        exp_avg_sq = exp_avg_sq * beta2 + one_minus_beta2 * grad * grad
        if AMSGRAD:
            max_exp_avg_sq = tl.maximum(
                tl.load(max_exp_avg_sq_ptr + offsets, mask=mask), exp_avg_sq, propagate_nan=tl.PropagateNan.ALL
            )
            tl.store(max_exp_avg_sq_ptr + offsets, max_exp_avg_sq, mask=mask)
            denom = tl.div_rn(tl.sqrt_rn(max_exp_avg_sq), bias_correction2_sqrt) + eps
        else:
            denom = tl.div_rn(tl.sqrt_rn(exp_avg_sq), bias_correction2_sqrt) + eps
        param = param - step_size * tl.div_rn(exp_avg, denom)
        tl.store(param_ptr + offsets, param, mask=mask)
        tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)
        if WRITE_LOWP:
            tl.store(lowp_ptr + offsets, cast_rtne(param, lowp_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _sgd_kernel(
        param_ptr,
        grad_ptr,
        momentum_ptr,
        lowp_ptr,
        numel,
        lr,
        momentum,
        one_minus_dampening,
        weight_decay,
        grad_scale,
        BLOCK: tl.constexpr,
        USE_MOMENTUM: tl.constexpr,
        FIRST_STEP: tl.constexpr,
        NESTEROV: tl.constexpr,
        WRITE_LOWP: tl.constexpr,
        SCALE_GRAD: tl.constexpr,
        DECAY: tl.constexpr,
        MAXIMIZE: tl.constexpr,
    ):
        offsets, mask, grad = _block_and_grad(
            grad_ptr, tl.program_id(0).to(tl.int64), numel, grad_scale, BLOCK, SCALE_GRAD, MAXIMIZE
        )
        _sgd_block(
            param_ptr,
            grad,
            momentum_ptr,
            lowp_ptr,
            offsets,
            mask,
            lr,
            momentum,
            one_minus_dampening,
            weight_decay,
            USE_MOMENTUM,
            FIRST_STEP,
            NESTEROV,
            WRITE_LOWP,
            DECAY,
        )

    @triton.jit
    def _sgd_multi_kernel(
        table_ptr,
        chunk_ptr,
        lr,
        momentum,
        one_minus_dampening,
        weight_decay,
        grad_scale,
        GRAD_DTYPE: tl.constexpr,
        LOWP_DTYPE: tl.constexpr,
        COLUMNS: tl.constexpr,
        BLOCK: tl.constexpr,
        USE_MOMENTUM: tl.constexpr,
        FIRST_STEP: tl.constexpr,
        NESTEROV: tl.constexpr,
        WRITE_LOWP: tl.constexpr,
        SCALE_GRAD: tl.constexpr,
        DECAY: tl.constexpr,
        MAXIMIZE: tl.constexpr,
    ):
        """``_sgd_kernel`` over many shards in one launch (the table of ``_adamw_multi_kernel``, its
        first state column the momentum buffer)."""
        param_ptr, grad_ptr, momentum_ptr, _, _, lowp_ptr, block, numel = _table_entry(
            table_ptr, chunk_ptr, GRAD_DTYPE, LOWP_DTYPE, COLUMNS
        )
        offsets, mask, grad = _block_and_grad(grad_ptr, block, numel, grad_scale, BLOCK, SCALE_GRAD, MAXIMIZE)
        _sgd_block(
            param_ptr,
            grad,
            momentum_ptr,
            lowp_ptr,
            offsets,
            mask,
            lr,
            momentum,
            one_minus_dampening,
            weight_decay,
            USE_MOMENTUM,
            FIRST_STEP,
            NESTEROV,
            WRITE_LOWP,
            DECAY,
        )

    @triton.jit
    def _sgd_block(
        param_ptr,
        grad,
        momentum_ptr,
        lowp_ptr,
        offsets,
        mask,
        lr,
        momentum,
        one_minus_dampening,
        weight_decay,
        USE_MOMENTUM: tl.constexpr,
        FIRST_STEP: tl.constexpr,
        NESTEROV: tl.constexpr,
        WRITE_LOWP: tl.constexpr,
        DECAY: tl.constexpr,
    ):
        """The SGD update of one block of a shard, given its fp32 (scaled) gradient."""
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
    lowp_out: torch.Tensor | None = None,
    max_exp_avg_sq: torch.Tensor | None = None,
    maximize: bool = False,
) -> None:
    """The Triton AdamW step (same signature and semantics as ``adamw_reference``; ``max_exp_avg_sq``
    given: AMSGrad)."""
    _check_common(param, grad, lowp_out)
    _check_shard("exp_avg", exp_avg, param, (torch.float32,))
    _check_shard("exp_avg_sq", exp_avg_sq, param, (torch.float32,))
    if max_exp_avg_sq is not None:
        _check_shard("max_exp_avg_sq", max_exp_avg_sq, param, (torch.float32,))
    if step < 1:
        raise ValueError(f"fused_adamw: step counts from 1, got {step}")
    numel = param.numel()
    grid = (triton.cdiv(numel, BLOCK_SIZE),)
    _adamw_kernel[grid](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        max_exp_avg_sq if max_exp_avg_sq is not None else exp_avg_sq,  # not read without AMSGRAD
        lowp_out if lowp_out is not None else param,
        numel,
        1 - lr * weight_decay,
        1 - beta1,
        beta2,
        1 - beta2,
        lr / (1 - beta1**step),
        math.sqrt(1 - beta2**step),
        eps,
        grad_scale,
        BLOCK=BLOCK_SIZE,
        WRITE_LOWP=lowp_out is not None,
        SCALE_GRAD=grad_scale != 1.0,
        AMSGRAD=max_exp_avg_sq is not None,
        MAXIMIZE=maximize,
    )


@dataclass
class MultiTensorTables:
    """The device tables of a multi-tensor launch (``fused_adamw_multi_triton``), kept by the caller
    between steps. The chunk table depends on the shards' sizes only, so a training loop builds it
    once. The address table changes where a tensor moved (gradients are new tensors every step):
    it is written into a pinned host buffer and copied to the device without waiting for the
    stream's queued work, and only the shards whose addresses changed are checked again.
    ``builds`` counts the chunk tables built, ``uploads`` the address tables copied."""

    numels: tuple | None = None
    chunks: torch.Tensor | None = None
    rows: tuple | None = None
    table: torch.Tensor | None = None
    staging: torch.Tensor | None = None  # pinned host copy of ``table`` (CUDA only)
    uploaded: object | None = None  # the CUDA event after the last copy out of ``staging``
    stream: object | None = None  # the CUDA stream the tables were last used on (``_follow_stream``)
    builds: int = 0
    uploads: int = 0


def fused_adamw_multi_triton(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    lowps: list[torch.Tensor | None],
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: float = 1.0,
    tables: dict[tuple, MultiTensorTables] | None = None,
    max_exp_avg_sqs: list[torch.Tensor] | None = None,
    maximize: bool = False,
) -> None:
    """``fused_adamw_triton`` over many shards at the same step and hyper-parameters: one launch per
    (gradient dtype, low-precision dtype) instead of one per shard, the same bits per element.
    ``max_exp_avg_sqs`` given: AMSGrad for all of them.

    Each launch costs host time through the custom op: with a launch per shard, a model of many
    small shards would have its step wait on the host, not the GPU. ``tables`` (a dict the caller
    keeps) holds each launch's device tables (``MultiTensorTables``) for the next step."""
    if not (len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(lowps)) or (
        max_exp_avg_sqs is not None and len(max_exp_avg_sqs) != len(params)
    ):
        raise ValueError(
            "fused_adamw_multi: params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs (if given) and lowps must "
            f"have one entry per shard, got {len(params)}, {len(grads)}, {len(exp_avgs)}, {len(exp_avg_sqs)}, "
            f"{None if max_exp_avg_sqs is None else len(max_exp_avg_sqs)}, {len(lowps)}"
        )
    if step < 1:
        raise ValueError(f"fused_adamw: step counts from 1, got {step}")
    scalars = (
        1 - lr * weight_decay,
        1 - beta1,
        beta2,
        1 - beta2,
        lr / (1 - beta1**step),
        math.sqrt(1 - beta2**step),
        eps,
        grad_scale,
    )
    maxima = max_exp_avg_sqs if max_exp_avg_sqs is not None else exp_avg_sqs  # a column read with AMSGRAD only
    for launch, (grad_dtype, lowp_dtype) in _multi_launches(
        params, grads, exp_avgs, exp_avg_sqs, maxima, lowps, tables
    ):
        _adamw_multi_kernel[(launch.chunks.shape[0],)](
            launch.table,
            launch.chunks,
            *scalars,
            GRAD_DTYPE=_TL_DTYPE[grad_dtype],
            LOWP_DTYPE=_TL_DTYPE[lowp_dtype or torch.float32],
            COLUMNS=TABLE_COLUMNS,
            BLOCK=BLOCK_SIZE,
            WRITE_LOWP=lowp_dtype is not None,
            SCALE_GRAD=grad_scale != 1.0,
            AMSGRAD=max_exp_avg_sqs is not None,
            MAXIMIZE=maximize,
        )


def fused_sgd_multi_triton(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    momentum_buffers: list[torch.Tensor] | None,
    lowps: list[torch.Tensor | None],
    first_step: bool,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    grad_scale: float = 1.0,
    tables: dict[tuple, MultiTensorTables] | None = None,
    maximize: bool = False,
) -> None:
    """``fused_sgd_triton`` over many shards at the same hyper-parameters and ``first_step``: one
    launch per (gradient dtype, low-precision dtype), the same bits per element (see
    ``fused_adamw_multi_triton``). ``momentum_buffers`` is None when ``momentum`` is 0."""
    if momentum != 0 and momentum_buffers is None:
        raise ValueError("fused_sgd_multi: momentum != 0 needs momentum_buffers (one torch.empty_like(param) each)")
    if (
        len(params) != len(grads)
        or len(params) != len(lowps)
        or (momentum_buffers is not None and len(momentum_buffers) != len(params))
    ):
        raise ValueError("fused_sgd_multi: params, grads, momentum_buffers and lowps must have one entry per shard")
    states = momentum_buffers if momentum != 0 else params  # a column the kernel does not read without momentum
    for launch, (grad_dtype, lowp_dtype) in _multi_launches(params, grads, states, params, params, lowps, tables):
        _sgd_multi_kernel[(launch.chunks.shape[0],)](
            launch.table,
            launch.chunks,
            lr,
            momentum,
            1 - dampening,
            weight_decay,
            grad_scale,
            GRAD_DTYPE=_TL_DTYPE[grad_dtype],
            LOWP_DTYPE=_TL_DTYPE[lowp_dtype or torch.float32],
            COLUMNS=TABLE_COLUMNS,
            BLOCK=BLOCK_SIZE,
            USE_MOMENTUM=momentum != 0,
            FIRST_STEP=first_step,
            NESTEROV=nesterov,
            WRITE_LOWP=lowp_dtype is not None,
            SCALE_GRAD=grad_scale != 1.0,
            DECAY=weight_decay != 0,
            MAXIMIZE=maximize,
        )


def _multi_launches(params, grads, states1, states2, states3, lowps, tables):
    """Yields, per (gradient dtype, low-precision dtype) of these shards, its ``MultiTensorTables``
    brought up to date (kept in ``tables``) and that dtype pair; launches with no element are skipped."""
    launches: dict[tuple, list[int]] = {}
    for i, (grad, lowp) in enumerate(zip(grads, lowps)):
        launches.setdefault((grad.dtype, None if lowp is None else lowp.dtype), []).append(i)
    tables = {} if tables is None else tables
    for dtypes, members in launches.items():
        launch = tables.setdefault(dtypes, MultiTensorTables())
        _multi_tables(
            launch,
            [params[i] for i in members],
            [grads[i] for i in members],
            [states1[i] for i in members],
            [states2[i] for i in members],
            [states3[i] for i in members],
            [lowps[i] for i in members],
        )
        if launch.chunks.shape[0]:
            yield launch, dtypes


def _multi_tables(launch: MultiTensorTables, params, grads, exp_avgs, exp_avg_sqs, maxima, lowps) -> None:
    """Brings ``launch``'s tables up to date for these shards (``MultiTensorTables``); the three state
    columns are AdamW's moments and AMSGrad maximum (``exp_avg_sq`` again, unread, without it), or
    SGD's momentum buffer and two unread columns."""
    rows = tuple(
        (
            p.data_ptr(),
            g.data_ptr(),
            m.data_ptr(),
            v.data_ptr(),
            x.data_ptr(),
            p.data_ptr() if o is None else o.data_ptr(),
            p.numel(),
        )
        for p, g, m, v, x, o in zip(params, grads, exp_avgs, exp_avg_sqs, maxima, lowps)
    )
    _follow_stream(launch, params[0].device)
    if rows == launch.rows:
        return
    old = launch.rows if launch.rows is not None and len(launch.rows) == len(rows) else (None,) * len(rows)
    for row, before, p, g, m, v, x, o in zip(rows, old, params, grads, exp_avgs, exp_avg_sqs, maxima, lowps):
        if row != before:  # a tensor at a new address (or the first time): checked before the kernel reads it
            _check_common(p, g, o)
            _check_shard("exp_avg", m, p, (torch.float32,))
            _check_shard("exp_avg_sq", v, p, (torch.float32,))
            _check_shard("max_exp_avg_sq", x, p, (torch.float32,))
    device = params[0].device
    if any(t.device != device for t in params):
        raise ValueError(f"fused_adamw_multi: shards on several devices: {sorted({str(t.device) for t in params})}")
    numels = tuple(row[6] for row in rows)
    if numels != launch.numels:
        counts = torch.tensor([-(-n // BLOCK_SIZE) for n in numels], dtype=torch.int64)
        shard_of_chunk = torch.repeat_interleave(torch.arange(len(numels)), counts)
        first_chunk = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        chunks = torch.stack([shard_of_chunk, torch.arange(shard_of_chunk.numel()) - first_chunk], dim=1)
        launch.chunks = chunks.contiguous().to(device)  # once per run of shards: a blocking copy is fine
        launch.numels = numels
        launch.builds += 1
    host = torch.tensor(rows, dtype=torch.int64)
    if device.type != "cuda":
        launch.table = host
    else:
        if launch.staging is None or launch.staging.shape != host.shape:
            launch.staging = torch.empty(host.shape, dtype=torch.int64, pin_memory=True)
            launch.table = torch.empty(host.shape, dtype=torch.int64, device=device)
            launch.uploaded = torch.cuda.Event()
        else:
            launch.uploaded.synchronize()  # the last copy out of the pinned buffer is done (long since)
        launch.staging.copy_(host)
        launch.table.copy_(launch.staging, non_blocking=True)  # after the kernels queued before, which read it
        launch.uploaded.record()
    launch.rows = rows
    launch.uploads += 1


def _follow_stream(launch: MultiTensorTables, device: torch.device) -> None:
    """The tables are written and read on the current CUDA stream: when it is not the one they were
    last used on (an optimizer stepped under ``torch.cuda.stream(...)``), it first waits for that one,
    so a new upload cannot overwrite a table a queued kernel still reads, nor a kernel read one still
    being copied."""
    if device.type != "cuda":
        return
    current = torch.cuda.current_stream(device)
    if launch.stream is not None and launch.stream != current:
        current.wait_stream(launch.stream)
    launch.stream = current


def fused_sgd_triton(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None,
    first_step: bool,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    grad_scale: float = 1.0,
    lowp_out: torch.Tensor | None = None,
    maximize: bool = False,
) -> None:
    """The Triton SGD step; ``momentum_buffer`` is updated in place (filled on ``first_step``)."""
    _check_common(param, grad, lowp_out)
    if momentum != 0:
        if momentum_buffer is None:
            raise ValueError(
                "fused_sgd: momentum != 0 needs a momentum_buffer (allocate it with torch.empty_like(param))"
            )
        _check_shard("momentum_buffer", momentum_buffer, param, (torch.float32,))
    numel = param.numel()
    grid = (triton.cdiv(numel, BLOCK_SIZE),)
    _sgd_kernel[grid](
        param,
        grad,
        momentum_buffer if momentum_buffer is not None else param,
        lowp_out if lowp_out is not None else param,
        numel,
        lr,
        momentum,
        1 - dampening,
        weight_decay,
        grad_scale,
        BLOCK=BLOCK_SIZE,
        USE_MOMENTUM=momentum != 0,
        FIRST_STEP=first_step,
        NESTEROV=nesterov,
        WRITE_LOWP=lowp_out is not None,
        SCALE_GRAD=grad_scale != 1.0,
        DECAY=weight_decay != 0,
        MAXIMIZE=maximize,
    )


def fused_sgd_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None,
    first_step: bool,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    grad_scale: float = 1.0,
    lowp_out: torch.Tensor | None = None,
    maximize: bool = False,
) -> None:
    """``sgd_reference`` with the fused kernel's signature (buffer updated in place)."""
    buffer = momentum_buffer if (momentum != 0 and not first_step) else None
    new_buffer = sgd_reference(
        param, grad, buffer, lr, momentum, dampening, weight_decay, nesterov, grad_scale, maximize
    )
    if momentum != 0 and first_step:
        momentum_buffer.copy_(new_buffer)
    if lowp_out is not None:
        lowp_out.copy_(param)


def fused_adamw_reference(
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
    lowp_out: torch.Tensor | None = None,
    max_exp_avg_sq: torch.Tensor | None = None,
    maximize: bool = False,
) -> None:
    """``adamw_reference`` with the fused kernel's signature (writes ``lowp_out`` too)."""
    adamw_reference(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        step,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        grad_scale,
        max_exp_avg_sq,
        maximize,
    )
    if lowp_out is not None:
        lowp_out.copy_(param)


# Each op is called through a plain function that passes every argument by position. torch 2.11's
# ADInplaceOrView kernel for custom ops bumps the version of each mutated argument by its position in
# the call (``args[idx]``), so a mutated argument left to its default or passed by keyword (``lowp_out``)
# raises IndexError there (2.13 fills in defaults first).
# The ops' schemas have no defaults, so a direct caller must pass everything too.


def fused_adamw(
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
    lowp_out: torch.Tensor | None = None,
    max_exp_avg_sq: torch.Tensor | None = None,
    maximize: bool = False,
) -> None:
    """One AdamW step over a flat fp32 shard, in place (``zcompile::fused_adamw``); ``max_exp_avg_sq`` given: AMSGrad."""
    _fused_adamw_op(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        step,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        grad_scale,
        lowp_out,
        max_exp_avg_sq,
        maximize,
    )


def fused_sgd(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None,
    first_step: bool,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    grad_scale: float = 1.0,
    lowp_out: torch.Tensor | None = None,
    maximize: bool = False,
) -> None:
    """One SGD step over a flat fp32 shard, in place (``zcompile::fused_sgd``)."""
    _fused_sgd_op(
        param,
        grad,
        momentum_buffer,
        first_step,
        lr,
        momentum,
        dampening,
        weight_decay,
        nesterov,
        grad_scale,
        lowp_out,
        maximize,
    )


@torch.library.custom_op(
    "zcompile::fused_adamw", mutates_args=("param", "exp_avg", "exp_avg_sq", "lowp_out", "max_exp_avg_sq")
)
def _fused_adamw_op(
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
    grad_scale: float,
    lowp_out: torch.Tensor | None,
    max_exp_avg_sq: torch.Tensor | None,
    maximize: bool,
) -> None:
    """One AdamW step over a flat fp32 shard, in place: Triton where it runs, else the reference."""
    update = fused_adamw_triton if use_triton(param) else fused_adamw_reference
    update(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        step,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        grad_scale,
        lowp_out,
        max_exp_avg_sq,
        maximize,
    )


@_fused_adamw_op.register_fake
def _(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    step,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    grad_scale,
    lowp_out,
    max_exp_avg_sq,
    maximize,
):
    return None


@torch.library.custom_op("zcompile::fused_sgd", mutates_args=("param", "momentum_buffer", "lowp_out"))
def _fused_sgd_op(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None,
    first_step: bool,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    grad_scale: float,
    lowp_out: torch.Tensor | None,
    maximize: bool,
) -> None:
    """One SGD step over a flat fp32 shard, in place: Triton where it runs, else the reference."""
    update = fused_sgd_triton if use_triton(param) else fused_sgd_reference
    update(
        param,
        grad,
        momentum_buffer,
        first_step,
        lr,
        momentum,
        dampening,
        weight_decay,
        nesterov,
        grad_scale,
        lowp_out,
        maximize,
    )


@_fused_sgd_op.register_fake
def _(
    param,
    grad,
    momentum_buffer,
    first_step,
    lr,
    momentum,
    dampening,
    weight_decay,
    nesterov,
    grad_scale,
    lowp_out,
    maximize,
):
    return None
