"""``zcompile.checkpoint.save(path, obj)`` / ``load(path)``: a DDP script's ``torch.save`` dict, on every rank.

One 2-rank launch. Per stage: train 2 steps, save ``{"model": compiled.state_dict(), "optimizer":
optimizer.state_dict(), ...}`` as nanoGPT builds it, train on to 4 (the uninterrupted run); then, as
``init_from="resume"`` does, read the dict back with no model, load it into a fresh model and
optimizer before compiling, and train steps 2-3 again: the losses must equal the uninterrupted run's
bitwise (same world, same arithmetic). The parent process reads the same checkpoint in a world of one
and compares it with each rank's own shards.
"""

from __future__ import annotations

import collections
import os
import time

import pytest
import torch

import zcompile
from support.launch import run_ranks
from support.models import build_model
from support.training import RunSpec, _optimizer, train_steps
from zcompile.checkpoint.layout import CheckpointError

SPEC = RunSpec(model="gpt", steps=4)
PREFIX = "_orig_mod."


def _fresh(stage: int):
    torch._dynamo.reset()
    model = build_model("gpt")
    return model, _optimizer(SPEC, model.parameters(), True)


def _compiled(model, stage: int):
    return torch.compile(model, backend="zero", options={"stage": stage})


def objects_on_rank(rank: int, world: int, root: str) -> dict:
    out: dict = {}
    for stage in (1, 2, 3):
        path = os.path.join(root, f"stage{stage}")
        model, optimizer = _fresh(stage)
        compiled = _compiled(model, stage)
        first = train_steps(SPEC, compiled, optimizer, range(2), rank, world)
        checkpoint = {
            "model": compiled.state_dict(),
            "optimizer": optimizer.state_dict(),
            "model_args": {"n_layer": 2, "note": f"rank {rank}"},  # rank 0's is what load gives
            "iter_num": 2,
            "history": [torch.tensor([1.0, 2.0]), (3, "x")],
        }
        zcompile.checkpoint.save(path, checkpoint)
        out[stage] = {  # this rank's pieces at the save (views of the live state: copied before training on)
            "moments": {i: s["exp_avg"].to_local().clone() for i, s in checkpoint["optimizer"]["state"].items()},
            "weights": {k.removeprefix(PREFIX): v.clone() for k, v in checkpoint["model"].items()},
        }
        out[stage]["uninterrupted"] = first + train_steps(SPEC, compiled, optimizer, range(2, SPEC.steps), rank, world)

        model, optimizer = _fresh(stage)  # init_from="resume": the dict first, then the model
        loaded = zcompile.checkpoint.load(path)
        state_dict = loaded["model"]
        for key in list(state_dict):
            if key.startswith(PREFIX):
                state_dict[key.removeprefix(PREFIX)] = state_dict.pop(key)
        model.load_state_dict(state_dict)
        optimizer.load_state_dict(loaded["optimizer"])
        out[stage]["resumed"] = train_steps(SPEC, _compiled(model, stage), optimizer, range(2, SPEC.steps), rank, world)
        out[stage]["extras"] = (loaded["model_args"], loaded["iter_num"], loaded["history"][1])
        out[stage]["types"] = (
            type(loaded["model"]).__name__,
            sorted({type(k).__name__ for k in loaded["optimizer"]["state"]}),
        )

    # DDP's habit at stage 3: state_dict() on rank 0 only, while rank 1 trains on
    model, optimizer = _fresh(3)
    compiled = _compiled(model, 3)
    train_steps(SPEC, compiled, optimizer, range(1), rank, world)

    # the model and optimizer themselves in the dict, not their state dicts: rank 0 cannot pickle them
    started = time.monotonic()
    try:
        zcompile.checkpoint.save(os.path.join(root, "objects"), {"model": compiled, "optimizer": optimizer})
        out["unpicklable"] = ""
    except Exception as error:  # noqa: BLE001 - the error text is what is tested
        out["unpicklable"] = f"{type(error).__name__}: {error}"
    out["unpicklable_s"] = time.monotonic() - started

    started = time.monotonic()
    try:
        if rank == 0:
            compiled.state_dict()
        else:
            train_steps(SPEC, compiled, optimizer, range(1, 2), rank, world)
        out["alone"] = ""
    except Exception as error:  # noqa: BLE001 - the error text is what is tested
        out["alone"] = f"{type(error).__name__}: {error}"
    out["alone_s"] = time.monotonic() - started

    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("objects"))
    return root, run_ranks(2, objects_on_rank, root, timeout_s=600)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_ddp_scripts_checkpoint_dict_resumes_exactly(runs, stage):
    _, results = runs
    for result in results:
        assert result[stage]["resumed"] == result[stage]["uninterrupted"][2:]
        assert result[stage]["extras"] == ({"n_layer": 2, "note": "rank 0"}, 2, (3, "x"))
        assert result[stage]["types"] == ("OrderedDict", ["int"])  # torch's types and keys, as torch.load gives


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_dict_reads_back_in_one_process_with_every_ranks_pieces(runs, stage):
    """Read with no process group (the script's ``sample.py``): full weights as the ranks had them,
    each optimizer moment the ranks' two pieces end to end."""
    root, results = runs
    loaded = zcompile.checkpoint.load(os.path.join(root, f"stage{stage}"))
    weights = {k.removeprefix(PREFIX): v for k, v in loaded["model"].items()}
    assert isinstance(loaded["model"], collections.OrderedDict)
    assert weights.keys() == results[0][stage]["weights"].keys()
    assert all(torch.equal(weights[k], v) for k, v in results[0][stage]["weights"].items())
    for index, entry in loaded["optimizer"]["state"].items():
        pieces = torch.cat([result[stage]["moments"][index] for result in results])
        assert torch.equal(entry["exp_avg"], pieces), index
    assert torch.equal(loaded["history"][0], torch.tensor([1.0, 2.0]))


