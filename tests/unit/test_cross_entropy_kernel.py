"""The Triton kernel of ``zcompile::cross_entropy_backward`` against the torch path and ATen's two ops.

On a machine without a GPU it runs in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by
``conftest.py``); ``benchmarks/gpu_check.py`` runs this file compiled for the GPU, where the op
itself dispatches to the kernel. The kernel's ``exp`` is the device's (numpy's in the interpreter),
so fp32 results agree with the torch path (ATen's two ops) to an ulp of the row's scale; rounding
into bf16 on top of that agrees to a bf16 ulp.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from zcompile.kernels.cross_entropy import (  # noqa: E402
    TRITON_BLOCK,
    cross_entropy_backward,
    cross_entropy_backward_reference,
    cross_entropy_backward_torch,
    cross_entropy_backward_triton,
)
from zcompile.kernels.dispatch import use_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not use_triton(torch.empty(0, device=DEVICE)):
    pytest.skip(f"no Triton path for {DEVICE} tensors (TRITON_INTERPRET=0 without a GPU)", allow_module_level=True)

aten = torch.ops.aten
CLASSES = TRITON_BLOCK + 37  # two programs per row, the second one masked


def _case(dtype, reduction, weighted, rows):
    generator = torch.Generator().manual_seed(7 * reduction + weighted + rows)
    shape = (rows, CLASSES) if rows else (CLASSES,)
    log_probs = torch.log_softmax(torch.randn(shape, generator=generator) * 3, -1).to(dtype)
    target = torch.randint(0, CLASSES, shape[:-1], generator=generator)
    if rows:
        target[::5] = -100
    weight = torch.rand(CLASSES, generator=generator).to(dtype) if weighted else None
    log_probs, target = log_probs.to(DEVICE), target.to(DEVICE)
    weight = weight.to(DEVICE) if weight is not None else None
    loss, total_weight = aten.nll_loss_forward(log_probs, target, weight, reduction, -100)
    grad = torch.randn(loss.shape, generator=generator).to(dtype).to(DEVICE)
    return grad, log_probs, target, weight, reduction, -100, total_weight


def _assert_within_an_ulp(got, expected, scale_dtype):
    assert got.dtype == expected.dtype and got.shape == expected.shape
    ulp = torch.finfo(scale_dtype).eps * expected.abs().max().item()  # an exp an ulp apart, times s
    torch.testing.assert_close(got, expected, rtol=2 * torch.finfo(got.dtype).eps, atol=2 * ulp)


@pytest.mark.parametrize(
    "dtype,out_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float32, torch.bfloat16),
    ],
    ids=["fp32", "bf16", "fp16", "fp32-to-bf16"],
)
@pytest.mark.parametrize("reduction", [0, 1, 2], ids=["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True], ids=["", "weighted"])
def test_kernel_equals_torch_path(dtype, out_dtype, reduction, weighted):
    """Every reduction, class weights, ignored rows, half dtypes and a cast into another output dtype:
    the kernel against the torch path, and the kernel against ATen's two ops where their output
    dtype is the same."""
    args = _case(dtype, reduction, weighted, rows=6)
    got = cross_entropy_backward_triton(*args, dtype, out_dtype)
    # the torch path in the log-probabilities' dtype (a CPU's ATen has no half-to-float softmax), rounded
    _assert_within_an_ulp(got, cross_entropy_backward_torch(*args, dtype, dtype).to(out_dtype), torch.float32)
    assert got.abs().sum() > 0
    if out_dtype == dtype:
        _assert_within_an_ulp(got, cross_entropy_backward_reference(*args, dtype), torch.float32)


def test_kernel_without_a_batch_dimension_and_on_a_strided_input():
    """``[classes]`` log-probabilities, and rows that are a strided view (every other row of a buffer)."""
    args = _case(torch.float32, 1, False, rows=0)
    _assert_within_an_ulp(
        cross_entropy_backward_triton(*args, torch.float32, torch.float32),
        cross_entropy_backward_torch(*args, torch.float32, torch.float32),
        torch.float32,
    )
    grad, log_probs, target, weight, reduction, ignore, total_weight = _case(torch.float32, 2, False, rows=8)
    strided = log_probs[::2]
    args = (grad, strided, target[::2], weight, reduction, ignore, total_weight)
    _assert_within_an_ulp(
        cross_entropy_backward_triton(*args, torch.float32, torch.float32),
        cross_entropy_backward_torch(*args, torch.float32, torch.float32),
        torch.float32,
    )


def test_op_dispatches_to_the_kernel_on_cuda_only(monkeypatch):
    """On the CPU the op runs the torch path even under the interpreter (the interpreter is for these
    tests, not for training); on CUDA it runs the kernel."""
    import zcompile.kernels.cross_entropy as cross_entropy

    calls = []
    monkeypatch.setattr(
        cross_entropy, "cross_entropy_backward_triton", lambda *a: calls.append(a) or cross_entropy_backward_torch(*a)
    )
    args = _case(torch.float32, 1, False, rows=2)
    cross_entropy_backward(*args, torch.float32, torch.float32)
    assert len(calls) == (1 if DEVICE == "cuda" else 0)
