"""ZeRO stages 1, 2, 3 trained on gloo ranks against single-process references.

Tolerances: see ``support.training`` (``assert_same_training``).
"""

import re
from dataclasses import replace

import pytest
import torch

from support.launch import run_ranks
from support.models import build_model, global_batch
from support.training import RunSpec, assert_same_training, train_reference, train_zero, zero_run_on_rank
from zcompile import zero_formula_bytes


def reference_for(spec, world):
    return train_reference(spec, world=world, microbatch_like_ranks=spec.optimizer == "adamw")


STAGES = (1, 2, 3)
WORLD2_SPECS = (
    [RunSpec(model="gpt", stage=s) for s in STAGES]
    # SGD at stage 2: WORLD4_SPECS; at stage 1: test_features.py (world 2, frozen weights, accumulation)
    + [RunSpec(model="gpt", stage=3, optimizer="sgd", lr=0.1)]
    # transformers models: Llama at every stage (its stage 2 is the regional run's reference); GPT-2
    # (Conv1D layers, tied head) at stages 1 and 3, its stage 2 sharing stage 3's backward route and
    # stage 1's optimizer. SGD at stage 3 is the gpt's here, test_schedule.py's, test_mixed_precision.py's
    # and test_zeropp.py's (Llama there too)
    + [RunSpec(model="hf_gpt2", stage=s, lr=3e-3) for s in (1, 3)]
    + [RunSpec(model="hf_llama", stage=s, lr=3e-3) for s in STAGES]
    # sizes odd and even in one bucket: at stage 1 the step writes a padded gradient and whole ones into
    # the same reduce-scatter input (zcompile.optim.buckets), each its own way; stage 3 in WORLD4_SPECS
    + [RunSpec(model="gpt_untied_odd", stage=s) for s in (1, 2)]
    # regional compilation (zcompile.mark_repeated_blocks): one subgraph per block class
    + [RunSpec(model="gpt", stage=3, regional=True), RunSpec(model="hf_llama", stage=2, lr=3e-3, regional=True)]
    # blocks compiled one by one: one graph per layer, each call prefetching the next one's first gather
    + [RunSpec(model="gpt", stage=3, blocks=True, grad_accum=2)]
    # gloo's own reduce-scatter (the default there runs it as an all-to-all: passes/reduce_scatter_lowering.py)
    + [RunSpec(model="gpt", stage=3, options={"reduce_scatter": "native"})]
)
WORLD4_SPECS = (
    [RunSpec(model="gpt", stage=s) for s in STAGES]
    + [RunSpec(model="gpt", stage=2, optimizer="sgd", lr=0.1)]
    + [RunSpec(model="gpt_untied_odd", stage=3)]
)


@pytest.fixture(scope="module")
def world2():
    ranks = run_ranks(2, zero_run_on_rank, WORLD2_SPECS)
    return list(zip(WORLD2_SPECS, *ranks))


@pytest.fixture(scope="module")
def world4():
    ranks = run_ranks(4, zero_run_on_rank, WORLD4_SPECS)
    return list(zip(WORLD4_SPECS, *ranks))


def _label(spec):
    return (
        f"{spec.model}-stage{spec.stage}-{spec.optimizer}"
        + ("-regional" if spec.regional else "")
        + ("-blocks" if spec.blocks else "")
        + (f"-accum{spec.grad_accum}" if spec.grad_accum > 1 else "")
        + "".join(f"-{k}={v}" for k, v in spec.options.items())
    )


@pytest.mark.parametrize("index", range(len(WORLD2_SPECS)), ids=[_label(s) for s in WORLD2_SPECS])
def test_world2_matches_single_process(world2, index):
    spec, rank0, rank1 = world2[index]
    assert_same_training(rank0, reference_for(spec, 2), spec)
    for name in rank0.params:  # both ranks hold the same (gathered) model
        assert torch.equal(rank0.params[name], rank1.params[name]), name


