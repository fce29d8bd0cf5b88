"""A full training loop around a zero-compiled model: evaluation inside training, an LR scheduler
and two parameter groups, at stages 1, 2 and 3 on 2 gloo ranks (one launch).

Each stage runs the same loop: ``zcompile.optim.AdamW`` over two groups (weight decay on the 2-D
weights; none, and half the learning rate, on biases and norms), a linear warmup (``LambdaLR``)
chained to a cosine decay (``CosineAnnealingLR``) by ``SequentialLR``, stepped after every optimizer
step, and every ``EVAL_EVERY`` steps the loss of a held-out batch through the compiled model under
``model.eval()`` + ``torch.no_grad()``, taken twice, before ``model.train()``. Once, a weight is
given new values in new storage (``p.data = p.data * 0.5``). The last step's batch is a sequence
shorter on the last rank (a data loader without ``drop_last``), with the batch dimension marked
dynamic on every rank from the first call; the average of the ranks' mean gradients is then what
DDP takes, and the reference's mean over its parts. Gradients are zeroed
through the model (``model.zero_grad()``, what Hugging Face Trainer and accelerate call), which at
stages 2 and 3 must clear the gradient shards (``zcompile.routes.zero_grad``). Evaluation makes
Dynamo compile other graphs (no autograd, ``training=False``) from the same sharded parameters,
and training must go on from the same shards afterwards.

The reference is the same loop in one process on the plain model with ``torch.optim.AdamW``,
splitting each global batch into the ranks' slices and averaging their gradients: the AdamW
comparison of ``support.training``, whose docstring derives the tolerances that
``assert_same_training`` (losses, final parameters) applies; eval losses get the same 1e-6
relative as training losses. Learning rates are compared exactly: the scheduler does the same
float arithmetic on either optimizer's ``param_groups``.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, SequentialLR

import zcompile
from support.launch import run_ranks
from support.models import build_model, global_batch, model_loss
from support.training import ADAM_EPS, LOSS_RTOL, RunResult, RunSpec, assert_same_training, micro_batches

STAGES = (1, 2, 3)
WORLD = 2
STEPS, EVAL_EVERY, WARMUP = 6, 2, 3
SPEC = RunSpec(model="gpt", steps=STEPS)  # lr 1e-2, 8 sequences a step: the premises of the tolerances
HELD_OUT_STEP = 10_000  # a global batch no training step uses
NO_DECAY_LR_SCALE = 0.5  # a group-specific lr: a group mixed up with the other changes the trained weights
GRAD_PROBE_STEP = 1  # gradients read and edited inside gathered(model, grads=True) before this step's update
NEW_STORAGE_STEP = 1  # a weight given new values in new storage (p.data = ...) before this step
SHORT_BATCH_STEP = STEPS - 1  # the last rank's batch is a sequence short (a last batch without drop_last)
DROPPED_GRAD = "ln_f.bias"


def _groups(model: torch.nn.Module) -> list[dict]:
    """The usual split: decay on matrices and embeddings, none on biases and LayerNorm parameters."""
    params = list(model.parameters())  # each tied weight once
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": SPEC.lr * NO_DECAY_LR_SCALE},
    ]


def _scheduler(optimizer) -> SequentialLR:
    warmup = LambdaLR(optimizer, lambda step: (step + 1) / WARMUP)
    cosine = CosineAnnealingLR(optimizer, T_max=STEPS - WARMUP)
    return SequentialLR(optimizer, [warmup, cosine], milestones=[WARMUP])


def _expected_lr(step: int, base: float) -> float:
    """The schedule in closed form: warmup to ``base`` over WARMUP steps, then half a cosine."""
    if step < WARMUP:
        return base * (step + 1) / WARMUP
    return base * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP))) / 2


def _mean_over(loss: torch.Tensor, world: int, zero: bool) -> float:
    """The global-batch mean: each rank holds its slice's mean (the reference already averaged)."""
    if zero and world > 1:
        dist.all_reduce(loss)
        return loss.item() / world
    return loss.item()


