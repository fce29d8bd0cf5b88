"""Weights kept gathered stay kept under an ``activation_memory_budget``: the budget's partitioner
recomputes every op it may, and a kept stage-3 gather with no tag would be one of them (the weight
re-gathered in backward while ``step_report`` and ``simulate`` counted it kept). A transformers Llama
in a fake world of 4 ranks, every weight kept, recomputing everything."""

from __future__ import annotations

import pytest
import torch

import zcompile
from support.models import small_llama_config
from zcompile.passes.collectives import collective_nodes
from zcompile.passes.metadata import params_of

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("budget", [None, 0.0])
def test_kept_weights_are_not_gathered_again_in_backward(budget):
    config = small_llama_config()
    ids = torch.zeros(2, 32, dtype=torch.long)
    graphs = []
    options = {"stage": 3, "keep_gathered_mb": 100, "activation_memory_budget": budget, "bucket_mb": 0}
    zcompile.simulate(
        lambda: transformers.LlamaForCausalLM(config),
        {"input_ids": ids, "labels": ids},
        world_size=4,
        options={**options, "on_compile": graphs.append},
        hardware="h100-sxm",
    )
    (compiled,) = graphs
    kept = set(compiled.keep_gathered.kept_params)
    assert len(kept) >= 2 * 7  # every layer's seven matrices at least
    regathered = {p for c in collective_nodes(compiled.backward) if c.kind == "all_gather" for p in params_of(c.node)}
    assert not kept & regathered, sorted(kept & regathered)
