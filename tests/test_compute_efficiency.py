"""``zcompile.compute_efficiency``: the reference workload is priced from the graphs it times, and a
profile's ``compute_efficiency`` slows every op's prediction by its inverse (``test_hardware``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from zcompile.compute_efficiency import (REFERENCE_LAYERS, REFERENCE_SHAPE, measure_compute_efficiency,
                                         reference_loss, reference_model)
from zcompile.cost_model import ComputeCosts


def test_efficiency_prices_the_timed_step():
    """With FLOPs as the only cost, predicted over measured is the step's FLOPs (torch's own counter on
    an eager step for the matmuls, torch's formulas for the attention kernels, which the counter
    leaves out on a CPU) over the FLOP/s, over the measured time: bounded by that on both sides."""
    model = reference_model()
    with FlopCounterMode(display=False) as counter:
        reference_loss(model(torch.randn(REFERENCE_SHAPE))).backward()
    batch, seq, width = REFERENCE_SHAPE
    heads = (batch, 4, seq, width // 4)
    flops = counter.get_total_flops() + REFERENCE_LAYERS * (
        flop_counter.sdpa_flop_count(heads, heads, heads) + flop_counter.sdpa_backward_flop_count(heads, heads, heads, heads))
    # a device so slow that the step's FLOPs alone take 1000 s: predicted over measured is capped at 1
    assert measure_compute_efficiency(ComputeCosts(flops / 1000.0, float("inf")), repeats=1) == 1.0
    # one so fast that they take 1 us: far below 1, yet positive
    fast = measure_compute_efficiency(ComputeCosts(flops * 1e6, float("inf")), repeats=1)
    assert 0.0 < fast < 1e-2
    # the same device with the FLOP/s halved predicts twice the time: the efficiency doubles (same run
    # times up to noise, so compare through the prediction alone: both below the cap)
    assert measure_compute_efficiency(ComputeCosts(flops * 5e5, float("inf")), repeats=1) == pytest.approx(
        2 * fast, rel=0.5)
