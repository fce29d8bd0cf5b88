"""The state-dict routes users try besides ``zcompile.checkpoint``: each works, or raises naming the fix.

One 2-rank launch. A route "works" when training resumed through it replays the uninterrupted run
bitwise (same world size, same arithmetic): the load reached the master shards and each rank got
its own optimizer moments.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import zcompile
import zcompile.checkpoint.dcp as ckpt
from support.launch import run_ranks
from support.models import build_model
from support.training import RunSpec, _optimizer, train_steps
from zcompile.sharding.shards import shard_of as zcompile_shard_of
from zcompile.sharding.state_dict_hooks import ShardedStateDictError

SPEC = RunSpec(model="gpt", steps=4)


def _fresh(stage: int):
    torch._dynamo.reset()
    model = build_model("gpt")
    return (
        model,
        torch.compile(model, backend="zero", options={"stage": stage}),
        _optimizer(SPEC, model.parameters(), True),
    )


def _error(fn) -> str:
    try:
        fn()
    except (ShardedStateDictError, RuntimeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return ""


_GLOBAL_MODEL: torch.nn.Module | None = None  # what _loss_of_global_model trains (routes_on_rank sets it)


def _equal_to(expected: dict, state_dict: dict) -> bool:
    """``state_dict`` has ``expected``'s names (a compiled model's with ``_orig_mod.``) and values."""
    state_dict = {k.removeprefix("_orig_mod."): v for k, v in state_dict.items()}
    return state_dict.keys() == expected.keys() and all(torch.equal(state_dict[k], v) for k, v in expected.items())


def _loss_of_global_model(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(_GLOBAL_MODEL(x), y)


def routes_on_rank(rank: int, world: int, root: str) -> dict:
    out = {"full": {}}
    for stage in (1, 2, 3):
        _, compiled, optimizer = _fresh(stage)
        out["full"][stage] = train_steps(SPEC, compiled, optimizer, range(SPEC.steps), rank, world)
    initial = build_model("gpt").state_dict()  # the weights every run starts from

    # model.load_state_dict into a trained model at every stage: the next steps restart from it
    out["reloaded"] = {}
    for stage in (1, 2, 3):
        model, compiled, optimizer = _fresh(stage)
        train_steps(SPEC, compiled, optimizer, range(2), rank, world)
        model.load_state_dict(initial)
        optimizer = _optimizer(SPEC, model.parameters(), True)
        out["reloaded"][stage] = train_steps(SPEC, compiled, optimizer, range(SPEC.steps), rank, world)

    # stage 3: state_dict gathers the full weights (directly and through DCP), as inside gathered()
    model, compiled, optimizer = _fresh(3)
    train_steps(SPEC, compiled, optimizer, range(2), rank, world)
    full = ckpt.full_state_dict(model, rank=rank)  # every rank its own copy, to compare
    out["stage3_state_dict_equal"] = _equal_to(full, model.state_dict())
    out["stage3_dcp_model_equal"] = _equal_to(full, get_model_state_dict(compiled))
    out["stage3_still_sharded"] = all(zcompile_shard_of(p).is_freed for p in model.parameters())
    with zcompile.gathered(model):
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    out["gathered_state_dict_equal"] = all(torch.equal(saved[k], full[k]) for k in full)

    # a transformers Llama, whose forward a decorator wraps in ``wrapped_func(*args, **kwargs)``: the frame
    # Dynamo compiles holds the model only in ``args`` (the hooks were missing: state_dict() returned
    # freed storages, load_state_dict failed in ShardedParameterError, Trainer's load_best_model_at_end too)
    torch._dynamo.reset()
    llama = build_model("hf_llama")
    initial_llama = {k: v.clone() for k, v in llama.state_dict().items()}
    compiled = torch.compile(llama, backend="zero", options={"stage": 3})
    optimizer = _optimizer(SPEC, llama.parameters(), True)
    train_steps(RunSpec(model="hf_llama", steps=2), compiled, optimizer, range(2), rank, world)
    with zcompile.gathered(llama):
        gathered_llama = {k: v.clone() for k, v in llama.state_dict().items()}
    out["llama_state_dict_equal"] = _equal_to(gathered_llama, llama.state_dict())
    out["llama_load"] = _error(lambda: llama.load_state_dict(initial_llama))
    with zcompile.gathered(llama):
        out["llama_loaded_equal"] = all(torch.equal(p, initial_llama[n]) for n, p in llama.named_parameters())

    # a compiled training step that uses a global model (no module among the frame's locals: state_dict()
    # returned freed storages, which torch.save refused as an eager use)
    global _GLOBAL_MODEL
    torch._dynamo.reset()
    torch.manual_seed(0)
    _GLOBAL_MODEL = model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    initial_mlp = {k: v.clone() for k, v in model.state_dict().items()}
    step_fn = torch.compile(_loss_of_global_model, backend="zero", options={"stage": 3})
    optimizer = zcompile.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        generator = torch.Generator().manual_seed(step)
        step_fn(torch.randn(4, 8, generator=generator), torch.randn(4, 2, generator=generator)).backward()
        optimizer.step()
        optimizer.zero_grad()
    with zcompile.gathered(model):
        gathered_mlp = {k: v.clone() for k, v in model.state_dict().items()}
    out["global_state_dict_equal"] = _equal_to(gathered_mlp, model.state_dict())
    out["global_load"] = _error(lambda: model.load_state_dict(initial_mlp))
    with zcompile.gathered(model):
        out["global_loaded_equal"] = all(torch.equal(p, initial_mlp[n]) for n, p in model.named_parameters())

    # stage 2: model.state_dict + per-rank torch.save of optimizer.state_dict(), and the same through DCP
    model, compiled, optimizer = _fresh(2)
    train_steps(SPEC, compiled, optimizer, range(2), rank, world)
    torch.save(optimizer.state_dict(), os.path.join(root, f"optim_{rank}.pt"))
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=os.path.join(root, "dcp"))
    model, compiled, optimizer = _fresh(2)
    model.load_state_dict(model_state)
    optimizer.load_state_dict(torch.load(os.path.join(root, f"optim_{rank}.pt"), weights_only=False))
    out["torch_save_resumed"] = train_steps(SPEC, compiled, optimizer, range(2, SPEC.steps), rank, world)
    model, compiled, optimizer = _fresh(2)
    train_steps(SPEC, compiled, optimizer, [9], rank, world)  # a step on other data: state exists, values differ
    dest = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    dcp.load(dest, checkpoint_id=os.path.join(root, "dcp"))
    model.load_state_dict(dest["model"])
    optimizer.load_state_dict(dest["optim"])
    out["dcp_resumed"] = train_steps(SPEC, compiled, optimizer, range(2, SPEC.steps), rank, world)

    # DCP's optimizer-state initialization on a fresh optimizer is refused, not silently empty
    model, compiled, optimizer = _fresh(2)
    out["dcp_fresh_optimizer"] = _error(lambda: get_optimizer_state_dict(compiled, optimizer))

    # DDP's habit: rank 0's optimizer.state_dict() file loaded on every rank (last: rank 1 leaves its
    # error for the others, as a rank that raises does)
    model, compiled, optimizer = _fresh(2)
    train_steps(SPEC, compiled, optimizer, range(1), rank, world)
    rank0_file = torch.load(os.path.join(root, "optim_0.pt"), weights_only=True)
    out["rank0_file_loaded"] = _error(lambda: optimizer.load_state_dict(rank0_file))
    return out


@pytest.fixture(scope="module")
def routes(tmp_path_factory):
    return run_ranks(2, routes_on_rank, str(tmp_path_factory.mktemp("routes")), timeout_s=600)


def test_load_state_dict_reaches_the_shards_at_every_stage(routes):
    for result in routes:
        for stage in (1, 2, 3):
            assert result["reloaded"][stage] == result["full"][stage], stage


def test_stage3_state_dict_gathers_the_full_weights(routes):
    """On every rank, as FSDP's full state dict: the values consolidate reads, the shards left freed."""
    for result in routes:
        assert result["stage3_state_dict_equal"] and result["stage3_dcp_model_equal"]
        assert result["stage3_still_sharded"] and result["gathered_state_dict_equal"]


