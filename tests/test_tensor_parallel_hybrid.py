"""Hybrid sharding of a tensor-parallel model: 8 gloo ranks as a 3-D mesh ("replicate", "shard", "tp")
= 2 x 2 x 2, the example GPT split over "tp", its pieces sharded over "shard" and replicated across
"replicate". References: a single process on the global batch, ZeRO's formula with N = the shard
group's size on the pieces, and an uninterrupted run for a checkpoint loaded at dp 4 x tp 2."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zcompile
from support.launch import run_ranks
from support.models import build_model, model_loss
from support.training import (
    RunSpec,
    _clip_before_step,
    _optimizer,
    assert_trains_like_one_process,
    micro_batches,
)

WORLD, REPLICAS, SHARD, TP = 8, 2, 2, 2
DP = REPLICAS * SHARD  # the ranks that read different data
# stage 3 (stage 1's optimizer-side reductions over the replicas are hybrid sharding's, tested apart)
SPECS = {stage: RunSpec(model="gpt_split_qkv", stage=stage, steps=2, clip=0.05, grad_accum=2) for stage in (3,)}


def _model(mesh) -> torch.nn.Module:
    from gpt import parallelize

    return parallelize(build_model("gpt_split_qkv"), mesh["tp"])


def _data_rank(mesh) -> int:
    if "dp" in mesh.mesh_dim_names:
        return mesh["dp"].get_local_rank()
    return mesh["replicate"].get_local_rank() * SHARD + mesh["shard"].get_local_rank()


def _step(spec: RunSpec, compiled, model, optimizer, step: int, mesh) -> tuple[float, float | None, int]:
    """One step of ``spec`` on this rank's micro-batches of the global batch: the global loss, the pre-clip
    norm, and the model states' bytes with the gradients (as ZeRO counts them: before stage 1's clipping
    reduces them)."""
    loss_sum = torch.zeros(())
    for tokens, targets in micro_batches(spec, step, _data_rank(mesh), DP):
        loss = model_loss(spec.model, compiled, tokens, targets) / spec.grad_accum
        loss.backward()
        loss_sum += loss.detach()
    state_bytes = zcompile.model_state_bytes(model, optimizer).total
    norm = _clip_before_step(spec, model, optimizer)
    optimizer.step()
    optimizer.zero_grad()
    dist.all_reduce(loss_sum)  # the tp ranks hold the same losses: the mean over the world is the global one
    return float(loss_sum) / WORLD, norm, state_bytes


def _weights(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    with zcompile.gathered(model):
        return {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()
        }


def _on_rank(rank: int, world: int, directory: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (REPLICAS, SHARD, TP), mesh_dim_names=("replicate", "shard", "tp"))
    out, kept = {}, None
    for stage, spec in SPECS.items():
        torch._dynamo.reset()
        model = _model(mesh)
        compiled = torch.compile(model, backend="zero", options={"stage": stage, "compiler": "eager", "mesh": mesh})
        optimizer = _optimizer(spec, model.parameters(), zero=True)
        losses, norms = [], []
        for step in range(spec.steps):
            loss, norm, state_bytes = _step(spec, compiled, model, optimizer, step, mesh)
            losses.append(loss)
            norms.append(norm)
        report = zcompile.step_report(model, optimizer)
        out[stage] = {
            "losses": losses,
            "norms": norms,
            "params": _weights(model),
            "state_bytes": state_bytes,
            "psi": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters()),
            "title": report.title(),
            "kinds": {kind for _, kind, *_ in report.collective_rows()},
        }
        kept = (compiled, model, optimizer)
    # stage 3's model and optimizer saved with DCP, loaded at dp 4 x tp 2 (no replicas), a step on each
    compiled, model, optimizer = kept
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=directory)
    spec = SPECS[3]
    continued, *_ = _step(spec, compiled, model, optimizer, spec.steps, mesh)
    torch._dynamo.reset()
    flat = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    other = _model(flat)
    other_compiled = torch.compile(other, backend="zero", options={"stage": 3, "compiler": "eager", "mesh": flat})
    other_optimizer = _optimizer(spec, other.parameters(), zero=True)
    _step(spec, other_compiled, other, other_optimizer, 0, flat)  # state to load into
    state = {"model": other.state_dict(), "optimizer": other_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=directory)
    other.load_state_dict(state["model"])
    other_optimizer.load_state_dict(state["optimizer"])
    resumed, *_ = _step(spec, other_compiled, other, other_optimizer, spec.steps, flat)
    out["resume"] = (continued, resumed, _weights(model), _weights(other))
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(WORLD, _on_rank, str(tmp_path_factory.mktemp("hybrid_tp")), timeout_s=900)


@pytest.mark.parametrize("stage", list(SPECS))
def test_trains_like_a_single_process_with_clipping_and_accumulation(ranks, stage):
    assert_trains_like_one_process([rank[stage] for rank in ranks], SPECS[stage])


@pytest.mark.parametrize("stage", list(SPECS))
def test_model_states_are_zeros_formula_over_the_shard_group_on_the_pieces(ranks, stage):
    for result in (rank[stage] for rank in ranks):
        expected = zcompile.zero_formula_bytes(result["psi"], SHARD, stage)
        assert abs(result["state_bytes"] - expected) <= 0.02 * expected, (result["state_bytes"], expected)
        assert "8 ranks as 2 replicas x shard 2 x tp 2" in result["title"]
        # gathers and reduce-scatters in the shard group, the reduced shards across replicas, the model's own sums
        assert {"all_gather [shard 2]", "reduce_scatter [shard 2]", "all_reduce [replicate 2]"} <= result["kinds"]
        assert "all_reduce [tp 2]" in result["kinds"]


def test_a_checkpoint_loads_at_dp_4_x_tp_2_like_an_uninterrupted_run(ranks):
    for continued, resumed, weights, other in (rank["resume"] for rank in ranks):
        assert abs(continued - resumed) <= 1e-6 * abs(continued), (continued, resumed)
        for name, value in other.items():  # the optimizer's moments and step moved too
            torch.testing.assert_close(value, weights[name], rtol=0, atol=1e-6, msg=name)