def test_stage3_state_dict_on_one_rank_is_an_error_naming_the_fix(runs):
    _, (rank0, rank1) = runs
    assert rank0["alone"].startswith("RankDivergenceError"), rank0["alone"]
    assert "model.state_dict()" in rank0["alone"] and "every rank" in rank0["alone"]
    assert rank1["alone"], "rank 1 trained on without a word"
    assert max(rank0["alone_s"], rank1["alone_s"]) < 30


def test_load_of_a_model_checkpoint_without_a_model_names_the_call(tmp_path):
    model = build_model("gpt")
    zcompile.checkpoint.save(tmp_path / "ck", model)
    with pytest.raises(CheckpointError, match=r"load\(path, model, optimizer\)"):
        zcompile.checkpoint.load(tmp_path / "ck")
    with pytest.raises(TypeError, match="put what you want saved into the dict"):
        zcompile.checkpoint.save(tmp_path / "obj", {"model": model.state_dict()}, extra={"a": 1})


def test_the_dict_round_trips_in_a_world_of_one(tmp_path):
    obj = {"w": torch.arange(6.0).view(2, 3), "steps": [1, 2], "nested": {"t": torch.ones(2, dtype=torch.int64)}}
    zcompile.checkpoint.save(tmp_path / "ck", obj)
    back = zcompile.checkpoint.load(tmp_path / "ck")
    assert back.keys() == obj.keys() and back["steps"] == [1, 2]
    assert torch.equal(back["w"], obj["w"]) and torch.equal(back["nested"]["t"], obj["nested"]["t"])


def test_a_dict_holding_the_model_itself_is_an_error_on_every_rank_naming_state_dicts(runs):
    """``save(path, {"model": model, ...})``: rank 0 pickles the dict's parts other than tensors, and a
    compiled model holds process groups. Found before any rank writes, and said on both (rank 1 was
    left in DCP's collective with gloo's "Connection closed" alone)."""
    root, results = runs
    for rank, result in enumerate(results):
        assert "cannot be pickled" in result["unpicklable"] and "model.state_dict()" in result["unpicklable"], (
            rank,
            result["unpicklable"],
        )
        assert result["unpicklable_s"] < 30, result["unpicklable_s"]
    assert not os.path.exists(os.path.join(root, "objects"))  # nothing written
