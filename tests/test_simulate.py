"""``zcompile.simulate`` at a world this machine does not have (64 ranks, one process) against ZeRO's
formulas; its agreement with real 2- and 4-rank runs is in test_training."""

import pytest
import torch

import zcompile
from support.models import build_model, global_batch
from zcompile.simulate import simulate

WORLD = 64


def _padded_bytes(model: torch.nn.Module, world: int) -> int:
    return sum(-(-p.numel() // world) * world * 4 for p in dict.fromkeys(model.parameters()))


@pytest.fixture(scope="module")
def stage3():
    tokens, targets = global_batch(0, 2)
    return simulate(lambda: build_model("gpt"), (tokens, targets), world_size=WORLD, options={"stage": 3})


def test_stage3_at_64_ranks_moves_zeros_volume(stage3):
    """Forward gathers every parameter once (Ψ, padded, fp32); backward reduce-scatters every
    gradient once (Ψ) and re-gathers at most Ψ: 2Ψ < step <= 3Ψ, as ZeRO-3's formula says."""
    padded = _padded_bytes(build_model("gpt"), WORLD)
    kinds = {c.kind for c in stage3.collectives}
    assert kinds == {"all_gather", "reduce_scatter"}
    assert stage3.bytes_by("forward") == padded
    assert sum(c.bytes for c in stage3.collectives if c.kind == "reduce_scatter") == padded
    assert 2 * padded < stage3.bytes_by() <= 3 * padded
    assert stage3.bytes_by(inside_node=True) == 0  # 64 ranks span 8 nodes of 8


def test_stage3_at_64_ranks_holds_16_psi_over_n(stage3):
    formula = zcompile.zero_formula_bytes(stage3.num_params, WORLD, 3)
    # each of the 28 parameters is padded to a multiple of 64: at most 63 elements x 16 bytes each
    assert formula <= stage3.memory["model_states_bytes"] <= formula + 28 * 63 * 16
    assert 0 < stage3.memory["peak_gathered_bytes"] <= 2 * _padded_bytes(build_model("gpt"), WORLD)
    assert stage3.memory["saved_activation_bytes"] > 0


def test_prediction_has_time_and_mfu(stage3):
    assert 0 < stage3.compute_s <= stage3.step_s
    assert 0 <= stage3.exposed_comm_s < stage3.step_s
    assert 0 < stage3.mfu < 1
    assert stage3.tokens_per_rank == 2 * 16


def test_stage2_optimizer_gathers_the_parameters_in_bf16():
    tokens, targets = global_batch(0, 2)
    result = simulate(lambda: build_model("gpt"), (tokens, targets), world_size=WORLD,
                      options={"stage": 2, "param_dtype": "bf16"}, hardware="a100-80gb")
    padded = _padded_bytes(build_model("gpt"), WORLD)
    assert result.bytes_by("optimizer") == padded // 2  # bf16 all-gather of the replicas
    assert result.bytes_by("backward") == padded // 2  # bf16 reduce-scatter of the gradients
    formula = zcompile.zero_formula_bytes(result.num_params, WORLD, 2, torch.bfloat16)
    assert formula <= result.memory["model_states_bytes"] <= 1.05 * formula


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        simulate(lambda: build_model("gpt"), global_batch(0, 2), world_size=0)
    with pytest.raises(ValueError, match="no hardware profile named 'h900'"):
        simulate(lambda: build_model("gpt"), global_batch(0, 2), world_size=8, hardware="h900")


def test_command_line_simulates_a_transformers_spec(tmp_path, capsys):
    """`zcompile simulate SPEC.json`: a tiny Llama from a config dict; a spec without model_type and a
    bad option are errors (exit 2) with the reason, not tracebacks."""
    import json

    from zcompile.cli import main

    spec = tmp_path / "llama.json"
    spec.write_text(json.dumps({"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}))
    out_json = tmp_path / "sim.json"
    assert main(["simulate", str(spec), "--world", "16", "--seq", "32", "--plain", "--option", "stage=3",
                 "--option", "param_dtype=bf16", "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "16 ranks (8 per node)" in printed and "MFU" in printed
    saved = json.loads(out_json.read_text())
    assert saved["world_size"] == 16 and saved["per_rank_bytes"] > 0
    spec.write_text(json.dumps({"hidden_size": 64}))
    assert main(["simulate", str(spec), "--world", "16"]) == 2
    assert "needs a model_type" in capsys.readouterr().err
    spec.write_text(json.dumps({"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}))
    assert main(["simulate", str(spec), "--world", "16", "--option", "stage=5"]) == 2
    assert "stage" in capsys.readouterr().err
