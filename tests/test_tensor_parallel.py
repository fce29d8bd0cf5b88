"""ZeRO over a tensor-parallel model: 4 gloo ranks as dp 2 x tp 2, the example GPT (separate q, k, v,
``examples/gpt.py``'s ``parallelize``) and a transformers Llama (q/k/v, gate/up column-wise; o, down
row-wise), parallelized by torch's ``parallelize_module`` on ``mesh["tp"]`` and compiled with
``options={"mesh": mesh}``.

References: a single process on the global batch (losses, pre-clip gradient norms, and the weights
after training, put together from the pieces), ZeRO's model-state formula with N = dp applied to
each rank's tensor-parallel pieces, and an uninterrupted run for a resume.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist

import zcompile
from support.launch import run_ranks
from support.models import build_model, model_loss
from support.scaled_training import INIT_SCALE, scaled_loop, scaled_loss, scaled_reference
from support.training import (
    ADAM_EPS,
    GRAD_ABS_ERROR,
    PARAM_TOL,
    RunSpec,
    _clip_before_step,
    _optimizer,
    assert_trains_like_one_process,
    micro_batches,
    train_reference,
)

WORLD, DP, TP = 4, 2, 2
# stages 1 and 3 with clipping that clips (split weights summed over tp, replicated ones counted once)
# and 2 micro-batches; stage 2 plain (its run is resumed below). The GPT's head is tied to its embedding.
SPECS = {
    "stage1": RunSpec(model="gpt_split_qkv", stage=1, steps=2, clip=0.05, grad_accum=2),
    "stage2": RunSpec(model="gpt_split_qkv", stage=2, steps=2),
    # stage 3 with recomputation: the memory-budget partitioner sizes DTensor's mesh inputs (zero)
    "stage3": RunSpec(
        model="gpt_split_qkv", stage=3, steps=2, clip=0.05, grad_accum=2, options={"activation_memory_budget": 0.5}
    ),
    "llama_stage1": RunSpec(model="hf_llama", stage=1, steps=2, clip=0.05),
    "llama_stage2": RunSpec(model="hf_llama", stage=2, steps=2, grad_accum=2),
    "llama_stage3": RunSpec(model="hf_llama", stage=3, steps=2, clip=0.05, grad_accum=2),
}
# with sequence parallelism: the norms (DTensor weights replicated over tp) see a slice of the sequence each
SEQUENCE_PARALLEL = {"stage1"}


def _tensor_parallel_model(name: str, mesh, sequence_parallel: bool = False) -> torch.nn.Module:
    from gpt import parallelize

    model = build_model(name)
    if name.startswith("gpt"):
        return parallelize(model, mesh["tp"], sequence_parallel)
    return zcompile.apply_tp_plan(
        model, mesh["tp"]
    )  # the Llama's declared plan: q/k/v, gate/up colwise; o, down rowwise


def _train(spec: RunSpec, mesh, sequence_parallel: bool = False) -> tuple[dict, tuple]:
    """``spec`` trained on this rank of the dp x tp mesh: losses (mean over dp), pre-clip norms, the
    full weights afterwards and the model states' bytes on this rank with the formula's Ψ (the
    elements of this rank's pieces); and the model and optimizer."""
    from torch.distributed.tensor import DTensor

    torch._dynamo.reset()
    model = _tensor_parallel_model(spec.model, mesh, sequence_parallel)
    options = {"stage": spec.stage, "compiler": "eager", "mesh": mesh, **spec.options}
    compiled = torch.compile(model, backend="zero", options=options)
    estimate = zcompile.estimate_memory(model, WORLD, {"stage": spec.stage, "mesh": mesh})  # before compiling
    optimizer = _optimizer(spec, model.parameters(), zero=True)
    dp_rank = mesh["dp"].get_local_rank()
    losses, norms = [], []
    for step in range(spec.steps):
        step_loss = torch.zeros(())
        for tokens, targets in micro_batches(spec, step, dp_rank, DP):
            loss = model_loss(spec.model, compiled, tokens, targets) / spec.grad_accum
            loss.backward()
            step_loss += loss.detach()
        # with the gradients, as ZeRO counts (stage 1's clipping reduces them early: before it)
        state_bytes = zcompile.model_state_bytes(model, optimizer).total
        norm = _clip_before_step(spec, model, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        if norm is not None:
            norms.append(norm)
        dist.all_reduce(step_loss, group=mesh["dp"].get_group())
        losses.append(float(step_loss) / DP)
    report = zcompile.step_report(model, optimizer)
    params = _full_weights(model)
    local_elements = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    return {
        "losses": losses,
        "norms": norms,
        "params": params,
        "state_bytes": state_bytes,
        "estimated_state_bytes": estimate.model_states_bytes,
        "psi": local_elements,
        "report": (report.title(), report.num_params, report.memory, report.collective_rows()),
        "report_totals": (report.totals.get("total", 0), report.formula_elements, report.tensor_parallel_elements),
    }, (model, optimizer)


def _full_weights(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    with zcompile.gathered(model):
        return {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()
        }


def _one_step(spec: RunSpec, compiled, optimizer, step: int, dp) -> float:
    """One optimizer step on this rank's slice of the global batch of ``step``; the global loss.
    ``dp``: the (sub-)mesh of the data-parallel ranks (None: the whole world)."""
    dp_rank, dp_size = (dp.get_local_rank(), dp.size()) if dp is not None else (dist.get_rank(), dist.get_world_size())
    ((tokens, targets),) = micro_batches(spec, step, dp_rank, dp_size)
    loss = model_loss(spec.model, compiled, tokens, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    loss = loss.detach()
    dist.all_reduce(loss, group=dp.get_group() if dp is not None else None)
    return loss.item() / dp_size


# the checkpoint round trip: dp x tp layouts (None: plain data parallelism over the world, no mesh) and stages
ROUND_TRIP = ((None, 3), ((1, 4), 1), ((2, 2), 3))


def _round_trip(meshes: dict, trained, optimizer, directory: str) -> dict:
    """``trained`` (dp 2 x tp 2, its spec's steps) and its optimizer saved with torch.distributed.checkpoint
    from their state dicts, then loaded into each layout of ``ROUND_TRIP`` in turn (a fresh model compiled
    there, a step of its own to load into), which trains the next step and saves for the next layout with
    ``zcompile.checkpoint.save`` (loaded by ``zcompile.checkpoint.load``); and ``trained`` itself trains
    those steps uninterrupted. Also the dict form of zcompile.checkpoint.save, which refuses its DTensors."""
    import torch.distributed.checkpoint as dcp

    spec = SPECS["stage2"]
    state = {"model": trained.state_dict(), "optimizer": optimizer.state_dict()}
    kinds = {type(value).__name__ for value in state["model"].values()}
    dcp.save(state, checkpoint_id=f"{directory}/0")
    saved, loaded, resumed = [_full_weights(trained)], [], []
    try:
        zcompile.checkpoint.save(directory + "-dict", state)
        refused = ""
    except zcompile.checkpoint.CheckpointError as error:
        refused = str(error)
    try:  # its shards are pieces: the weights would be tp rank 0's
        zcompile.checkpoint.full_state_dict(trained)
        refused_full = ""
    except zcompile.checkpoint.CheckpointError as error:
        refused_full = str(error)
    torch._dynamo.reset()
    options = {"stage": spec.stage, "compiler": "eager", "mesh": meshes[DP, TP]}
    trained_compiled = torch.compile(trained, backend="zero", options=options)
    dp = meshes[DP, TP]["dp"]
    continued = [_one_step(spec, trained_compiled, optimizer, spec.steps + i, dp) for i in range(len(ROUND_TRIP))]
    for index, (shape, stage) in enumerate(ROUND_TRIP):
        torch._dynamo.reset()
        mesh = meshes[shape] if shape is not None else None
        model = _tensor_parallel_model(spec.model, mesh) if mesh is not None else build_model(spec.model)
        options = {"stage": stage, "compiler": "eager", **({"mesh": mesh} if mesh is not None else {})}
        compiled = torch.compile(model, backend="zero", options=options)
        model_optimizer = _optimizer(spec, model.parameters(), zero=True)
        dp = mesh["dp"] if mesh is not None else None
        _one_step(spec, compiled, model_optimizer, 0, dp)  # state to load into
        if index == 0:
            state = {"model": model.state_dict(), "optimizer": model_optimizer.state_dict()}
            dcp.load(state, checkpoint_id=f"{directory}/{index}")
            model.load_state_dict(state["model"])
            model_optimizer.load_state_dict(state["optimizer"])
        else:
            zcompile.checkpoint.load(f"{directory}/{index}", model, model_optimizer)
        loaded.append(_full_weights(model))
        resumed.append(_one_step(spec, compiled, model_optimizer, spec.steps + index, dp))
        saved.append(_full_weights(model))
        zcompile.checkpoint.save(f"{directory}/{index + 1}", model, model_optimizer)
    # the first save's optimizer from one file (torch's dcp_to_torch_save: full flat tensors), its weights by DCP
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    one_file = f"{directory}/one-{dist.get_rank()}.pt"
    dcp_to_torch_save(f"{directory}/0", one_file)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=f"{directory}/0")
    model.load_state_dict(state["model"])
    model_optimizer.load_state_dict(torch.load(one_file, weights_only=False)["optimizer"])
    from_one_file = _one_step(spec, compiled, model_optimizer, spec.steps, dp)
    return {
        "directory": directory,
        "kinds": kinds,
        "saved": saved[:-1],
        "loaded": loaded,
        "losses": (continued, resumed),
        "from_one_file": from_one_file,
        "weights": (_full_weights(trained), saved[-1]),
        "refused": refused,
        "refused_full": refused_full,
    }


def _first_step_error(mesh, model, name: str = SPECS["stage2"].model) -> tuple[str, float]:
    """The error of ``model``'s first compiled step (stage 3), and the seconds it took."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "compiler": "eager", "mesh": mesh})
    ((tokens, targets),) = micro_batches(SPECS["stage2"], 0, mesh["dp"].get_local_rank(), mesh["dp"].size())
    start = time.monotonic()
    try:
        model_loss(name, compiled, tokens, targets).backward()
        error = ""
    except Exception as raised:  # noqa: BLE001 - the text is what is tested
        error = f"{type(raised).__name__}: {raised}"
    seconds = time.monotonic() - start
    dist.barrier()
    return error, seconds


def _state_dict_on_some_ranks(mesh, optimizer) -> tuple[str, float]:
    """``optimizer.state_dict()`` on the ranks of tp rank 0 only (a DDP script's ``if rank == 0``): its
    row-wise weights' pieces are gathered over dp and tp, which the other ranks would never join."""
    optimizer.check_timeout_s = 5.0
    start = time.monotonic()
    error = ""
    if mesh["tp"].get_local_rank() == 0:
        try:
            optimizer.state_dict()
        except Exception as raised:  # noqa: BLE001 - the text is what is tested
            error = f"{type(raised).__name__}: {raised}"
    seconds = time.monotonic() - start
    dist.barrier()
    return error, seconds


def _evaluation_on_some_ranks(mesh) -> str:
    """A training step, then an evaluation on the ranks of tp rank 0 only (``if rank % tp == 0``: both dp
    groups agree among themselves) while their tp peers go on training: their tensor-parallel collectives
    would pair with the peers' training forward. Stage 1, where the dp group agrees only at the step."""
    torch._dynamo.reset()
    spec = SPECS["stage2"]
    model = _tensor_parallel_model(spec.model, mesh)
    compiled = torch.compile(model, backend="zero", options={"stage": 1, "compiler": "eager", "mesh": mesh})
    optimizer = _optimizer(spec, model.parameters(), zero=True)
    ((tokens, targets),) = micro_batches(spec, 0, mesh["dp"].get_local_rank(), DP)
    with torch.no_grad():  # every rank evaluates once: each has the evaluation graph compiled
        model_loss(spec.model, compiled, tokens, targets)
    try:
        _one_step(spec, compiled, optimizer, 0, mesh["dp"])
        if mesh["tp"].get_local_rank() == 0:
            with torch.no_grad():
                model_loss(spec.model, compiled, tokens, targets)
        _one_step(spec, compiled, optimizer, 1, mesh["dp"])
        error = ""
    except Exception as raised:  # noqa: BLE001 - the text is what is tested
        error = f"{type(raised).__name__}: {raised}"
    dist.barrier()
    return error


def _scaled_training(mesh) -> dict:
    """Stage 3 at dp 2 x tp 2 under torch's GradScaler, unscale_ then clip, the last dp rank's loss
    infinite at one step (``support.scaled_training``); SGD with momentum, which an unscale off by
    any factor would move."""
    torch._dynamo.reset()
    model = _tensor_parallel_model("gpt_split_qkv", mesh)
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "compiler": "eager", "mesh": mesh})
    optimizer = zcompile.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dp = mesh["dp"]
    run = scaled_loop(
        model, lambda step: scaled_loss(compiled, step, dp.get_local_rank(), dp.size()), optimizer, clip=True
    )
    run["params"] = _full_weights(model)
    return run


def _on_rank(rank: int, world: int, directory: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {
        shape: init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp")) for shape in ((DP, TP), (1, 4), (4, 1))
    }
    mesh = meshes[DP, TP]
    out, kept = {}, {}
    for name, spec in SPECS.items():
        out[name], kept[name] = _train(spec, mesh, name in SEQUENCE_PARALLEL)
    out["resume"] = _round_trip(meshes, *kept["stage2"], directory)
    out["grad_scaler"] = _scaled_training(mesh)
    stage3_optimizer = kept["stage3"][1]
    del kept
    # meshes of different shapes on different ranks; tensor parallelism applied on some ranks only
    other = meshes[WORLD, 1]
    mine = mesh if rank < 2 else other
    name = SPECS["stage2"].model
    out["mesh_shapes_differ"] = _first_step_error(mine, _tensor_parallel_model(name, mine))
    out["some_ranks_tp"] = _first_step_error(
        mesh, _tensor_parallel_model(name, mesh) if rank < 2 else build_model(name)
    )
    # tp 4 splits the Llama's 2 key-value heads of 8 features into pieces of 4
    out["heads_not_divided"] = _first_step_error(
        meshes[1, 4], _tensor_parallel_model("hf_llama", meshes[1, 4]), "hf_llama"
    )
    out["evaluation_on_some_ranks"] = _evaluation_on_some_ranks(mesh)
    out["state_dict_on_some_ranks"] = _state_dict_on_some_ranks(mesh, stage3_optimizer)  # last: ranks diverge
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(WORLD, _on_rank, str(tmp_path_factory.mktemp("tp")), timeout_s=900)


@pytest.mark.parametrize("name", list(SPECS))
def test_trains_like_a_single_process_on_the_global_batch(ranks, name):
    assert_trains_like_one_process([rank[name] for rank in ranks], SPECS[name])


def test_grad_scaler_unscales_clips_and_skips_a_one_rank_overflow_like_one_process(ranks):
    """The loss-scaling loop at stage 3, dp 2 x tp 2, against one process's on the global batch: the same
    scales (the overflow on one data-parallel rank skipped on every rank, the scale halved), pre-clip
    norms (over dp and tp, each element once) and weights."""
    expected = scaled_reference(DP, clip=True, model_name="gpt_split_qkv")
    assert expected["scales"] == [INIT_SCALE, INIT_SCALE / 2, INIT_SCALE / 2, INIT_SCALE / 2]
    for rank in ranks:
        run = rank["grad_scaler"]
        assert run["scales"] == expected["scales"]
        for ours, theirs in zip(run["norms"], expected["norms"], strict=True):
            assert math.isfinite(ours) == math.isfinite(theirs)
            if math.isfinite(theirs):
                assert ours == pytest.approx(theirs, rel=1e-5)
        for name, value in expected["params"].items():
            torch.testing.assert_close(
                run["params"][name], value, rtol=0, atol=PARAM_TOL * max(1.0, value.abs().max().item()), msg=name
            )


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_model_states_per_rank_are_zeros_formula_over_dp_on_the_pieces(ranks, stage):
    for result in ranks:
        ours = result[f"stage{stage}"]
        expected = zcompile.zero_formula_bytes(ours["psi"], DP, stage)
        assert abs(ours["state_bytes"] - expected) <= 0.02 * expected, (ours["state_bytes"], expected)
        assert ours["estimated_state_bytes"] == ours["state_bytes"]  # estimate_memory on the pieces, before compiling


@pytest.mark.parametrize("stage", [1, 3])
def test_the_step_report_counts_the_pieces_and_names_the_groups(ranks, stage):
    for result in ranks:
        ours = result[f"stage{stage}"]
        title, psi, memory, rows = ours["report"]
        assert "4 ranks as dp 2 x tp 2" in title and psi == ours["psi"]
        assert memory["formula_bytes"] == zcompile.zero_formula_bytes(ours["psi"], DP, stage)
        kinds = {(where, kind) for where, kind, *_ in rows}
        # the row-parallel layers' sums, the model's own (reduce-scattered over the sequence with sequence parallelism)
        summed = "reduce_scatter" if f"stage{stage}" in SEQUENCE_PARALLEL else "all_reduce"
        assert ("forward", f"{summed} [tp 2]") in kinds, kinds
        gathers = ("forward", "all_gather [dp 2]") if stage == 3 else ("optimizer", "all_gather [dp 2]")
        assert gathers in kinds, kinds
        # ZeRO's traffic against its formula on the pieces; the model's tp collectives counted apart
        total, formula, tensor_parallel = ours["report_totals"]
        if stage == 3:  # each micro-batch gathers every piece, re-gathers (at most) and reduce-scatters it
            accum = SPECS["stage3"].grad_accum
            assert 2 * psi * accum < total <= formula * accum, (total, formula, psi)
        assert tensor_parallel > 0


def test_state_dicts_saved_with_dcp_move_between_layouts_like_an_uninterrupted_run(ranks):
    """dp 2 x tp 2 -> 4 ranks without tensor parallelism -> dp 1 x tp 4 -> dp 2 x tp 2, a step at each
    (DCP's state dicts for the first move, zcompile.checkpoint for the others)."""
    for result in (rank["resume"] for rank in ranks):
        assert "DTensor" in result["kinds"]
        for saved, loaded in zip(result["saved"], result["loaded"]):  # the loaded weights are the saved ones
            for name, value in loaded.items():
                torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=name)
        continued, resumed = result["losses"]
        for a, b in zip(continued, resumed):
            assert abs(a - b) <= 1e-6 * abs(a), result["losses"]
        # the first save's optimizer loaded from one file of full tensors (dcp_to_torch_save) at dp 2 x tp 2
        assert abs(result["from_one_file"] - continued[0]) <= 1e-6 * abs(continued[0])
        continued, resumed = result["weights"]  # the optimizer's moments and step moved too
        for name, value in resumed.items():
            torch.testing.assert_close(value, continued[name], rtol=0, atol=1e-6, msg=name)


def test_zcompile_checkpoint_consolidates_a_tensor_parallel_save_to_the_single_process_weights(ranks, tmp_path):
    """The save at dp 1 x tp 4 after 4 steps (2 at dp 2 x tp 2, one on 4 ranks without tensor
    parallelism, one at dp 1 x tp 4), made one file by zcompile.checkpoint.consolidate: the single
    process's weights after 4 steps."""
    from zcompile.checkpoint.consolidate import consolidate

    consolidate(f"{ranks[0]['resume']['directory']}/2", tmp_path / "one.pt")
    weights = torch.load(tmp_path / "one.pt", weights_only=True)
    spec = RunSpec(model="gpt_split_qkv", stage=2, steps=4)
    reference = train_reference(spec)
    atol = spec.steps * spec.lr * GRAD_ABS_ERROR / ADAM_EPS  # Adam's steps on rounding-level gradients
    for name, expected in reference.params.items():
        torch.testing.assert_close(weights[name], expected, rtol=0, atol=atol, msg=name)


def test_a_checkpoint_consolidates_to_the_single_process_weights_and_moments(ranks, tmp_path):
    """The dp 2 x tp 2 save, made one file by torch's ``dcp_to_torch_save``: each weight and each Adam
    moment is the single process's, in the weight's own order (a row-wise split weight's too)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(f"{ranks[0]['resume']['directory']}/0", tmp_path / "one.pt")
    consolidated = torch.load(tmp_path / "one.pt", weights_only=False)
    spec = SPECS["stage2"]
    reference = train_reference(spec)
    weight_atol = spec.steps * spec.lr * GRAD_ABS_ERROR / ADAM_EPS  # Adam's steps on rounding-level gradients
    state = consolidated["optimizer"]["state"]
    for index, (name, expected) in enumerate(reference.params.items()):
        torch.testing.assert_close(consolidated["model"][name], expected, rtol=0, atol=weight_atol, msg=name)
        for key, theirs in reference.optimizer_state[name].items():
            if theirs.dim() == 0:  # the step
                continue
            ours = state.get(str(index), state.get(index))[key].view(expected.shape)
            # the ranks' sums of the gradients round apart from one process's: 1e-4 of the moment's scale
            atol = 1e-4 * theirs.abs().max().item() + 1e-10
            torch.testing.assert_close(ours, theirs, rtol=0, atol=atol, msg=f"{name} {key}")


def test_the_dict_form_and_full_state_dict_refuse_tensor_parallel_pieces_naming_the_routes(ranks):
    for result in (rank["resume"] for rank in ranks):
        assert "DTensors of a tensor-parallel model" in result["refused"]
        assert "zcompile.checkpoint.save(path, model, optimizer)" in result["refused"]
        assert "full_state_dict" in result["refused_full"] and "model.state_dict()" in result["refused_full"]


def test_meshes_of_different_shapes_are_an_error_on_every_rank(ranks):
    for result in ranks:
        error, seconds = result["mesh_shapes_differ"]
        assert "RankDivergenceError" in error and seconds < 30
        assert "per rank: {0: [2, 2, None], 1: [2, 2, None], 2: [4, 1, None], 3: [4, 1, None]}" in error


def test_tensor_parallelism_on_some_ranks_only_is_an_error_on_every_rank(ranks):
    for result in ranks:
        error, seconds = result["some_ranks_tp"]
        assert "RankDivergenceError" in error and "blocks.0.attn.q.weight" in error and seconds < 30
        assert "shape [16, 32]" in error and "shape [32, 32]" in error


def test_a_tp_degree_that_does_not_divide_the_heads_is_an_error_on_every_rank(ranks):
    """The model's own reshape into heads fails in Dynamo's trace, as it would without zcompile (torch's
    error, with its hint to run eagerly), on every rank: no rank goes on to wait in a collective."""
    for result in ranks:
        error, seconds = result["heads_not_divided"]
        assert "is invalid for input of size" in error and seconds < 30, error


def test_an_optimizer_state_dict_made_on_some_ranks_only_is_an_error_not_a_wait(ranks):
    for rank, result in enumerate(ranks):
        error, seconds = result["state_dict_on_some_ranks"]
        if rank % TP == 0:  # the ranks that called it: the others named, in seconds
            assert error.startswith("RankDivergenceError") and "state_dict()" in error and seconds < 30, error
            assert "Call it on every rank" in error


def test_an_evaluation_on_some_tensor_parallel_ranks_only_is_an_error_on_every_rank(ranks):
    for result in ranks:  # the evaluation graph compiled on every rank before: each call is agreed over the world
        error = result["evaluation_on_some_ranks"]
        assert error.startswith("RankDivergenceError") and "different points of training" in error, error
