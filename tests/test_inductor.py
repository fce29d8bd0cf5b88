"""The inductor inner compiler: generated kernels around the same collectives, same training.

Inductor fuses and reorders elementwise work, which changes roundings at the 1e-7 level only;
the SGD tolerances of test_training apply unchanged.
"""

import torch

from support.launch import run_ranks
from support.training import RunSpec, assert_same_training, train_reference, zero_run_on_rank


def test_stage3_inductor_matches_single_process():
    spec = RunSpec(model="gpt", stage=3, optimizer="sgd", lr=0.1, options={"compiler": "inductor"})
    keep = RunSpec(
        model="gpt", stage=3, optimizer="sgd", lr=0.1, options={"compiler": "inductor", "keep_gathered_mb": 100}
    )
    # blocks compiled one by one (the FSDP2 habit, whose torch.compile is inductor's): each layer's
    # call takes the first gather the call before issued, through inductor's code (zcompile.backend.call_prefetch)
    blocks = RunSpec(
        model="gpt", stage=3, blocks=True, grad_accum=2, optimizer="sgd", lr=0.1, options={"compiler": "inductor"}
    )
    (result, kept, in_blocks), (_, _, in_blocks1) = run_ranks(2, zero_run_on_rank, [spec, keep, blocks], timeout_s=900)
    assert_same_training(result, train_reference(spec, world=2), spec)
    # keep-gathered reaches inductor's partitioner through its joint-graph hook: nothing re-gathered
    assert_same_training(kept, train_reference(keep, world=2), keep)
    assert kept.facts["kept_params"] > 0 and kept.facts["bw_all_gathers"] == 0
    assert result.facts["bw_all_gathers"] > 0
    # the generated code still gathers every parameter and reduce-scatters every gradient
    assert result.facts["fw_all_gathers"] == result.facts["gather_nodes"] > 0
    assert result.facts["bw_reduce_scatters"] == result.facts["gather_nodes"]
    assert result.facts["saved_gathered"] == 0
    assert_same_training(in_blocks, train_reference(blocks, world=2), blocks)
    # 2 layers: in backward every step's micro-batches, in forward the second micro-batch of each step
    # (a step's first call skips its agreement and issues nothing); test_training's count for eager
    assert (
        in_blocks.facts["prefetched_calls"]
        == in_blocks1.facts["prefetched_calls"]
        == {"forward": blocks.steps * (blocks.grad_accum - 1), "backward": blocks.steps * blocks.grad_accum}
    )


def test_a_graph_compiled_again_from_torchs_caches_still_goes_through_zcompile(tmp_path, monkeypatch):
    """A stage-1 graph in the parameters' dtype has no op of zcompile's, so AOTAutograd's cache could
    serve its second compile (a job run again on the same machine) without calling zcompile's inner
    compile: no passes, no graphs for the reports, and no record of the running statistics a
    BatchNorm changes, which then went unsynchronised across ranks, silently."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # empty: the first compile fills it
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
    )
    x = torch.randn(32, 8)
    for attempt in range(2):
        torch._dynamo.reset()
        compiled_graphs = []
        compiled = torch.compile(
            model, backend="zero", options={"stage": 1, "compiler": "inductor", "on_compile": compiled_graphs.append}
        )
        compiled(x).pow(2).mean().backward()
        (graphs,) = compiled_graphs
        assert graphs.forward is not None and graphs.backward is not None, attempt
        # primals: the BatchNorm's running mean, running variance and batch count are changed in place
        assert len(graphs.mutated_inputs) == 3, (attempt, graphs.mutated_inputs)
        model.zero_grad()
