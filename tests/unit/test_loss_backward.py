"""Cross-entropy's backward in one logits-sized buffer (``zcompile::cross_entropy_backward`` and
``passes.loss_backward``), against ATen's two ops, eager PyTorch's gradients and the allocator."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.nn.functional as F

import zcompile.kernels.cross_entropy as cross_entropy
from zcompile.kernels.cross_entropy import (
    CROSS_ENTROPY_BACKWARD,
    cross_entropy_backward,
    cross_entropy_backward_reference,
)
from zcompile.passes.loss_backward import LOG_SOFTMAX_BACKWARD, NLL_LOSS_BACKWARD
from zcompile.reports.timeline import record_step

aten = torch.ops.aten
CLASSES, ROWS = 37, 50


def _case(dtype, reduction, weighted, rows):
    torch.manual_seed(reduction + 3 * weighted)
    shape = (rows, CLASSES) if rows else (CLASSES,)
    log_probs = torch.log_softmax(torch.randn(shape, dtype=dtype) * 3, -1)
    target = torch.randint(0, CLASSES, shape[:-1])
    if rows:
        target[::7] = -100  # ignored rows
    weight = torch.rand(CLASSES, dtype=dtype) if weighted else None
    loss, total_weight = aten.nll_loss_forward(log_probs, target, weight, reduction, -100)
    return (torch.randn(loss.shape, dtype=dtype), log_probs, target, weight, reduction, -100, total_weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("reduction", [0, 1, 2], ids=["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True], ids=["", "weighted"])
@pytest.mark.parametrize("rows", [ROWS, 0], ids=["2d", "1d"])
def test_op_equals_atens_two_ops_bit_for_bit(dtype, reduction, weighted, rows, monkeypatch):
    """Every reduction, class weights, ignored rows, with and without a batch dimension: the CPU's path
    is ATen's two ops a block of rows at a time, so the bits are theirs, whatever the block size
    (one row, three, the default sixteenth)."""
    args = _case(dtype, reduction, weighted, rows)
    expected = cross_entropy_backward_reference(*args, dtype)
    for chunk_elements in (cross_entropy.CHUNK_ELEMENTS, 3 * CLASSES, 1):
        monkeypatch.setattr(cross_entropy, "CHUNK_ELEMENTS", chunk_elements)
        got = cross_entropy_backward(*args, dtype, expected.dtype)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(got, expected), chunk_elements
    assert not torch.equal(expected, torch.zeros_like(expected))


def test_blocks_hold_at_most_a_sixteenth_of_the_logits():
    assert cross_entropy.chunk_rows(128, 4096) == 8
    assert cross_entropy.chunk_rows(8192, 128256) == 8  # CHUNK_ELEMENTS (1M) / classes
    assert cross_entropy.chunk_rows(1, 37) == 1 and cross_entropy.chunk_rows(17, 37) == 2


def test_a_batch_of_ignored_rows_has_a_zero_gradient_as_in_aten():
    """Every target ``ignore_index``: the mean's total weight is 0 (the loss is NaN) and ATen's
    gradient is all zeros, not NaN: the op's too."""
    log_probs = torch.log_softmax(torch.randn(4, CLASSES), -1)
    target = torch.full((4,), -100)
    loss, total_weight = aten.nll_loss_forward(log_probs, target, None, 1, -100)
    assert loss.isnan() and total_weight == 0
    args = (torch.ones(()), log_probs, target, None, 1, -100, total_weight, torch.float32)
    got = cross_entropy_backward(*args, torch.float32)
    assert torch.equal(got, cross_entropy_backward_reference(*args))
    assert torch.equal(got, torch.zeros_like(got))


class TinyLM(torch.nn.Module):
    """Logits much larger than anything else: the loss's backward is the step's peak."""

    def __init__(self, vocab: int = 4096, width: int = 16):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, vocab)

    def forward(self, tokens, targets, **loss_options):
        logits = self.head(torch.tanh(self.embed(tokens)))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), **loss_options)


def _batch(vocab: int = 4096):
    torch.manual_seed(1)
    tokens = torch.randint(0, vocab, (2, 32))
    targets = tokens.roll(-1, 1)
    targets[:, -1] = -100
    return tokens, targets