def test_a_model_whose_forward_a_decorator_wraps_gets_the_same_state_dict_routes(routes):
    for result in routes:
        assert result["llama_state_dict_equal"]
        assert result["llama_load"] == "" and result["llama_loaded_equal"]


def test_a_compiled_step_using_a_global_model_gets_the_same_state_dict_routes(routes):
    for result in routes:
        assert result["global_state_dict_equal"]
        assert result["global_load"] == "" and result["global_loaded_equal"]


def test_optimizer_state_dict_round_trips_per_rank_and_through_dcp(routes):
    for result in routes:
        assert result["torch_save_resumed"] == result["full"][2][2:]
        assert result["dcp_resumed"] == result["full"][2][2:]  # each rank its own moments


def test_one_ranks_optimizer_file_loaded_on_every_rank_is_refused(routes):
    """Each rank's optimizer.state_dict() is its piece of the moments: rank 0's file on rank 1 would
    have resumed with rank 0's moments on both ranks, silently (losses off the uninterrupted run's)."""
    rank0, rank1 = routes
    assert rank0["rank0_file_loaded"] == ""
    assert rank1["rank0_file_loaded"].startswith(
        "ValueError: optimizer state 'exp_avg': rank 1 is loading the piece rank 0 of 2 saved"
    )
    assert "zcompile.checkpoint.save/load" in rank1["rank0_file_loaded"]


def test_dcp_fresh_optimizer_state_is_refused(routes):
    for result in routes:
        assert "zcompile.checkpoint" in result["dcp_fresh_optimizer"]