def _evaluate(run, model, parts, world: int, zero: bool) -> float:
    """The held-out loss in eval mode without gradients; back to training mode after."""
    tokens, targets = global_batch(HELD_OUT_STEP, SPEC.batch_size)
    run.eval()  # through the compiled wrapper, as a user writes it; it flips the inner module
    assert not model.training
    with torch.no_grad():
        loss = torch.zeros(())
        for part in parts:
            local = slice(part * len(tokens) // world, (part + 1) * len(tokens) // world)
            loss += model_loss(SPEC.model, run, tokens[local], targets[local]) / len(parts)
    run.train()
    assert model.training
    return _mean_over(loss, world, zero)


def _probe_and_edit_grads(model, out: dict) -> None:
    """Reads every gradient as DDP would leave it, then edits them as gradient surgery does: all
    halved, one dropped (the step must skip that parameter, as torch's AdamW does for a None grad).
    A no-op context for the reference's plain model, whose ``.grad`` already is the average."""
    with zcompile.gathered(model, grads=True):
        out["grads"] = {name: p.grad.clone() for name, p in model.named_parameters()}
        for name, p in model.named_parameters():
            if name == DROPPED_GRAD:
                p.grad = None
            else:
                p.grad.mul_(0.5)


def _give_a_weight_new_storage(model: torch.nn.Module, zero: bool) -> None:
    """``weight.data = weight.data * 0.5`` (what weight-loading and init helpers do): new values in new
    storage. At stages 1 and 2 the optimizer kept updating the master weight in the old storage and
    the step wrote it over the new values; the stage-2 graphs also kept reading the old storage.
    Both: the losses left the reference's from the next step on (2 ranks), with no word."""
    weight = next(p for p in model.parameters() if p.dim() == 2)
    with zcompile.gathered(model) if zero else contextlib.nullcontext():  # stage 3: the full weight exists inside
        weight.data = weight.data * 0.5


def _train(rank: int, world: int, stage: int | None) -> dict:
    """The loop at ``stage`` on this rank; ``stage=None``: the single-process reference, which runs
    every rank's slice itself (so its gradient is the ranks' average)."""
    torch._dynamo.reset()
    model = build_model(SPEC.model)
    zero = stage is not None
    optimizer = (zcompile.optim if zero else torch.optim).AdamW(_groups(model), lr=SPEC.lr, eps=ADAM_EPS)
    scheduler = _scheduler(optimizer)
    graphs = []  # every graph the backend compiles (on_compile)
    options = {"stage": stage, "on_compile": graphs.append}
    run = torch.compile(model, backend="zero", options=options) if zero else model
    parts = [rank] if zero else range(world)
    out = {"losses": [], "evals": [], "lrs": []}
    for step in range(STEPS):
        loss = torch.zeros(())
        for part in parts:
            ((tokens, targets),) = micro_batches(SPEC, step, part, world)
            if step == SHORT_BATCH_STEP and part == world - 1:
                tokens, targets = tokens[:-1], targets[:-1]
            # the batch dimension dynamic from the first call on every rank: the rank with the short
            # batch then runs the graph every rank compiled (a recompile on one rank alone is the rank
            # check's RankDivergenceError, whose message names this)
            torch._dynamo.mark_dynamic(tokens, 0)
            torch._dynamo.mark_dynamic(targets, 0)
            part_loss = model_loss(SPEC.model, run, tokens, targets) / len(parts)
            part_loss.backward()
            loss += part_loss.detach()
        if step == GRAD_PROBE_STEP:
            _probe_and_edit_grads(model, out)
        if step == NEW_STORAGE_STEP:
            _give_a_weight_new_storage(model, zero)
        out["lrs"].append([group["lr"] for group in optimizer.param_groups])  # what this step uses
        optimizer.step()
        run.zero_grad()  # through the model, as Trainer and accelerate do: it must clear the shards' gradients too
        scheduler.step()
        out["losses"].append(_mean_over(loss, world, zero))
        if (step + 1) % EVAL_EVERY == 0:
            out["evals"].append([_evaluate(run, model, parts, world, zero) for _ in range(2)])
    out["weight_decay"] = [group["weight_decay"] for group in optimizer.param_groups]
    out["graphs"] = [
        {
            "training": g.backward is not None,
            "inference": g.inference is not None,
            "gathers": "all_gather" in getattr(g.inference, "code", ""),
        }
        for g in graphs
    ]
    with zcompile.gathered(model):  # a no-op at stages 1 and 2 and for the reference
        out["params"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    return out


def _train_every_stage(rank: int, world: int) -> dict:
    return {stage: _train(rank, world, stage) for stage in STAGES}


@pytest.fixture(scope="module")
def runs():
    ranks = run_ranks(WORLD, _train_every_stage, timeout_s=600)
    return ranks, _train(0, WORLD, None)


@pytest.mark.parametrize("stage", STAGES)
def test_training_matches_single_process_reference(runs, stage):
    ranks, reference = runs
    result = ranks[0][stage]
    assert_same_training(
        RunResult(result["losses"], result["params"]), RunResult(reference["losses"], reference["params"]), SPEC
    )
    # every rank reports the same (all-reduced) losses and holds the same full weights
    assert ranks[1][stage]["losses"] == result["losses"]
    for name, value in result["params"].items():
        assert torch.equal(ranks[1][stage]["params"][name], value), name


@pytest.mark.parametrize("stage", STAGES)
def test_evaluation_inside_training(runs, stage):
    ranks, reference = runs
    evals = ranks[0][stage]["evals"]
    assert len(evals) == STEPS // EVAL_EVERY
    for (first, second), (ref_first, _) in zip(evals, reference["evals"], strict=True):
        assert first == second, evals  # evaluating changed nothing the next evaluation reads
        assert abs(first - ref_first) <= LOSS_RTOL * abs(ref_first), (evals, reference["evals"])
    # the model learned between evaluations, so the evaluations saw the updated weights
    assert evals[-1][0] < evals[0][0]
    # evaluation ran through an inference graph of the backend, which gathers the shards at stage 3;
    # training kept its own graph (compiled once: evaluation did not invalidate it)
    graphs = ranks[0][stage]["graphs"]
    assert [g["training"] for g in graphs].count(True) == 1, graphs
    inference = [g for g in graphs if g["inference"]]
    assert len(inference) == 1 and inference[0]["gathers"] == (stage == 3), graphs


@pytest.mark.parametrize("stage", STAGES)
def test_scheduler_and_param_groups(runs, stage):
    ranks, reference = runs
    lrs = ranks[0][stage]["lrs"]
    assert lrs == reference["lrs"]  # exact: the same arithmetic on the same param_groups
    for step, (decay_lr, no_decay_lr) in enumerate(lrs):
        assert decay_lr == pytest.approx(_expected_lr(step, SPEC.lr), rel=1e-12)
        assert no_decay_lr == pytest.approx(_expected_lr(step, SPEC.lr * NO_DECAY_LR_SCALE), rel=1e-12)
    decay = [lr for lr, _ in lrs]  # warmup rises, then the cosine falls from the peak
    assert decay[:WARMUP] == sorted(set(decay[:WARMUP])) and decay[WARMUP:] == sorted(set(decay[WARMUP:]))[::-1]
    assert ranks[0][stage]["weight_decay"] == [0.01, 0.0]


@pytest.mark.parametrize("stage", STAGES)
def test_gathered_grads_are_the_averaged_gradients(runs, stage):
    """Inside ``gathered(model, grads=True)`` each ``.grad`` is the full gradient averaged over the
    ranks, as the reference (DDP's average) holds it; every rank holds the same. The edits made
    there (halved, one dropped) are what the step applied: ``test_training_matches_single_process_reference``
    compares the weights trained after them with the reference's, which made the same edits.
    Tolerance: the averages differ only in summation order (1e-6 relative of the largest element)."""
    ranks, reference = runs
    grads = ranks[0][stage]["grads"]
    assert grads.keys() == reference["grads"].keys()
    for name, want in reference["grads"].items():
        got = grads[name]
        assert got.shape == want.shape and got.dtype == want.dtype, name
        error = ((got - want).abs().max() / want.abs().max()).item()
        assert error <= 1e-6, (name, error)
        assert torch.equal(ranks[1][stage]["grads"][name], got), name
