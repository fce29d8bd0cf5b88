"""Hybrid sharding (``shard_size`` / ``mesh``): 4 gloo ranks as 2 shard groups of 2.

References: a single process on the global batch (losses and weights), ZeRO's model-state formula
with N replaced by the shard size, and the collectives torch.profiler records (not zcompile's own
records): gathers and reduce-scatters of the shard size, one all-reduce per reduced bucket.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

import zcompile
from support.launch import run_ranks
from support.models import build_model, model_loss
from support.training import RunSpec, assert_same_training, micro_batches, train_reference, train_steps, train_zero

WORLD = 4
HYBRID = {"shard_size": 2}
SPECS = {
    "stage1": RunSpec(model="gpt", stage=1, options=HYBRID),
    "stage2": RunSpec(model="gpt", stage=2, options=HYBRID),
    "stage3": RunSpec(model="gpt", stage=3, options=HYBRID),
    # clipping that clips (the norm counts each element once, not once per replica) and 2 micro-batches
    "stage3_clip_accum": RunSpec(model="gpt", stage=3, clip=0.05, grad_accum=2, options=HYBRID),
    "stage1_clip_accum": RunSpec(model="gpt", stage=1, clip=0.05, grad_accum=2, options=HYBRID),
    "llama_stage3": RunSpec(model="hf_llama", stage=3, options=HYBRID),
}
FUNCTIONAL = "_c10d_functional::"


def _profiled_collectives(rank: int, world: int, stage: int, options: dict) -> tuple[list, list[str], str]:
    """(kind, group size or -1, elements) of each functional collective of one training step, from
    torch.profiler's events (an all-reduce records no group size: -1); the kinds of step_report's
    rows, and its title."""
    torch._dynamo.reset()
    spec = RunSpec(model="gpt", stage=stage)
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": stage, **options})
    optimizer = zcompile.optim.AdamW(model.parameters(), lr=1e-3)
    found = []
    for step in range(2):  # the second step profiled: the first compiles
        ((tokens, targets),) = micro_batches(spec, step, rank, world)
        with torch.profiler.profile(record_shapes=True) if step else contextlib.nullcontext() as prof:
            model_loss("gpt", compiled, tokens, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    for event in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
        name = event.name()
        if not name.startswith(FUNCTIONAL) or "wait" in name:
            continue
        shape = event.shapes()[0]
        elements = int(torch.Size(shape).numel())
        if "all_gather" in name:
            found.append(("all_gather", int(event.concrete_inputs()[1]), elements))
        elif "all_to_all" in name:  # gloo's reduce-scatter (reduce_scatter_lowering): one split per rank
            found.append(("reduce_scatter", len(event.concrete_inputs()[1]), elements))
        elif "reduce_scatter" in name:
            found.append(("reduce_scatter", int(event.concrete_inputs()[2]), elements))
        elif "all_reduce" in name:
            found.append(("all_reduce", -1, elements))
    report = zcompile.step_report(model, optimizer)
    return found, [kind for _, kind, *_ in report.collective_rows()], report.title()


def _mesh_run(rank: int, world: int) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    spec = RunSpec(model="gpt", stage=2, options={"mesh": mesh})
    return train_zero(spec, rank, world).losses


def _on_rank(rank: int, world: int) -> dict:
    out = {name: train_zero(spec, rank, world) for name, spec in SPECS.items()}
    out["profiled"] = {stage: _profiled_collectives(rank, world, stage, HYBRID) for stage in (2, 3)}
    out["mesh"] = _mesh_run(rank, world)
    # a shard size that differs between ranks: an error on every rank before any group is made
    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"shard_size": 2 if rank < 2 else 4})
    ((tokens, targets),) = micro_batches(SPECS["stage3"], 0, rank, world)
    try:
        model_loss("gpt", compiled, tokens, targets)
        out["differs"] = ""
    except Exception as error:  # noqa: BLE001 - the text is what is tested
        out["differs"] = f"{type(error).__name__}: {error}"
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(WORLD, _on_rank, timeout_s=900)


@pytest.mark.parametrize("name", list(SPECS))
def test_trains_like_a_single_process_on_the_global_batch(ranks, name):
    spec = SPECS[name]
    reference = train_reference(spec)
    for result in ranks:
        assert_same_training(result[name], reference, spec)
    if spec.clip is not None:  # the clip really clipped, at the reference's norm
        assert all(norm > spec.clip for norm in ranks[0][name].grad_norms)


def test_a_mesh_trains_as_shard_size_does(ranks):
    for result in ranks:
        assert result["mesh"] == result["stage2"].losses


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_model_states_per_rank_are_zeros_formula_with_the_shard_size(ranks, stage):
    result = ranks[0][f"stage{stage}"]
    expected = zcompile.zero_formula_bytes(result.num_params, 2, stage)
    assert abs(result.state_bytes - expected) <= 0.01 * expected, (result.state_bytes, expected)
    full = zcompile.zero_formula_bytes(result.num_params, WORLD, stage)
    assert result.state_bytes > full  # more than full sharding over 4 would hold
    assert result.estimated_state_bytes == result.state_bytes  # estimate_memory, before compiling


@pytest.mark.parametrize("stage", [2, 3])
def test_gathers_and_reduce_scatters_stay_in_the_shard_group_and_one_all_reduce_per_bucket(ranks, stage):
    for result in ranks:
        found, rows, title = result["profiled"][stage]
        assert "all_reduce [replicate 2]" in rows, rows
        assert "reduce_scatter [shard 2]" in rows and "4 ranks as 2 shard groups of 2" in title
        reduces = [elements // size for kind, size, elements in found if kind == "reduce_scatter"]
        assert {size for kind, size, _ in found if kind != "all_reduce"} == {2}
        assert reduces and (
            stage == 2 or any(kind == "all_gather" for kind, _, _ in found)
        )  # stage 2 gathers at the step
        # each reduced shard (a reduce-scatter's output) all-reduced once across the replicas
        assert sorted(e for kind, _, e in found if kind == "all_reduce") == sorted(reduces)


def test_a_shard_size_that_differs_between_ranks_is_an_error_on_every_rank(ranks):
    for result in ranks:
        assert "shard" in result["differs"] and "same on every rank" in result["differs"], result["differs"]


# ----------------------------------------------------------------------------- checkpoints across layouts
CKPT_SPEC = RunSpec(model="gpt", stage=3, steps=4)


def _fresh(options: dict):
    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "compiler": "eager", **options})
    return model, compiled, zcompile.optim.AdamW(model.parameters(), lr=CKPT_SPEC.lr)


def _checkpoint_on_rank(rank: int, world: int, root: str) -> dict:
    out = {}
    _, compiled, optimizer = _fresh(HYBRID)
    out["uninterrupted"] = train_steps(CKPT_SPEC, compiled, optimizer, range(4), rank, world)
    # 2 x 2 -> saved at step 2
    _, compiled, optimizer = _fresh(HYBRID)
    train_steps(CKPT_SPEC, compiled, optimizer, range(2), rank, world)
    zcompile.checkpoint.save(f"{root}/hsdp", compiled, optimizer)
    zcompile.checkpoint.save(f"{root}/hsdp_obj", {"model": compiled.state_dict(), "optimizer": optimizer.state_dict()})
    # -> full sharding over 4 (loaded before the compile), one step, saved at step 3
    model, compiled, optimizer = _fresh({})
    zcompile.checkpoint.load(f"{root}/hsdp", model, optimizer)
    out["full4"] = train_steps(CKPT_SPEC, compiled, optimizer, [2], rank, world)
    zcompile.checkpoint.save(f"{root}/full4", compiled, optimizer)
    # -> back to 2 x 2 (loaded before the compile: the optimizer's pieces are cut again for the shard group)
    model, compiled, optimizer = _fresh(HYBRID)
    zcompile.checkpoint.load(f"{root}/full4", model, optimizer)
    out["back"] = train_steps(CKPT_SPEC, compiled, optimizer, [3], rank, world)
    # the torch.save-shaped dict of a 2 x 2 run, loaded into a fresh 2 x 2 run before its compile
    model, compiled, optimizer = _fresh(HYBRID)
    loaded = zcompile.checkpoint.load(f"{root}/hsdp_obj")
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in loaded["model"].items()})
    optimizer.load_state_dict(loaded["optimizer"])
    out["object"] = train_steps(CKPT_SPEC, compiled, optimizer, range(2, 4), rank, world)
    return out


def _two_ranks_resume(rank: int, world: int, root: str) -> list[float]:
    _, compiled, optimizer = _fresh({})
    zcompile.checkpoint.load(f"{root}/hsdp", compiled, optimizer)
    return train_steps(CKPT_SPEC, compiled, optimizer, range(2, 4), rank, world)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hybrid_ckpt"))
    four = run_ranks(WORLD, _checkpoint_on_rank, root, timeout_s=600)
    two = run_ranks(2, _two_ranks_resume, root, timeout_s=600)
    return root, four, two


def test_a_checkpoint_moves_between_hybrid_and_full_sharding(checkpoints):
    """2 x 2 -> 4 (full) -> 2 x 2, and 2 x 2 -> 2 ranks: resumed losses within 1e-6 of the uninterrupted
    2 x 2 run (the sums over ranks run in another order: not bitwise)."""
    _, four, two = checkpoints
    for result in four:
        expected = result["uninterrupted"]
        assert max(abs(a - b) for a, b in zip(result["full4"] + result["back"], expected[2:])) < 1e-6
        assert max(abs(a - b) for a, b in zip(result["object"], expected[2:])) < 1e-6
    for losses in two:
        assert max(abs(a - b) for a, b in zip(losses, four[0]["uninterrupted"][2:])) < 1e-6


def test_a_hybrid_checkpoint_holds_each_piece_once_and_consolidates(checkpoints, tmp_path):
    root, _, _ = checkpoints
    from zcompile.checkpoint.consolidate import consolidate

    consolidate(f"{root}/hsdp", tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt")
    model = build_model("gpt")
    assert full.keys() >= dict(model.named_parameters()).keys()
    # each piece written once, not once per replica: as many bytes as the same states saved by full sharding
    assert _data_bytes(f"{root}/hsdp") < 1.2 * _data_bytes(f"{root}/full4")


def _data_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory) if f.endswith(".distcp"))
