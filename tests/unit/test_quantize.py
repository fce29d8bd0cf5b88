"""Block-wise quantization kernels: Triton against the pure-torch reference, bit for bit.

On a machine without a GPU the Triton kernels run in Triton's CPU interpreter; TRITON_INTERPRET
must be set before triton is imported (``triton.jit`` reads it when a kernel is decorated). With a
GPU, run with TRITON_INTERPRET=0 to test the compiled kernels on CUDA tensors.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from zcompile.kernels import quantize as qz  # noqa: E402
from zcompile.kernels.dispatch import interpreting, triton_available, use_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not use_triton(torch.empty(0, device=DEVICE)):
    pytest.skip(f"no Triton path for {DEVICE} tensors (TRITON_INTERPRET=0 without a GPU)", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (numel, block): one element, block - 1, block, block + 1, and primes; small blocks keep the interpreter fast.
SIZES = [(1, 64), (63, 64), (64, 64), (65, 64), (1009, 64), (4099, 256)]
# Every fp32 rounding on the way (inv, x * inv, + 0.5, scale, q * scale) is at most half an ulp of a
# value <= qmax * step (or <= qmax + 1), i.e. <= 2**-24 * 128 * step, about 8e-6 step; 1e-4 step covers
# them with margin, on top of the half step that rounding to the nearest level costs.
FP32_SLACK = 1e-4


def _unpack4(q: torch.Tensor) -> torch.Tensor:
    """The int4 values of packed bytes, written independently of the module: low nibble first."""
    byte = q.to(torch.int32)
    nibbles = torch.stack([byte & 0xF, byte >> 4], dim=1).reshape(-1)
    return torch.where(nibbles >= 8, nibbles - 16, nibbles)


def _levels(q: torch.Tensor, bits: int) -> torch.Tensor:
    return q.to(torch.int32) if bits == 8 else _unpack4(q)


def _sample(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen) * torch.logspace(-2, 2, numel)[torch.randperm(numel, generator=gen)]
    return x.to(dtype).to(DEVICE)


def _assert_within_half_step(approx, exact, scales, block, dtype=torch.float32):
    """|approx - exact| <= half a quantization step (plus the fp32 slack); when ``approx`` was cast
    to a 16-bit dtype, plus that cast's rounding: half an ulp, <= eps/2 * |value|, or half the
    subnormal spacing for tiny values."""
    step = scales.repeat_interleave(block)[: exact.numel()]
    tol = step * (0.5 + FP32_SLACK)
    if dtype != torch.float32:
        info = torch.finfo(dtype)
        tol = tol + info.eps / 2 * exact.abs() + info.smallest_normal * info.eps / 2
    err = (approx.float() - exact.float()).abs()
    assert bool((err <= tol).all()), f"max excess {(err - tol).max().item():.3g}"


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel,block", SIZES)
def test_quantize_dequantize_match_reference(numel, block, dtype, bits):
    x = _sample(numel, dtype, seed=numel + bits)
    q, scales = qz.quantize_blockwise_triton(x, bits, block)
    q_ref, scales_ref = qz.quantize_blockwise_reference(x, bits, block)
    blocks = -(-numel // block)
    assert q.dtype == (torch.int8 if bits == 8 else torch.uint8) and q.numel() == blocks * block * bits // 8
    assert scales.shape == (blocks,) and scales.dtype == torch.float32
    # Exact, scales included (no 1-ulp allowance): both sides divide with IEEE round-to-nearest
    # (tl.math.div_rn / torch tensor-by-tensor division) and the kernels are launched without FMA
    # contraction, so every fp32 op rounds the same way. One ulp off in qmax / absmax could flip a q.
    assert torch.equal(q, q_ref)
    assert torch.equal(scales, scales_ref)
    assert not bool(_levels(q, bits)[numel:].any()), "padding must be zero"

    for out_dtype in {torch.float32, dtype}:
        out = qz.dequantize_blockwise_triton(q, scales, numel, bits, block, out_dtype)
        assert out.dtype == out_dtype and out.shape == (numel,)
        assert torch.equal(out, qz.dequantize_blockwise_reference(q, scales, numel, bits, block, out_dtype))
        _assert_within_half_step(out, x, scales, block, out_dtype)


@pytest.mark.parametrize("bits", [8, 4])
def test_zero_blocks_have_zero_scale_and_no_nan(bits):
    x = torch.zeros(3 * 64, device=DEVICE)
    x[64:128] = torch.linspace(-1, 1, 64)
    q, scales = qz.quantize_blockwise_triton(x, bits, 64)
    assert scales[0].item() == 0 and scales[2].item() == 0 and scales[1].item() > 0
    levels = _levels(q, bits)
    assert not bool(levels[:64].any()) and not bool(levels[128:].any())
    out = qz.dequantize_blockwise_triton(q, scales, x.numel(), bits, 64)
    assert bool(out.isfinite().all()) and not bool(out[:64].any())
    assert torch.equal(q, qz.quantize_blockwise_reference(x, bits, 64)[0])


def test_nibble_layout_and_rounding():
    # absmax 7 -> inv 1: levels are floor(x + 0.5), i.e. halves round up.
    x = torch.tensor([7.0, -7.0, 1.0, -1.0, 0.5, -0.5, 2.5, -2.5], device=DEVICE)
    for quantize in (qz.quantize_blockwise_triton, qz.quantize_blockwise_reference):
        q, scales = quantize(x, 4, 8)
        assert q.tolist() == [0x97, 0xF1, 0x01, 0xE3]  # (7, -7), (1, -1), (1, 0), (3, -2): low nibble first
        assert scales.tolist() == [1.0]
        q8, _ = quantize(x * (127 / 7), 8, 8)
        assert q8.tolist() == [127, -127, 18, -18, 9, -9, 45, -45]


@pytest.mark.parametrize("bits", [8, 4])
def test_dequantize_reduce_sums_partitions(bits):
    numel, block, parts = 1009, 64, 3
    pairs = [qz.quantize_blockwise_reference(_sample(numel, torch.float32, seed=p), bits, block) for p in range(parts)]
    q, scales = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    expected = sum(qz.dequantize_blockwise_reference(q[p], scales[p], numel, bits, block) for p in range(parts))
    expected = expected * (1 / parts)

    total = qz.dequantize_reduce_triton(q, scales, numel, bits, block, scale_by=1 / parts)
    assert torch.equal(total, qz.dequantize_reduce_reference(q, scales, numel, bits, block, 1 / parts))
    # Zero tolerance: the kernel adds the partitions in the same order (partition 0 first, from 0.0)
    # with one rounded fp32 add each and no FMA, then one fp32 multiply by scale_by, as here.
    assert total.dtype == torch.float32 and torch.equal(total, expected)

    q_out, scales_out = qz.dequantize_reduce_triton(q, scales, numel, bits, block, 1 / parts, requantize=True)
    q_ref, scales_ref = qz.dequantize_reduce_reference(q, scales, numel, bits, block, 1 / parts, requantize=True)
    assert torch.equal(q_out, q_ref) and torch.equal(scales_out, scales_ref)
    assert q_out.shape == q[0].shape and not bool(_levels(q_out, bits)[numel:].any())
    round_trip = qz.dequantize_blockwise_reference(q_out, scales_out, numel, bits, block)
    _assert_within_half_step(round_trip, expected, scales_out, block)


def _all_paths(name):
    return [getattr(qz, name), getattr(qz, f"{name}_triton"), getattr(qz, f"{name}_reference")]


@pytest.mark.parametrize(
    "args,exc,match",
    [
        ((torch.randn(100), 8, 1000), ValueError, "power of two"),
        ((torch.randn(100), 8, 1), ValueError, "power of two"),
        ((torch.randn(100), 3, 64), ValueError, "bits must be 8"),
        ((torch.arange(100), 8, 64), TypeError, "float32, bfloat16 or float16"),
        ((torch.randn(0), 8, 64), ValueError, "empty"),
    ],
)
def test_quantize_rejects_bad_inputs(args, exc, match):
    for fn in _all_paths("quantize_blockwise"):
        with pytest.raises(exc, match=match):
            fn(args[0].to(DEVICE), *args[1:])


def test_other_ops_reject_bad_inputs():
    q, scales = qz.quantize_blockwise_reference(torch.randn(100, device=DEVICE), 8, 64)
    for fn in _all_paths("dequantize_blockwise"):
        with pytest.raises(TypeError, match="q must be torch.uint8 for 4 bits"):
            fn(q, scales, 100, 4, 64)
        with pytest.raises(ValueError, match="do not fit numel=1000"):
            fn(q, scales, 1000, 8, 64)
    for fn in _all_paths("dequantize_reduce"):
        with pytest.raises(TypeError, match="scales must be float32"):
            fn(q[None], scales[None].double(), 100, 8, 64)


def _spy(monkeypatch, suffix):
    calls = []
    for name in ("quantize_blockwise", "dequantize_blockwise", "dequantize_reduce"):
        real = getattr(qz, f"{name}_{suffix}")

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(qz, f"{name}_{suffix}", spy)
    return calls


def _run_all_ops():
    x = torch.randn(300, device=DEVICE)
    q, scales = qz.quantize_blockwise(x, 4, 64)
    out = qz.dequantize_blockwise(q, scales, 300, 4, 64, torch.bfloat16)
    total = qz.dequantize_reduce(torch.stack([q, q]), torch.stack([scales, scales]), 300, 4, 64, 0.5)
    q2, _ = qz.dequantize_reduce(torch.stack([q, q]), torch.stack([scales, scales]), 300, 4, 64, requantize=True)
    return q, out, total, q2


def test_ops_dispatch_to_triton(monkeypatch):
    assert triton_available() and use_triton(torch.empty(0, device=DEVICE))
    calls = _spy(monkeypatch, "triton")
    q, out, total, q2 = _run_all_ops()
    reduce = "dequantize_reduce"
    assert calls == ["quantize_blockwise", "dequantize_blockwise", reduce, reduce]
    assert torch.equal(q2, q)


@pytest.mark.skipif(DEVICE != "cpu", reason="CUDA tensors always take the Triton path")
def test_ops_fall_back_to_reference_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not interpreting() and not use_triton(torch.empty(0))
    triton_calls, reference_calls = _spy(monkeypatch, "triton"), _spy(monkeypatch, "reference")
    _run_all_ops()
    assert triton_calls == [] and len(reference_calls) == 4
    assert not use_triton(torch.empty(0, device="meta"))


def test_ops_trace_in_compiled_graph():
    torch._dynamo.reset()

    def step(x):
        q, scales = qz.quantize_blockwise(x * 2, 8, 64)
        total = qz.dequantize_reduce(torch.stack([q, q]), torch.stack([scales, scales]), x.numel(), 8, 64, 0.5)
        q4, scales4 = qz.dequantize_reduce(q[None], scales[None], x.numel(), 8, 64, requantize=True)
        return qz.dequantize_blockwise(q4, scales4, x.numel(), 8, 64, torch.float16) + 1, total * 2

    x = torch.randn(200, device=DEVICE)
    eager = step(x)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(x)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


@pytest.mark.parametrize("op_name", ["quantize_blockwise", "dequantize_blockwise", "dequantize_reduce"])
def test_fake_impls_pass_opcheck(op_name):
    x = torch.randn(100, device=DEVICE)
    q, scales = qz.quantize_blockwise_reference(x, 4, 64)
    args = {
        "quantize_blockwise": (x, 4, 64),
        "dequantize_blockwise": (q, scales, 100, 4, 64, torch.bfloat16),
        "dequantize_reduce": (torch.stack([q, q]), torch.stack([scales, scales]), 100, 4, 64, 0.5),
    }[op_name]
    ops = [getattr(torch.ops.zcompile, op_name).default]
    if op_name == "dequantize_reduce":
        ops.append(torch.ops.zcompile.dequantize_reduce_requantize.default)
    for op in ops:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