def test_gloo_reduce_scatters_run_as_all_to_alls_unless_native(world2):
    for spec, rank0, _ in world2:
        if spec.stage == 1:
            continue
        facts = rank0.facts
        native = spec.options.get("reduce_scatter") == "native"
        assert facts["bw_reduce_scatters"] > 0, facts
        assert (facts["bw_reduce_scatter_ops"] > 0) == native and (facts["bw_all_to_all_ops"] > 0) != native, facts


@pytest.mark.parametrize("index", range(len(WORLD4_SPECS)), ids=[_label(s) for s in WORLD4_SPECS])
def test_world4_matches_single_process(world4, index):
    spec, *ranks = world4[index]
    assert_same_training(ranks[0], reference_for(spec, 4), spec)


@pytest.mark.parametrize("stage", STAGES)
def test_world1_without_process_group(stage):
    spec = RunSpec(model="gpt", stage=stage)
    assert_same_training(train_zero(spec), reference_for(spec, 1), spec)


@pytest.mark.parametrize("world_name", ["world2", "world4"])
def test_stage3_memory_is_16_psi_over_n(world_name, request):
    """Measured model-state bytes after a step (params, grads, Adam moments) vs ZeRO's 16Ψ/N."""
    runs = request.getfixturevalue(world_name)
    for spec, *ranks in runs:
        if spec.stage != 3 or spec.optimizer != "adamw":
            continue
        world = len(ranks)
        for result in ranks:
            expected = zero_formula_bytes(result.num_params, world, stage=3)
            if spec.blocks:  # the weights outside the compiled blocks train as stage 1's (README)
                blocks = sum(p.numel() for name, p in result.params.items() if name.startswith("blocks."))
                expected = zero_formula_bytes(blocks, world, stage=3) + zero_formula_bytes(
                    result.num_params - blocks, world, stage=1
                )
            # padding: each parameter is cut into N equal chunks, so a rank holds at most N-1
            # elements more than numel/N per parameter; the small GPT has 5% of its elements there at N=4
            assert expected <= result.state_bytes <= 1.05 * expected, (spec.model, result.state_bytes, expected)


def test_stage1_and_2_memory_follow_their_formulas(world2):
    """fp32 stages 1 and 2 hold ZeRO's bytes: the master shard is the replicated parameter's own slice
    (8Ψ + 8Ψ/N and 4Ψ + 12Ψ/N), not a copy of it (which held 4Ψ/N more: 1.17x and 1.20x)."""
    for spec, rank0, _ in world2:
        if spec.stage in (1, 2) and spec.optimizer == "adamw":
            expected = zero_formula_bytes(rank0.num_params, 2, spec.stage)
            assert expected <= rank0.state_bytes <= 1.05 * expected, (spec, rank0.state_bytes, expected)


def test_estimate_memory_predicts_the_measured_model_states(world2, world4):
    """zcompile.estimate_memory, made before compiling, equals the bytes measured after a step to the
    byte (params, replicas, shards, gradients, moments; padding, tied weights), at every stage and world."""
    for spec, *ranks in world2 + world4:
        # blocks compiled apart: the estimate made after their compiles, the rest estimated as stage 1 trains it
        for rank, result in enumerate(ranks):
            assert result.estimated_state_bytes == result.state_bytes, (
                spec,
                rank,
                result.estimated_state_bytes,
                result.state_bytes,
            )


