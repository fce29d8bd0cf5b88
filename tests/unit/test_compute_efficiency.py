"""``zcompile.predict.compute_efficiency``: the reference workload's compiled graphs are priced for the FLOPs
torch counts on the same step, and the efficiency is predicted over measured time, capped at 1 (a
profile's ``compute_efficiency`` slowing every op is ``test_hardware``'s)."""

from __future__ import annotations

import pytest
import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from zcompile.predict.compute_efficiency import (
    REFERENCE_LAYERS,
    REFERENCE_SHAPE,
    measure_compute_efficiency,
    reference_loss,
    reference_model,
)
from zcompile.predict.cost_model import CollectiveCosts, ComputeCosts, predict_step


def _step_flops() -> int:
    """The reference step's FLOPs: torch's own counter on an eager step for the matmuls, torch's
    formulas for the attention kernels (the counter has none for the CPU ones)."""
    with FlopCounterMode(display=False) as counter:
        reference_loss(reference_model()(torch.randn(REFERENCE_SHAPE))).backward()
    batch, seq, width = REFERENCE_SHAPE
    heads = (batch, 4, seq, width // 4)
    attention = flop_counter.sdpa_flop_count(heads, heads, heads) + flop_counter.sdpa_backward_flop_count(
        heads, heads, heads, heads
    )
    return counter.get_total_flops() + REFERENCE_LAYERS * attention


def test_compiled_reference_is_priced_for_its_flops():
    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(reference_model(), backend="zero", options={"stage": 1, "on_compile": graphs.append})
    reference_loss(compiled(torch.randn(REFERENCE_SHAPE))).backward()
    flops_only = ComputeCosts(1e9, float("inf"), 0.0)
    predicted = predict_step(graphs, CollectiveCosts(1), flops_only).step_s
    assert predicted * 1e9 == pytest.approx(_step_flops(), rel=1e-9)


def test_efficiency_is_predicted_over_measured_capped_at_one():
    flops = _step_flops()
    # a device on which the step's FLOPs alone take 1000 s: predicted over measured is capped at 1
    assert measure_compute_efficiency(ComputeCosts(flops / 1000.0, float("inf")), repeats=1) == 1.0
    # one on which they take 1 us: the measured step (well over 100 us) makes it small, yet positive
    assert 0.0 < measure_compute_efficiency(ComputeCosts(flops * 1e6, float("inf")), repeats=1) < 1e-2
