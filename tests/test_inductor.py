"""The inductor inner compiler: generated kernels around the same collectives, same training.

Inductor fuses and reorders elementwise work, which changes roundings at the 1e-7 level only;
the SGD tolerances of test_training apply unchanged.
"""

from support.launch import run_ranks
from support.training import RunSpec, assert_same_training, train_reference, zero_run_on_rank


def test_stage3_inductor_matches_single_process():
    spec = RunSpec(model="gpt", stage=3, optimizer="sgd", lr=0.1, options={"compiler": "inductor"})
    keep = RunSpec(model="gpt", stage=3, optimizer="sgd", lr=0.1,
                   options={"compiler": "inductor", "keep_gathered_mb": 100})
    result, kept = run_ranks(2, zero_run_on_rank, [spec, keep], timeout_s=900)[0]
    assert_same_training(result, train_reference(spec, world=2), spec)
    # keep-gathered reaches inductor's partitioner through its joint-graph hook: nothing re-gathered
    assert_same_training(kept, train_reference(keep, world=2), keep)
    assert kept.facts["kept_params"] > 0 and kept.facts["bw_all_gathers"] == 0
    assert result.facts["bw_all_gathers"] > 0
    # the generated code still gathers every parameter and reduce-scatters every gradient
    assert result.facts["fw_all_gathers"] == result.facts["gather_nodes"] > 0
    assert result.facts["bw_reduce_scatters"] == result.facts["gather_nodes"]
    assert result.facts["saved_gathered"] == 0