def test_simulation_predicts_the_real_collectives_and_model_states(world2, world4):
    """zcompile.simulate, in this process with no ranks (fake tensors, torch's fake process group),
    compiles the same model for the same world and stage: its graphs issue the same collectives,
    kind by kind and byte for byte, as the real 2- and 4-rank runs; the optimizer's all-gathers and
    reduce-scatters move the same bytes; its model states equal rank 0's measured bytes."""
    from zcompile.predict.simulate import simulate

    for spec, *ranks in world2 + [(spec, *ranks) for spec, *ranks in world4 if spec.stage == 3]:
        if (
            spec.model != "gpt" or spec.optimizer != "adamw" or spec.blocks
        ):  # the whole model compiled, as simulate compiles it
            continue
        world, rank0 = len(ranks), ranks[0]
        tokens, targets = global_batch(0, spec.batch_size // world)
        simulated = simulate(
            lambda: build_model(spec.model),
            (tokens, targets),
            world_size=world,
            options={"stage": spec.stage, **spec.options},
            hardware="cpu-local",
        )
        for where in ("forward", "backward", "optimizer"):
            real = sorted((r.kind, r.bytes) for r in rank0.collectives if r.where == where)
            ours = sorted((c.kind, c.bytes) for c in simulated.collectives if c.where == where)
            if where == "optimizer":  # the real step buckets them: compare bytes per kind
                real, ours = _bytes_by_kind(real), _bytes_by_kind(ours)
            assert ours == real, (spec, where, ours, real)
        assert simulated.memory["model_states_bytes"] == rank0.state_bytes, spec


def _bytes_by_kind(pairs: list[tuple[str, int]]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for kind, nbytes in pairs:
        totals[kind] = totals.get(kind, 0) + nbytes
    return totals


def test_communication_volume_per_step(world2, world4):
    """Stages 1 and 2 move exactly 2Ψ (padded) elements per rank per step; stage 3 at most 3Ψ."""
    for spec, result, *_ in world2 + world4:
        if (
            spec.model.startswith("gpt")
            and spec.optimizer == "adamw"
            and "breaks" not in spec.model
            and not spec.blocks
        ):
            total = sum(r.elements for r in result.collectives)
            kinds = {r.kind for r in result.collectives}
            if spec.stage in (1, 2):
                assert total == 2 * result.padded_numel, (spec, total, result.padded_numel)
            else:
                assert 2 * result.padded_numel < total <= 3 * result.padded_numel, (spec, total)
            assert kinds == {"all_gather", "reduce_scatter"}


def test_stage3_graph_structure(world2):
    """Gathers in forward, re-gathers (not saved weights) in backward, one reduce-scatter per
    trainable parameter, and no parameter gathered twice in a graph."""
    for spec, rank0, _ in world2:
        facts = rank0.facts
        if spec.stage == 3:
            assert facts["fw_all_gathers"] == facts["gather_nodes"] > 0, facts
            assert facts["saved_gathered"] == 0, facts
            assert 0 < facts["bw_all_gathers"] <= facts["fw_all_gathers"], facts
            assert facts["bw_reduce_scatters"] == facts["gather_nodes"], facts
            assert facts["gathered_twice"] == 0, facts
        elif spec.stage == 2:
            assert facts["fw_all_gathers"] == facts["bw_all_gathers"] == 0, facts
            assert facts["bw_reduce_scatters"] > 0, facts
        else:
            assert facts["fw_all_gathers"] == facts["bw_all_gathers"] == facts["bw_reduce_scatters"] == 0, facts


def test_regional_runs_trace_each_block_class_once(world2):
    """With mark_repeated_blocks every layer calls the one subgraph of its class (forward and
    backward): the parity above is then the parity of a block traced once and reused."""
    regional = [(spec, rank0) for spec, rank0, _ in world2 if spec.regional]
    assert regional
    for spec, rank0 in regional:
        forward_code = "".join(fw for fw, _ in rank0.graphs)
        backward_code = "".join(bw for _, bw in rank0.graphs)
        # partitioned_fw_subgraph_<Dynamo's subgraph>_<AOTAutograd's variant for the call's inputs>
        calls = re.findall(r"invoke_subgraph\(partitioned_fw_subgraph_(\d+)_\d+, ", forward_code)
        assert len(calls) == 2, (spec, calls)  # both layers of the test models
        assert len(set(calls)) == 1, (spec, calls)  # one subgraph traced by Dynamo, called per layer
        assert len(re.findall(r"invoke_subgraph\(partitioned_bw_subgraph_\d+_\d+, ", backward_code)) == 2, spec
        # the same collectives as the unmarked model's run: at stage 3 the backward re-gathers the
        # blocks' weights (passes/regions.py) instead of saving them through the subgraph calls
        unmarked = next(r0 for s, r0, _ in world2 if s == replace(spec, regional=False))
        assert _elements_by_kind(rank0) == _elements_by_kind(unmarked), spec


def test_blocks_compiled_apart_take_the_gather_the_call_before_issued(world2):
    """One graph called per layer (2 here): each layer's call after the first takes the first gather
    the call before issued (zcompile.backend.call_prefetch); the parity above is with those gathers. In
    backward from the first run (it is its forward's calls in reverse); in forward from the second run
    (the first learns the order), and only where the call before was agreed: a step's first call skips
    its agreement and so issues nothing, leaving, with 2 layers, each step's second micro-batch. A
    whole model is one call per run: nothing to prefetch."""
    for spec, rank0, rank1 in world2:
        if spec.stage != 3:
            continue
        layers = 2 if spec.blocks else 1  # calls per run of a graph
        backward = spec.steps * spec.grad_accum * (layers - 1)
        forward = spec.steps * (spec.grad_accum - 1) * (layers - 1)
        assert rank0.facts["prefetched_calls"] == {"forward": forward, "backward": backward}, spec
        assert rank1.facts["prefetched_calls"] == rank0.facts["prefetched_calls"], spec
        if spec.blocks:  # the report's gathered peak counts the next layer's gather, held a call early:
            # the forward's first bucket, here a whole block's weights (each of even size: no padding)
            model = build_model(spec.model)
            block = model.blocks[0]
            assert rank0.facts["report_call_prefetch_bytes"] == 4 * sum(p.numel() for p in block.parameters()), spec
            # estimate_memory (made after the blocks' compiles) predicts it: a block's one bucket, its
            # buffer and pieces, and the next block's gather
            assert rank0.facts["estimated_gathered_peak_bytes"] == rank0.facts["report_peak_gathered_bytes"], spec
            # on gloo the prefetched gather, in flight through a whole call, is held twice (gloo's flat
            # copy): a part of gloo's copies (a block's one-bucket graph adds none of its own)
            assert rank0.facts["report_gather_staging_bytes"] == rank0.facts["report_call_prefetch_bytes"], spec
            # the schedule's line counts each graph's first gather as issued by the call before, not exposed
            assert rank0.facts["report_issued_by_call_before"] == [
                ("forward", "all_gather"),
                ("backward", "all_gather"),
            ]
            assert any(
                "2 issued by the call before (cross-call prefetch" in line for line in rank0.facts["report_summary"]
            )
            # a step's volume counts the block graph once per layer and micro-batch: each gathers the
            # block's weights in forward and reduce-scatters their gradients (the backward re-gathers
            # those it needs); the eager rest moves at the step, as stage 1's (even sizes: no padding)
            in_blocks = sum(p.numel() for b in model.blocks for p in b.parameters())
            rest = sum(p.numel() for p in model.parameters()) - in_blocks
            elements = rank0.facts["report_elements"]
            assert elements["forward all_gather"] == elements["backward reduce_scatter"] == in_blocks * spec.grad_accum
            assert 0.9 * in_blocks * spec.grad_accum < elements["backward all_gather"] <= in_blocks * spec.grad_accum
            assert elements["optimizer all_gather"] == elements["optimizer reduce_scatter"] == rest, elements
    assert any(spec.blocks for spec, _, _ in world2)


def _elements_by_kind(result) -> dict:
    totals: dict = {}
    for c in result.collectives:
        totals[(c.where, c.kind)] = totals.get((c.where, c.kind), 0) + c.elements
    return totals
