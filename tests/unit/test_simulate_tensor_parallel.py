"""``zcompile.simulate(..., tensor_parallel=tp)``: the model split over the tp dim of a fake ``(dp, tp)``
mesh, its pieces sharded over dp. Against ZeRO's formula over dp on the pieces, the mesh's groups (tp
inside a node, dp across), and per-layer gathers; the real 4-rank runs are in test_tensor_parallel."""

import re

import pytest
import torch

import zcompile
from support.models import GPT, GPTConfig  # examples/gpt.py, on the path support.models puts it
from zcompile.predict.hardware import load_profile

WORLD, NODE, TP = 16, 8, 2
# split over tp: q, k, v and the MLP's first layer column-wise (weights and biases), the output layers'
# weights row-wise; the rest (embeddings, norms, the row-parallel biases) is replicated
SPLIT = re.compile(r"attn\.(q|k|v)\.|attn\.proj\.weight|mlp\.0\.|mlp\.2\.weight")


def _config(layers: int) -> GPTConfig:
    return GPTConfig(vocab_size=256, block_size=16, n_layer=layers, n_head=4, n_embd=64, fused_qkv=False)


def _simulate(layers: int, tensor_parallel: int = TP):
    from gpt import parallelize

    batch = torch.randint(0, 256, (2, 16))
    return zcompile.simulate(
        lambda: GPT(_config(layers)),
        (batch, batch),
        world_size=WORLD,
        node_size=NODE,
        options={"stage": 3, "bucket_mb": 0.01},  # a bucket per weight: gathers where the weights are read
        tensor_parallel=tensor_parallel,
        parallelize=parallelize,
        hardware="h100-sxm",
    )


@pytest.fixture(scope="module")
def runs():
    return {layers: _simulate(layers) for layers in (2, 4)}


def _piece_elements(layers: int) -> int:
    model = GPT(_config(layers))
    return sum(p.numel() // (TP if SPLIT.search(name) else 1) for name, p in model.named_parameters())


def test_model_states_are_zeros_formula_over_dp_on_the_pieces(runs):
    for layers, result in runs.items():
        formula = zcompile.zero_formula_bytes(_piece_elements(layers), WORLD // TP, 3)
        parameters = len(list(GPT(_config(layers)).parameters()))
        assert formula <= result.memory["model_states_bytes"] <= formula + parameters * (WORLD // TP) * 16


def test_the_weights_are_gathered_layer_by_layer_not_all_at_the_start(runs):
    """Twice the layers, the same gathered peak: each layer's pieces are gathered where it runs (the
    graph reads each DTensor weight where the layer first reads it), below the whole model's pieces."""
    two, four = runs[2].memory["peak_gathered_bytes"], runs[4].memory["peak_gathered_bytes"]
    assert two == four
    assert four < 4 * _piece_elements(4) / 2  # fp32; half of every piece at most


def test_tp_collectives_stay_in_the_node_and_dp_gathers_cross_it(runs):
    result = runs[2]
    tp = [c for c in result.collectives if c.kind == "all_reduce"]
    assert tp and {(c.group_size, c.inside_node) for c in tp} == {(TP, True)}  # the row-parallel layers' sums
    assert {(c.where, c.group_size, c.inside_node) for c in tp} == {("forward", TP, True), ("backward", TP, True)}
    dp = [c for c in result.collectives if c.kind in ("all_gather", "reduce_scatter")]
    assert dp and {(c.group_size, c.inside_node) for c in dp} == {(WORLD // TP, False)}  # ranks 0, 2, ... 14


def test_mfu_counts_each_tp_groups_tokens_once(runs):
    result = runs[2]
    peak = load_profile("h100-sxm").compute_costs(torch.float32).flops_per_s
    assert result.tensor_parallel == TP
    work = 6 * result.num_params * result.tokens_per_rank / TP
    assert result.mfu == pytest.approx(work / result.step_s / peak, rel=1e-9)


def test_bad_tensor_parallel_arguments_are_named():
    batch = torch.randint(0, 256, (2, 16))
    with pytest.raises(ValueError, match="tensor_parallel=3 does not divide world_size=16"):
        zcompile.simulate(lambda: GPT(_config(2)), (batch, batch), world_size=16, tensor_parallel=3)
    with pytest.raises(ValueError, match="not the option 'mesh'"):
        zcompile.simulate(
            lambda: GPT(_config(2)), (batch, batch), world_size=16, tensor_parallel=2, options={"mesh": object()}
        )


# the same simulation in a fresh process, to compare with one made after this module's others
_HYBRID = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch, zcompile
from gpt import GPT, GPTConfig, parallelize
config = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=64, fused_qkv=False)
batch = torch.randint(0, 256, (2, 16))
result = zcompile.simulate(lambda: GPT(config), (batch, batch), world_size=16, node_size=8,
                           options={"stage": 3, "shard_size": 4}, tensor_parallel=2, parallelize=parallelize,
                           hardware="h100-sxm")
groups = sorted({(c.kind, c.group_size, c.inside_node) for c in result.collectives})
print(json.dumps({"states": result.memory["model_states_bytes"], "groups": groups, "step_s": result.step_s}))
"""


def _hybrid_in_this_process() -> dict:
    from gpt import parallelize

    batch = torch.randint(0, 256, (2, 16))
    result = zcompile.simulate(
        lambda: GPT(_config(2)),
        (batch, batch),
        world_size=WORLD,
        node_size=NODE,
        options={"stage": 3, "shard_size": 4},
        tensor_parallel=TP,
        parallelize=parallelize,
        hardware="h100-sxm",
    )
    groups = sorted({(c.kind, c.group_size, c.inside_node) for c in result.collectives})
    return {"states": result.memory["model_states_bytes"], "groups": [list(g) for g in groups], "step_s": result.step_s}


def test_hybrid_sharding_on_top_shards_over_the_shard_group_and_all_reduces_across_replicas(runs):
    """Option shard_size 4 with tensor_parallel 2 at 16 ranks: the 3-D mesh (2, 4, 2); the pieces'
    states are ZeRO's formula over 4, gathers and reduce-scatters stay in the shard group (8 consecutive
    ranks: one node), the reduced shards cross the nodes in an all-reduce of the 2 replicas. Made after
    this module's 2-D simulations (``runs``), it equals the same simulation in a fresh process: torch's
    DTensor caches, which hold the earlier worlds' meshes, are emptied between simulations."""
    import json
    import os
    import subprocess
    import sys

    result = _hybrid_in_this_process()
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
    done = subprocess.run(
        [sys.executable, "-c", _HYBRID, examples], capture_output=True, text=True, timeout=300, cwd="/"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == result
    formula = zcompile.zero_formula_bytes(_piece_elements(2), 4, 3)
    parameters = len(list(GPT(_config(2)).parameters()))
    assert formula <= result["states"] <= formula + parameters * 4 * 16
    groups = {tuple(g) for g in result["groups"]}
    assert {("all_gather", 4, True), ("reduce_scatter", 4, True)} <= groups
    assert ("all_reduce", 2, False) in groups  # across the replicas
    assert ("all_reduce", TP, True) in groups  # the row-parallel layers' sums
    assert not {g for g in groups if g[0] in ("all_gather", "reduce_scatter") and g[1] != 4}
