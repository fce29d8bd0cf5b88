"""Option ``memory_limit_mb`` on 2 gloo ranks: the backend plans at its first compile, and under a
ladder of limits the allocator's measured peak per rank stays within the limit, the graphs compile
with the plan's options and the losses are one process's; a limit nothing fits is a ``PlanError``
on every rank before any step."""

from __future__ import annotations

import os
import sys
import tempfile
import time

import pytest
import torch

from support.launch import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

MIB = 2**20
CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128)
GLOBAL_BATCH = 8
STEPS = 3
# MiB per rank: everything fits (stage 1); stage 1 does not (its optimizer step holds the full
# gradients and its buckets); half the activations must be recomputed
LIMITS = (200.0, 9.5, 7.5)
FIXED = {"bucket_mb": 64, "prefetch": 1, "keep_gathered_mb": 0}  # 9 candidates: stage x activation budget


def _train(rank: int, world: int, options: dict) -> tuple[list[float], int, dict, dict]:
    """Losses of STEPS steps, the measured per-rank peak of one more (the allocator's, through
    torch.profiler: the bytes alive before each phase plus the phase's peak above them), and the
    options the backend compiled with."""
    import zcompile

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    optimizer = zcompile.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend="zero", options=options)
    n = GLOBAL_BATCH // world

    def batch(step):
        tokens, targets = synthetic_batch(step, GLOBAL_BATCH, CONFIG)
        return tokens[rank * n : (rank + 1) * n], targets[rank * n : (rank + 1) * n]

    losses = []
    for step in range(STEPS):
        loss = compiled(*batch(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    peak = _measured_peak(model, optimizer, lambda: compiled(*batch(STEPS)).backward(), rank)
    plan = model.__dict__.get("_zcompile_memory_plan")
    if plan is not None:  # the report says the plan
        report = zcompile.step_report(model, optimizer)
        assert report.planned_peak_bytes == plan.chosen.peak_bytes and "memory plan: " in report.render()
    return losses, peak, dict(plan.options), _compiled_with(model)


def _compiled_with(model) -> dict:
    """The planned options the backend compiled the model's graphs with (its CompiledGraphs' config)."""
    from zcompile.backend.compiled import compiled_graphs_of

    configs = {
        (g.context.config.stage, g.context.config.activation_memory_budget, g.context.config.bucket_mb)
        for g in compiled_graphs_of(model)
    }
    assert len(configs) == 1, configs
    stage, budget, bucket = configs.pop()
    return {"stage": stage, "activation_memory_budget": budget, "bucket_mb": bucket}


def _measured_peak(model, optimizer, forward_backward, rank: int) -> int:
    """The allocator's peak per rank over one more step, through torch.profiler: the bytes alive
    before each phase (forward and backward, then the optimizer's step) plus the phase's peak above them."""
    import zcompile
    from zcompile.timeline import record_step

    with tempfile.TemporaryDirectory() as trace_dir:
        before = zcompile.model_state_bytes(model, optimizer).total
        backward = record_step(forward_backward, trace_dir, rank)
        middle = zcompile.model_state_bytes(model, optimizer).total
        stepped = record_step(lambda: (optimizer.step(), optimizer.zero_grad()), trace_dir, rank)
    return max(before + backward.peak_bytes, middle + stepped.peak_bytes)


def _ladder_on_rank(rank: int, world: int) -> list:
    out = []
    for limit in LIMITS:
        losses, peak, chosen, compiled = _train(rank, world, {**FIXED, "memory_limit_mb": limit})
        out.append((limit, losses, peak, chosen, compiled))
    return out


def _reference_losses() -> list[float]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        loss = model(*synthetic_batch(step, GLOBAL_BATCH, CONFIG))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_the_planned_options_fit_the_limit_measured_and_train_like_one_process():
    reference = _reference_losses()
    ranks = run_ranks(2, _ladder_on_rank, timeout_s=600)
    chosen_stages = []
    for (limit, losses, peak, chosen, compiled), other in zip(ranks[0], ranks[1]):
        for rank_peak in (peak, other[2]):
            assert rank_peak <= limit * MIB, (limit, rank_peak / MIB, chosen)
        assert compiled == {k: chosen[k] for k in compiled}, (limit, chosen)  # the plan's options compiled
        mean = [(a + b) / 2 for a, b in zip(losses, other[1])]  # each rank's loss is its half's mean
        assert mean == pytest.approx(reference, rel=1e-5), (limit, chosen)
        chosen_stages.append((chosen["stage"], chosen.get("activation_memory_budget")))
    assert [r[3] for r in ranks[1]] == [r[3] for r in ranks[0]]  # the same plan on every rank
    assert len(set(chosen_stages)) == len(LIMITS), chosen_stages  # each limit asked for another plan


def _llama() -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


LLAMA_IDS = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
LLAMA_LIMIT_MB = 2.3  # below what stage 1 without recompute is predicted to need (2.44 MiB)


def _llama_on_rank(rank: int, world: int, options: dict) -> tuple[list[float], int, dict, dict]:
    """A transformers Llama (its own forward, a dict of outputs): losses, measured peak, options."""
    import zcompile

    torch._dynamo.reset()
    model = _llama()
    optimizer = zcompile.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend="zero", options=options)
    ids = LLAMA_IDS[rank * 2 : (rank + 1) * 2]
    losses = _llama_losses(compiled, optimizer, ids)
    plan = model.__dict__.get("_zcompile_memory_plan")
    peak = _measured_peak(model, optimizer, lambda: compiled(input_ids=ids, labels=ids).loss.backward(), rank)
    return losses, peak, dict(plan.options), _compiled_with(model)


def _llama_losses(model, optimizer, ids: torch.Tensor) -> list[float]:
    """STEPS steps of ``model`` (compiled or not) on ``ids``, its own labels."""
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _llama_pair_on_rank(rank: int, world: int) -> tuple:
    return _llama_on_rank(rank, world, {**FIXED, "memory_limit_mb": LLAMA_LIMIT_MB})


def test_a_transformers_llama_is_planned_within_the_limit():
    model = _llama()  # the reference: one process, the whole batch, torch's AdamW
    reference = _llama_losses(model, torch.optim.AdamW(model.parameters(), lr=1e-3), LLAMA_IDS)
    ranks = run_ranks(2, _llama_pair_on_rank, timeout_s=600)
    for losses, peak, chosen, compiled in ranks:
        assert peak <= LLAMA_LIMIT_MB * MIB, (peak / MIB, chosen)
        assert (chosen["stage"], chosen["activation_memory_budget"]) != (1, None), chosen  # the limit bit
        assert compiled == {k: chosen[k] for k in compiled}, chosen
    mean = [(a + b) / 2 for a, b in zip(ranks[0][0], ranks[1][0])]  # each rank's loss is its half's mean
    assert mean == pytest.approx(reference, rel=1e-5)


def _nothing_fits_on_rank(rank: int, world: int) -> tuple[str, float, bool]:
    import zcompile

    torch.manual_seed(0)
    model = GPT(CONFIG)
    compiled = torch.compile(model, backend="zero", options={"memory_limit_mb": 1.0})
    started = time.perf_counter()
    tokens, targets = synthetic_batch(0, GLOBAL_BATCH, CONFIG)
    try:
        compiled(tokens[:4], targets[:4])
    except Exception as error:  # noqa: BLE001 - Dynamo wraps the backend's error; its text is the point
        return str(error), time.perf_counter() - started, isinstance(error, zcompile.PlanError)
    return "", time.perf_counter() - started, False


def test_a_limit_nothing_fits_is_refused_on_every_rank_before_a_step():
    for message, seconds, _ in run_ranks(2, _nothing_fits_on_rank, timeout_s=300):
        assert "nothing fits memory_limit_mb=1 MiB per rank at 2 ranks" in message, message
        assert "the model states alone are over it" in message and "To fit: more ranks" in message, message
        assert seconds < 120, seconds


def test_a_graph_the_plan_did_not_see_says_so(caplog):
    """A model with a graph break, one process: the first graph is planned, the next takes its options
    and warns that its activations were not in the plan."""
    import logging

    from support.models import build_model, global_batch, model_loss

    torch._dynamo.reset()
    model = build_model("gpt_breaks")
    compiled = torch.compile(model, backend="zero", options={"memory_limit_mb": 100, **FIXED})
    with caplog.at_level(logging.WARNING, logger="zcompile.tune.memory_limit"):
        model_loss("gpt_breaks", compiled, *global_batch(0, 4)).backward()
    warned = [r.getMessage() for r in caplog.records if "memory_limit_mb was planned from" in r.getMessage()]
    assert len(warned) == 1 and "were not in the plan" in warned[0], warned


def _limit_on_rank_0_only(rank: int, world: int) -> str:
    torch._dynamo.reset()
    torch.manual_seed(0)
    options = dict(FIXED, **({"memory_limit_mb": 9.5} if rank == 0 else {}))
    compiled = torch.compile(GPT(CONFIG), backend="zero", options=options)
    tokens, targets = synthetic_batch(0, GLOBAL_BATCH, CONFIG)
    try:
        compiled(tokens[rank * 4 : (rank + 1) * 4], targets[rank * 4 : (rank + 1) * 4])
    except Exception as error:  # noqa: BLE001 - Dynamo wraps the backend's error; its text is the point
        return str(error)
    return ""


def test_a_limit_on_some_ranks_only_is_named_on_every_rank():
    """One rank plans, the other compiles its own options: the compile check names memory_limit_mb on
    both (the planned stage differs from the default too, but the option is the cause)."""
    for message in run_ranks(2, _limit_on_rank_0_only, timeout_s=300):
        assert "setting 'memory_limit_mb': rank" in message and "null" in message, message
