"""``zcompile.plan`` against an exhaustive search: the example GPT on 8 simulated ranks (no processes),
every combination of stage and activation budget simulated by ``simulate_tune``; under a ladder of
limits the plan picks the fastest combination that fits, drops only combinations that do not fit,
and refuses a limit below the smallest peak naming it and what would fit."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch

import zcompile
from support.models import small_llama_config
from zcompile.tune.plan import PREDICTION_HEADROOM
from zcompile.tune.plan_report import mib
from zcompile.tune.plan_space import NOT_SIMULATED

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

MIB = 2**20
WORLD = 8
CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128)
FIXED = {"bucket_mb": 4, "prefetch": 1, "keep_gathered_mb": 0}  # leaves stage x activation budget: 9 candidates
SPACE = {"stage": [1, 2, 3], "activation_memory_budget": [None, 0.5, 0.0]}
SETTINGS = {"world_size": WORLD, "node_size": WORLD, "hardware": "cpu-local"}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(CONFIG)


BATCH = synthetic_batch(0, 4, CONFIG)


@pytest.fixture(scope="module")
def exhaustive():
    """Every combination simulated; by options: (step peak, step s)."""
    result = zcompile.simulate_tune(make_model, BATCH, space=SPACE, base_options=FIXED, **SETTINGS)
    table = {}
    for point in result.points:
        assert point.status == "predicted", point.error
        key = (point.options["stage"], point.options["activation_memory_budget"])
        table[key] = (point.memory_bytes, point.step_s)
    return table


@pytest.fixture(scope="module")
def simulations():
    return {}  # the plans' shared cache: each combination simulated once over the ladder


def _plan(limit_bytes: int, simulations: dict):
    return zcompile.plan(
        make_model,
        BATCH,
        memory_limit_mb=limit_bytes / MIB,
        options=FIXED,
        simulated=simulations,
        max_simulations=9,
        **SETTINGS,
    )


def test_the_plan_is_the_fastest_that_fits_on_a_ladder_of_limits(exhaustive, simulations):
    peaks = sorted({peak for peak, _ in exhaustive.values()})
    assert peaks[-1] > 1.2 * peaks[0], peaks  # the knobs matter for this model, or the ladder tests nothing
    ladder = [int(p * (1 + PREDICTION_HEADROOM)) + 1 for p in (peaks[-1], peaks[len(peaks) // 2], peaks[1], peaks[0])]
    chosen = []
    for limit in ladder:
        plan = _plan(limit, simulations)
        fitting = {key: step for key, (peak, step) in exhaustive.items() if peak * (1 + PREDICTION_HEADROOM) <= limit}
        assert plan.chosen.step_s == pytest.approx(min(fitting.values()), rel=1e-9)
        assert plan.chosen.peak_bytes * (1 + PREDICTION_HEADROOM) <= limit
        key = (plan.options["stage"], plan.options["activation_memory_budget"])
        assert key in fitting and plan.options["bucket_mb"] == 4  # the user's options kept
        for candidate in plan.candidates:  # nothing that fits was dropped unsimulated
            if candidate.status == "pruned":
                peak, _ = exhaustive[(candidate.options["stage"], candidate.options["activation_memory_budget"])]
                assert peak * (1 + PREDICTION_HEADROOM) > limit and candidate.floor_bytes <= peak
        chosen.append(plan.chosen.step_s)
    assert chosen == sorted(chosen)  # a tighter limit never plans a faster step


def test_nothing_fits_names_the_smallest_peak_and_the_fix(exhaustive, simulations):
    smallest = min(peak for peak, _ in exhaustive.values())
    with pytest.raises(zcompile.PlanError, match="nothing fits") as raised:
        _plan(smallest, simulations)  # the smallest peak, without the headroom
    message = str(raised.value)
    # the smallest simulated, or a floor below it of a candidate dropped unsimulated ("at least")
    quoted = re.search(r"the smallest predicted peak is (at least )?([0-9.,]+) MiB", message)
    assert quoted is not None, message
    assert float(quoted.group(2).replace(",", "")) <= float(mib(smallest).replace(",", "")), message
    assert "To fit:" in message and "ranks" in message


def test_a_small_simulation_budget_still_finds_a_plan_that_fits(exhaustive):
    """One simulation allowed, a limit only the leanest combination meets: the first candidate tried
    (no recompute, stage 1) is over it, so the plan goes on, least memory first, to the one that fits."""
    smallest = min(peak for peak, _ in exhaustive.values())
    limit = smallest * (1 + PREDICTION_HEADROOM) / MIB + 0.001
    plan = zcompile.plan(make_model, BATCH, memory_limit_mb=limit, options=FIXED, max_simulations=1, **SETTINGS)
    assert exhaustive[(plan.options["stage"], plan.options["activation_memory_budget"])][0] == smallest
    assert sum(c.status == NOT_SIMULATED for c in plan.candidates) >= 1
    assert json.loads(plan.to_json())["options"]["stage"] == plan.options["stage"]


def test_the_command_line_plans_a_transformers_spec(tmp_path, capsys):
    from zcompile.cli.commands import main

    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 256,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
            }
        )
    )
    out = tmp_path / "plan.json"
    args = ["plan", str(spec), "--world", "4", "--seq", "16", "--hardware", "cpu-local", "--plain"]
    assert main([*args, "--limit", "64MiB", "--max-simulations", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert "options=" in printed and saved["memory_limit_bytes"] == 64 * MIB
    chosen = [c for c in saved["candidates"] if c["status"] == "chosen"]
    assert len(chosen) == 1 and chosen[0]["peak_bytes"] <= 64 * MIB
    assert main([*args, "--limit", "1KiB", "--max-simulations", "1"]) == 2
    assert "nothing fits" in capsys.readouterr().err


def test_the_tensor_parallel_degree_is_planned_against_each_degree_simulated():
    """A transformers Llama at 8 ranks, its tp plan declared: the degrees 1 and 2 planned with the
    other knobs fixed. Each degree's peak and step come from ``simulate(tensor_parallel=tp)`` itself;
    a limit only tp 2 meets plans tp 2 with its figures, a limit both meet plans the faster per GPU
    (the step times the degree: a tp group's ranks share one batch)."""
    transformers = pytest.importorskip("transformers")
    config = small_llama_config(intermediate_size=256, max_position_embeddings=256)
    ids = torch.zeros(4, 256, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}
    fixed = {"stage": 3, "bucket_mb": 4, "prefetch": 1, "keep_gathered_mb": 0, "activation_memory_budget": None}
    settings = {"world_size": 8, "node_size": 8, "hardware": "h100-sxm"}

    def make_llama():
        return transformers.LlamaForCausalLM(config)

    simulated = {
        tp: zcompile.simulate(make_llama, batch, options=fixed, tensor_parallel=tp, **settings) for tp in (1, 2)
    }
    peaks = {tp: r.step_peak_bytes for tp, r in simulated.items()}
    assert peaks[2] < peaks[1] / 1.2, peaks  # the split activations matter here, or this tests nothing
    cache: dict = {}

    def plan_within(peak: int):
        limit = int(peak * (1 + PREDICTION_HEADROOM)) + 1
        return zcompile.plan(
            make_llama,
            batch,
            memory_limit_mb=limit / MIB,
            options=fixed,
            tensor_parallel=(1, 2),
            simulated=cache,
            **settings,
        )

    plan = plan_within(peaks[2])
    assert plan.tensor_parallel == 2 and "tensor_parallel" not in plan.options
    assert plan.chosen.peak_bytes == peaks[2] and plan.chosen.step_s == pytest.approx(simulated[2].step_s, rel=1e-9)
    plan = plan_within(peaks[1])
    faster = min((1, 2), key=lambda tp: simulated[tp].step_s * tp)  # a tp group shares its batch: per GPU
    assert plan.tensor_parallel == faster and plan.chosen.peak_bytes == peaks[faster]
    assert "tensor_parallel=" in plan.summary()
    with pytest.raises(ValueError, match="tensor_parallel must be"):
        zcompile.plan(make_llama, batch, options=fixed, tensor_parallel=3, **settings)