def _compiled(fuse: bool, graphs: list):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyLM()
    options = {"stage": 1, "fuse_loss_backward": fuse, "on_compile": graphs.append}
    return model, torch.compile(model, backend="zero", options=options)


@pytest.mark.parametrize(
    "loss_options", [{}, {"reduction": "sum"}, {"weight": "classes"}], ids=["mean", "sum", "weighted"]
)
def test_compiled_gradients_equal_eager_pytorch(loss_options):
    """A world of one: the zero backend's gradients with the fused backward against eager PyTorch's
    (the same ops: bit for bit but for the compiled graph's own reassociations); the backward graph
    holds the fused op and neither ATen op."""
    if loss_options.get("weight") == "classes":
        loss_options = {"weight": torch.rand(4096, generator=torch.Generator().manual_seed(2))}
    tokens, targets = _batch()
    torch.manual_seed(0)
    eager = TinyLM()
    eager(tokens, targets, **loss_options).backward()
    graphs: list = []
    model, compiled = _compiled(True, graphs)
    compiled(tokens, targets, **loss_options).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    (graph,) = graphs
    targets_run = [n.target for n in graph.backward.graph.nodes if n.op == "call_function"]
    assert CROSS_ENTROPY_BACKWARD in targets_run
    assert NLL_LOSS_BACKWARD not in targets_run and LOG_SOFTMAX_BACKWARD not in targets_run


def _peak(fuse: bool) -> int:
    tokens, targets = _batch()
    _, compiled = _compiled(fuse, [])
    compiled(tokens, targets).backward()
    with tempfile.TemporaryDirectory() as trace_dir:
        return record_step(lambda: compiled(tokens, targets).backward(), trace_dir, rank=0).peak_bytes


def test_fused_backward_holds_one_logits_buffer_less():
    """The allocator's peak of a forward and backward (torch.profiler's memory events) is one fp32 logits
    buffer (64 rows x 4096 classes: 1 MiB, against 0.5 MiB of weights) lower with the fusion than
    without, less the block of rows the nll gradient is made in (a sixteenth of it);
    ``fuse_loss_backward=False`` keeps ATen's two ops."""
    logits_bytes = 64 * 4096 * 4
    unfused, fused = _peak(False), _peak(True)
    assert unfused - fused == pytest.approx(logits_bytes * 15 / 16, rel=0.02), (unfused, fused)


def test_pair_with_another_reader_is_left_alone():
    """An ``nll_loss_backward`` whose result something else reads too is not the loss's plain backward:
    the pass leaves the graph as it is."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from zcompile.passes.loss_backward import fuse_cross_entropy_backward_pass

    def backward(grad, log_probs, target, total_weight):
        g = aten.nll_loss_backward(grad, log_probs, target, None, 1, -100, total_weight)
        return aten._log_softmax_backward_data(g, log_probs, 1, torch.float32), g.sum()

    def plain(grad, log_probs, target, total_weight):
        g = aten.nll_loss_backward(grad, log_probs, target, None, 1, -100, total_weight)
        return aten._log_softmax_backward_data(g, log_probs.detach(), 1, torch.float32)

    grad, log_probs, target, _, _, _, total_weight = _case(torch.float32, 1, False, ROWS)
    inputs = (grad, log_probs, target, total_weight)
    shared = fuse_cross_entropy_backward_pass(make_fx(backward, tracing_mode="fake")(*inputs))
    assert CROSS_ENTROPY_BACKWARD not in [n.target for n in shared.graph.nodes]
    fused = fuse_cross_entropy_backward_pass(make_fx(plain, tracing_mode="fake")(*inputs))
    calls = [n.target for n in fused.graph.nodes if n.op == "call_function"]
    assert calls == [CROSS_ENTROPY_BACKWARD]  # the detach only the erased op read went with it
    assert torch.equal(fused(*inputs), plain(*inputs))


def test_option_must_be_a_bool():
    from zcompile.config import ZeroConfig

    with pytest.raises(TypeError, match="fuse_loss_backward"):
        ZeroConfig(fuse_loss_backward="yes")
