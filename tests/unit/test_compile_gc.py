"""compile_gc: generation 2's collections wait while zcompile compiles, forward and backward, and the
collector's thresholds are the user's again after."""

from __future__ import annotations

import gc

import pytest
import torch

import zcompile.backend.aot
from zcompile.backend.compile_gc import DEFERRED_THRESHOLD, full_collections_deferred


def test_the_threshold_is_raised_inside_and_restored_after_also_on_an_error_and_when_nested():
    before = gc.get_threshold()
    with full_collections_deferred():
        assert gc.get_threshold() == (*before[:2], DEFERRED_THRESHOLD)
        with full_collections_deferred():  # a nested compile leaves the outer one in charge
            assert gc.get_threshold()[2] == DEFERRED_THRESHOLD
        assert gc.get_threshold()[2] == DEFERRED_THRESHOLD
    assert gc.get_threshold() == before
    with pytest.raises(RuntimeError, match="boom"):
        with full_collections_deferred():
            raise RuntimeError("boom")
    assert gc.get_threshold() == before


def test_a_disabled_collector_is_left_alone():
    before = gc.get_threshold()
    gc.disable()
    try:
        with full_collections_deferred():
            assert gc.get_threshold() == before
    finally:
        gc.enable()


def test_forward_and_backward_compile_with_full_collections_deferred(monkeypatch):
    seen = []
    run_passes = zcompile.backend.aot.run_passes

    def recording(context, graph, gm, *args, **kwargs):
        seen.append((graph, gc.get_threshold()[2]))
        return run_passes(context, graph, gm, *args, **kwargs)

    monkeypatch.setattr(zcompile.backend.aot, "run_passes", recording)
    before = gc.get_threshold()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    compiled = torch.compile(model, backend="zero", options={"stage": 2})
    compiled(torch.randn(4, 8)).sum().backward()  # the backward compiles at its first call
    assert {graph for graph, _ in seen} >= {"forward", "backward"}
    assert all(threshold == DEFERRED_THRESHOLD for _, threshold in seen), seen
    assert gc.get_threshold() == before
