"""``zcompile.lerp_weights_``: a momentum teacher (BYOL, DINO, MoCo) and an EMA of the weights, updated
on each rank's pieces, against one process running the same loop on the global batch with
``torch.lerp_`` over the full weights (``torch.optim.AdamW``).

The student is trained on 2 gloo ranks at stages 2 and 3 (one launch); its teacher is compiled with
it and frozen, and follows it by ``lerp_weights_`` after every step; an EMA copy made before the
compile is never called in training (at stage 3 the first update shards it as the student is) and is
compiled for one evaluation at the end, which must take the averaged shards. At stage 2 with
``param_dtype`` (the student's fp32 weights only as master shards) the teacher and the EMA copy are
compared with copies updated inside ``gathered``. The loss is a mean over rows, so the ranks' averaged losses and
gradients are one process's on the global batch; weights are compared to 1e-6 (fp32, summation order).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zcompile
from support.launch import run_ranks
from zcompile.agreement.abort_note import RankDivergenceError
from zcompile.sharding.shards import shard_of

STEPS, ROWS, MOMENTUM, EMA_WEIGHT = 4, 8, 0.2, 0.5
ATOL = 1e-6


def _models() -> tuple[nn.Module, nn.Module, nn.Module]:
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8))
    teacher = copy.deepcopy(student).requires_grad_(False)
    return student, teacher, nn.Linear(8, 8)


def _views(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 + step)
    x = torch.randn(ROWS, 16, generator=generator)
    return x + 0.1 * torch.randn(x.shape, generator=generator), x + 0.1 * torch.randn(x.shape, generator=generator)


def _byol_loss(online, predictor, teacher, a, b) -> torch.Tensor:
    with torch.no_grad():
        target_a, target_b = teacher(a), teacher(b)
    return (
        4
        - 2 * F.cosine_similarity(predictor(online(a)), target_b).mean()
        - 2 * F.cosine_similarity(predictor(online(b)), target_a).mean()
    )


def _reference() -> dict:
    student, teacher, predictor = _models()
    ema = copy.deepcopy(student).requires_grad_(False)
    optimizer = torch.optim.AdamW([*student.parameters(), *predictor.parameters()], lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = _byol_loss(student, predictor, teacher, *_views(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for t, s in zip(teacher.parameters(), student.parameters()):
                t.lerp_(s, MOMENTUM)
            for e, s in zip(ema.parameters(), student.parameters()):
                e.lerp_(s, EMA_WEIGHT)
        losses.append(loss.item())
    with torch.no_grad():
        evaluation = ema(_views(0)[0])
    return {
        "losses": losses,
        "teacher": [p.clone() for p in teacher.parameters()],
        "ema": [p.clone() for p in ema.parameters()],
        "evaluation": evaluation,
    }


def _train_on_rank(rank: int, world: int, stages: list[int]) -> dict:
    results = {}
    for stage in stages:
        torch._dynamo.reset()
        student, teacher, predictor = _models()
        ema = copy.deepcopy(student).requires_grad_(False)
        options = {"stage": stage}
        online, target, head = (
            torch.compile(m, backend="zero", options=options) for m in (student, teacher, predictor)
        )
        optimizer = zcompile.optim.AdamW([*student.parameters(), *predictor.parameters()], lr=1e-2)
        losses = []
        for step in range(STEPS):
            a, b = (view.chunk(world)[rank] for view in _views(step))
            loss = _byol_loss(online, head, target, a, b)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            zcompile.lerp_weights_(teacher, student, MOMENTUM)
            zcompile.lerp_weights_(ema, student, EMA_WEIGHT)
            reduced = loss.detach().clone()
            torch.distributed.all_reduce(reduced)
            losses.append(reduced.item() / world)
        ema_sharded = [getattr(shard_of(p), "stage", None) for p in ema.parameters()]  # before its compile
        with torch.no_grad():  # the EMA copy's first compile, on every rank's full batch
            evaluation = torch.compile(ema, backend="zero", options=options)(_views(0)[0])
        with zcompile.gathered(teacher), zcompile.gathered(ema):
            results[stage] = {
                "losses": losses,
                "teacher": [p.detach().clone() for p in teacher.parameters()],
                "ema": [p.detach().clone() for p in ema.parameters()],
                "evaluation": evaluation,
                "ema_sharded": ema_sharded,
            }
        try:  # ranks that disagree on the weight: an error on each, no update
            zcompile.lerp_weights_(teacher, student, 0.1 if rank == 0 else 0.2, timeout_s=20)
        except RankDivergenceError as error:
            results[stage]["disagreement"] = str(error)
        try:  # rank 1 skips the teacher's update and makes the EMA's, with the same weight: other models
            zcompile.lerp_weights_(teacher if rank == 0 else ema, student, MOMENTUM, timeout_s=20)
        except RankDivergenceError as error:
            results[stage]["other_model"] = str(error)
        skewed = _models()[0]  # a copy whose values differ between ranks (made before the ranks agreed on them)
        with torch.no_grad():
            skewed[0].weight.add_(rank)
        try:
            zcompile.lerp_weights_(skewed, student, EMA_WEIGHT, timeout_s=20)
        except RankDivergenceError as error:
            results[stage]["skewed"] = (str(error), shard_of(skewed[0].weight) is None)
    return results


def _replica_student(rank: int, world: int) -> dict:
    """Stage 2 with ``param_dtype``: the student trains a bf16 replica over fp32 master shards, so no
    rank holds its fp32 weights whole; its teacher (compiled, frozen: whole in fp32 on every rank) and
    an uncompiled EMA copy follow it by ``lerp_weights_`` (slices, then an all-gather), and two plain
    copies follow it through ``gathered`` (the fp32 masters gathered whole): the two ways must agree."""
    torch._dynamo.reset()
    student, teacher, predictor = _models()
    ema = copy.deepcopy(student).requires_grad_(False)
    by_gathered = [copy.deepcopy(teacher), copy.deepcopy(ema)]
    options = {"stage": 2, "param_dtype": "bf16"}
    online, target, head = (torch.compile(m, backend="zero", options=options) for m in (student, teacher, predictor))
    optimizer = zcompile.optim.AdamW([*student.parameters(), *predictor.parameters()], lr=1e-2)
    for step in range(STEPS):
        a, b = (view.chunk(world)[rank] for view in _views(step))
        _byol_loss(online, head, target, a, b).float().backward()
        optimizer.step()
        optimizer.zero_grad()
        zcompile.lerp_weights_(teacher, student, MOMENTUM)
        zcompile.lerp_weights_(ema, student, EMA_WEIGHT)
        with zcompile.gathered(student), torch.no_grad():
            for copied, weight in zip(by_gathered, (MOMENTUM, EMA_WEIGHT)):
                for t, s in zip(copied.parameters(), student.parameters()):
                    t.lerp_(s, weight)
    return {
        "ours": [[p.detach().clone() for p in m.parameters()] for m in (teacher, ema)],
        "by_gathered": [[p.detach().clone() for p in m.parameters()] for m in by_gathered],
        "first": [p.detach().clone() for p in _models()[1].parameters()],
    }


def _averaged_buffers(rank: int, world: int) -> dict:
    """``buffers=True`` at stage 3: an EMA copy of a BatchNorm model follows the student's running
    statistics (rank 0's on every rank after each step) as ``torch.lerp_`` over the same buffers does;
    between a forward (each rank's own statistics) and the step the call is refused on every rank."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.GELU(), nn.Linear(32, 8))
    ema = copy.deepcopy(student).requires_grad_(False)
    by_torch, start = copy.deepcopy(ema), [b.clone() for b in ema.buffers()]
    compiled = torch.compile(student, backend="zero", options={"stage": 3})
    optimizer = zcompile.optim.AdamW(student.parameters(), lr=1e-2)
    for step in range(STEPS):
        compiled(_views(step)[0].chunk(world)[rank]).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        zcompile.lerp_weights_(ema, student, EMA_WEIGHT, buffers=True)
        with torch.no_grad():
            for t, s in zip(by_torch.buffers(), student.buffers()):
                t.lerp_(s, EMA_WEIGHT) if t.is_floating_point() else t.copy_(s)
    out = {
        "ours": [b.clone() for b in ema.buffers()],
        "by_torch": [b.clone() for b in by_torch.buffers()],
        "start": start,
    }
    compiled(_views(STEPS)[0].chunk(world)[rank]).square().mean().backward()  # each rank's own statistics now
    try:
        zcompile.lerp_weights_(ema, student, EMA_WEIGHT, buffers=True, timeout_s=20)
    except RankDivergenceError as error:
        out["before_step"] = str(error)
    return out


def _all_on_rank(rank: int, world: int) -> dict:
    return {
        **_train_on_rank(rank, world, [2, 3]),
        "replica": _replica_student(rank, world),
        "buffers": _averaged_buffers(rank, world),
    }


@pytest.fixture(scope="module")
def runs():
    return run_ranks(2, _all_on_rank, timeout_s=300)


def test_a_bf16_students_teacher_and_ema_follow_its_fp32_masters_from_slices(runs):
    for rank_results in runs:
        ours, by_gathered = rank_results["replica"]["ours"], rank_results["replica"]["by_gathered"]
        for model_ours, model_gathered in zip(ours, by_gathered, strict=True):
            for got, expected in zip(model_ours, model_gathered, strict=True):
                torch.testing.assert_close(got, expected, atol=1e-7, rtol=0)
        assert any(not torch.equal(p, q) for p, q in zip(ours[0], rank_results["replica"]["first"]))  # it moved


@pytest.mark.parametrize("stage", [2, 3])
def test_a_teacher_and_an_ema_updated_on_shards_equal_one_process_over_full_weights(runs, stage):
    reference = _reference()
    for rank_results in runs:
        ours = rank_results[stage]
        assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-6)
        for kind in ("teacher", "ema"):
            for got, expected in zip(ours[kind], reference[kind], strict=True):
                torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        torch.testing.assert_close(ours["evaluation"], reference["evaluation"], atol=ATOL, rtol=0)
        # at stage 3 the first update sharded the EMA copy as the student (its compile then took those shards)
        assert ours["ema_sharded"] == [3 if stage == 3 else None] * len(ours["ema"])
        # they moved: the update did not leave the starting weights
        assert any(not torch.equal(t, s) for t, s in zip(ours["teacher"], _models()[1].parameters()))
        assert "different models or weights" in ours["disagreement"] and "0.1" in ours["disagreement"]
        # the teacher, the student and the EMA copy were numbered in that order at the first step's updates
        numbers = re.search(r"\{0: \[\[(\d+), (\d+)\], 6, .*, 1: \[\[(\d+), (\d+)\], 6, ", ours["other_model"])
        teacher, student, ema, student_again = map(int, numbers.groups())
        assert student == student_again == teacher + 1 and ema == teacher + 2
        # a copy that differs between ranks would be cut into a mix of them: refused before it is sharded
        message, left_whole = ours["skewed"]
        assert "the target starts from different values on different ranks" in message and left_whole


def test_buffers_averaged_follow_rank_0s_statistics_and_are_refused_between_forward_and_step(runs):
    mean, var, tracked = runs[0]["buffers"]["ours"]
    assert tracked.item() == STEPS and not torch.equal(mean, runs[0]["buffers"]["start"][0])  # they moved
    for rank_results in runs:
        ours = rank_results["buffers"]
        for got, expected, first_rank in zip(ours["ours"], ours["by_torch"], runs[0]["buffers"]["ours"], strict=True):
            assert torch.equal(got, expected) and torch.equal(got, first_rank)  # one EMA on every rank
        assert "the source's buffers differ between ranks" in ours["before_step"]
        assert "update after the step" in ours["before_step"]


def test_pairs_held_differently_are_refused_before_any_weight_changes():
    """One process (a world of one): a stage-3 target cannot move toward a source held in full (it has no
    shard), nor a stage-3 target toward a stage-2 source; the error names the pair and the fixes, and
    nothing moved, the pairs before the refused one included."""
    torch._dynamo.reset()
    target, source, _ = _models()
    compiled = torch.compile(target, backend="zero", options={"stage": 3})
    compiled(torch.randn(2, 16)).sum().backward()
    with zcompile.gathered(target):
        before = [p.detach().clone() for p in target.parameters()]
    with pytest.raises(
        ValueError,
        match=r"pair #0 \(32, 16\).*target: stage 3, 512 elements over 1 ranks; "
        r"source: full, not sharded.*zcompile.gathered",
    ):
        zcompile.lerp_weights_(target, source, 0.5)
    with zcompile.gathered(target):
        assert all(torch.equal(p, b) for p, b in zip(target.parameters(), before))
    with pytest.raises(ValueError, match=r"weight=1.5 must be in \[0, 1\]"):
        zcompile.lerp_weights_(source, target, 1.5)
    with zcompile.gathered(target):  # its exit writes the full weights over the shards: refused, not lost
        with pytest.raises(RuntimeError, match=r"pair #0 \(32, 16\) is gathered now"):
            zcompile.lerp_weights_(target, target, 0.5)


def test_a_bf16_model_at_stage_2_keeps_its_fp32_master_in_step_with_the_new_weights():
    """A model cast to bf16 (no ``param_dtype``) keeps full bf16 weights at stage 2 and an fp32 master
    shard apart, which the optimizer steps from and checkpoints save: the update writes both, where
    updating the weights alone would be undone by the next step. One process (a world of one)."""
    from zcompile.sharding.shards import shard_of

    torch._dynamo.reset()
    target, source = (_models()[0].to(torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)
    for model in (target, source):
        compiled = torch.compile(model, backend="zero", options={"stage": 2})
        compiled(torch.randn(2, 16, dtype=torch.bfloat16)).float().sum().backward()
        model.zero_grad()
    expected = [
        t.float().lerp(s.float(), 0.25).to(torch.bfloat16) for t, s in zip(target.parameters(), source.parameters())
    ]
    zcompile.lerp_weights_(target, source, 0.25)
    for param, value in zip(target.parameters(), expected, strict=True):
        torch.testing.assert_close(param.detach(), value, atol=0.02, rtol=0.01)  # bf16 rounding
        master = shard_of(param).shard.detach()[: param.numel()]
        assert torch.equal(master, param.detach().float().reshape(-1))


def test_a_target_with_a_replica_of_its_own_is_refused_naming_gathered():
    """Stage 2 with ``param_dtype``, a trained target (lookahead's slow weights): its fp32 values are
    master shards with a bf16 replica beside them, which a slice update would leave behind; refused
    with the fix that works. One process (a world of one)."""
    torch._dynamo.reset()
    target, source = _models()[0], _models()[0]
    for model in (target, source):
        compiled = torch.compile(model, backend="zero", options={"stage": 2, "param_dtype": "bf16"})
        compiled(torch.randn(2, 16)).float().sum().backward()
    with pytest.raises(
        ValueError,
        match=r"target: stage 2 with a torch.bfloat16 replica.*"
        r"update inside `with zcompile.gathered\(target\)",
    ):
        zcompile.lerp_weights_(target, source, 0.5)
