"""Sharded checkpoints (``zcompile.checkpoint``): resume exactly, reshard across world sizes and stages,
consolidate to a plain model, and fail clearly on every rank on bad input.

Three launches share one directory: 2 ranks (train, save, resume, consolidate, bad inputs), then
4 ranks (resume the 2-rank checkpoint at another stage; save a 4-rank one), then 2 ranks again
(resume the 4-rank checkpoint). Resuming at the same world size and stage replays the same
arithmetic, so its losses are compared bitwise. Across world sizes the batch is split into other
micro-batches and the gradient sum runs in another order: about 1e-7 relative per step, so
losses are compared at 1e-6 relative (``LOSS_RTOL``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import zcompile
import zcompile.checkpoint as ckpt_package
import zcompile.checkpoint.dcp as ckpt
from support.launch import run_ranks
from support.models import build_model
from support.training import LOSS_RTOL, RunSpec, _optimizer, train_reference, train_steps
from zcompile.agreement.abort_note import RankDivergenceError
from zcompile.checkpoint.checksums import RECORD_FILE
from zcompile.checkpoint.consolidate import consolidate
from zcompile.cli.commands import main as cli_main

STEPS = 6
HALF = STEPS // 2


def _fresh(name: str, stage: int):
    torch._dynamo.reset()
    model = build_model(name)
    spec = RunSpec(model=name, stage=stage, steps=STEPS)
    optimizer = _optimizer(spec, model.parameters(), zero=True)
    return model, torch.compile(model, backend="zero", options={"stage": stage}), optimizer, spec


def _fresh_frozen(stage: int):
    """The gpt with everything but its second block frozen (a fine-tuning run's base model, as LoRA's),
    the optimizer over what trains."""
    model, compiled, _, spec = _fresh("gpt", stage)
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith(FROZEN_RUN_TRAINS))
    optimizer = _optimizer(spec, [p for p in model.parameters() if p.requires_grad], zero=True)
    return model, compiled, optimizer, spec


FROZEN_RUN_TRAINS = "blocks.1."


def _params(model) -> dict[str, torch.Tensor]:
    with zcompile.gathered(model):
        return {name: p.detach().float().clone() for name, p in model.named_parameters()}


def _error_of(fn) -> str | None:
    try:
        fn()
    except ckpt.CheckpointError as error:
        return str(error)
    return None


def first_launch(rank: int, world: int, root: str) -> dict:
    """2 ranks: uninterrupted runs, a save at step 3, resumes, consolidation input, bad inputs."""
    out = {}
    for name in ("gpt", "hf_llama"):
        model, compiled, optimizer, spec = _fresh(name, 3)
        out[f"{name}_full"] = train_steps(spec, compiled, optimizer, range(STEPS), rank, world)
        if name == "gpt":
            out["gpt_params"] = _params(model)
            out["full_state_dict"] = ckpt.full_state_dict(compiled)
            ckpt.save(os.path.join(root, "gpt_end"), compiled, optimizer)
            # a complete checkpoint where the background save below goes: that one replaces it whole
            ckpt.save(os.path.join(root, "gpt_2r"), compiled, optimizer, extra={"rank": rank, "step": STEPS})
        model, compiled, optimizer, spec = _fresh(name, 3)
        train_steps(spec, compiled, optimizer, range(HALF), rank, world)
        written = ckpt.save(
            os.path.join(root, f"{name}_2r"),
            compiled,
            optimizer,
            extra={"rank": rank, "step": HALF},
            async_save=name == "gpt",
        )  # staged now, written in the background
        if name == "gpt":
            train_steps(spec, compiled, optimizer, range(HALF, STEPS), rank, world)  # training goes on meanwhile
            written.result()
            out["left_beside"] = sorted(f for f in os.listdir(root) if f.startswith("gpt_2r."))
    # resume at the same world size and stage: before compile, and into a model that has run a step
    model, compiled, optimizer, spec = _fresh("gpt", 3)
    out["extra"] = ckpt.load(os.path.join(root, "gpt_2r"), model, optimizer)
    out["resumed_before_compile"] = train_steps(spec, compiled, optimizer, range(HALF, STEPS), rank, world)
    model, compiled, optimizer, spec = _fresh("gpt", 3)
    train_steps(spec, compiled, optimizer, [STEPS + 1], rank, world)  # compiled, sharded, state moved on
    ckpt.load(os.path.join(root, "gpt_2r"), compiled, optimizer)
    out["resumed_after_compile"] = train_steps(spec, compiled, optimizer, range(HALF, STEPS), rank, world)
    out.update(_frozen_runs(rank, world, root))
    # bad inputs: another model, a truncated file, no directory; the model must stay as it was
    other, other_compiled, other_optimizer, _ = _fresh("gpt_untied_odd", 3)
    before = _params(other)
    broken = os.path.join(root, "broken")  # one copy, truncated by rank 0 (every rank must load one path)
    if rank == 0:
        shutil.copytree(os.path.join(root, "gpt_2r"), broken)
        for file in sorted(os.listdir(broken)):
            if file.endswith(".distcp"):
                with open(os.path.join(broken, file), "r+b") as handle:
                    handle.truncate(os.path.getsize(os.path.join(broken, file)) // 2)
        # bytes overwritten inside a tensor of rank 1's file, and inside the metadata (the background
        # save's checkpoint: its record is written on DCP's thread)
        for what, file in (("overwritten", "__1_0.distcp"), ("metadata_overwritten", ".metadata")):
            copy = os.path.join(root, what)
            shutil.copytree(os.path.join(root, "gpt_2r"), copy)
            _overwrite_in_the_middle(copy, file)
    dist.barrier()
    model, compiled, optimizer, _ = _fresh("gpt", 3)
    untouched = _params(model)
    out["errors"] = {
        "other_model": _error_of(lambda: ckpt.load(os.path.join(root, "gpt_2r"), other, other_optimizer)),
        "truncated": _error_of(lambda: ckpt.load(broken, model, optimizer)),
        "missing": _error_of(lambda: ckpt.load(os.path.join(root, "nowhere"), model, optimizer)),
        "overwritten": _error_of(lambda: ckpt.load(os.path.join(root, "overwritten"), model, optimizer)),
        "metadata_overwritten": _error_of(
            lambda: ckpt.load(os.path.join(root, "metadata_overwritten"), model, optimizer)
        ),
    }
    out["other_untouched"] = all(torch.equal(before[k], v) for k, v in _params(other).items())
    out["model_untouched"] = all(torch.equal(untouched[k], v) for k, v in _params(model).items())
    out["divergent"] = _divergent_calls(rank, world, root, model, optimizer)
    return out


def _frozen_runs(rank: int, world: int, root: str) -> dict:
    """A run whose base is frozen: checkpoints without it (``exclude_frozen_parameters``), resumed;
    its trained weights alone (``full_state_dict``); a resume onto other base weights refused."""
    out = {}
    model, compiled, optimizer, spec = _fresh_frozen(3)
    out["frozen_full"] = train_steps(spec, compiled, optimizer, range(STEPS), rank, world)
    model, compiled, optimizer, spec = _fresh_frozen(3)
    train_steps(spec, compiled, optimizer, range(HALF), rank, world)
    ckpt.save(os.path.join(root, "frozen_2r"), compiled, optimizer, exclude_frozen_parameters=True)
    out["frozen_saved"] = sorted(
        k
        for k in dcp.FileSystemReader(os.path.join(root, "frozen_2r")).read_metadata().state_dict_metadata
        if k.startswith("model/")
    )
    out["frozen_trained_only"] = ckpt.full_state_dict(compiled, exclude_frozen_parameters=True)
    out["frozen_params"] = _params(model)
    model, compiled, optimizer, spec = _fresh_frozen(3)
    ckpt.load(os.path.join(root, "frozen_2r"), compiled, optimizer)
    out["frozen_resumed"] = train_steps(spec, compiled, optimizer, range(HALF, STEPS), rank, world)
    model, compiled, optimizer, spec = _fresh_frozen(2)  # other base weights: one frozen weight differs
    train_steps(spec, compiled, optimizer, [STEPS + 1], rank, world)  # compiled, and its trained weights moved on
    with torch.no_grad(), zcompile.gathered(model):
        model.ln_f.weight.add_(1e-3)
    before = _params(model)
    out["frozen_other_base"] = _error_of(lambda: ckpt.load(os.path.join(root, "frozen_2r"), compiled, optimizer))
    out["frozen_other_base_untouched"] = all(torch.equal(before[k], v) for k, v in _params(model).items())
    # one rank's copy differs, in the slice another rank would own: a load before the compile (whole
    # copies, not shards yet) must see it on that rank and stop both
    model, compiled, optimizer, spec = _fresh_frozen(3)
    if rank == 1:
        with torch.no_grad():
            model.ln_f.weight[0] += 1e-3
    out["frozen_other_base_one_rank"] = _error_of(
        lambda: ckpt.load(os.path.join(root, "frozen_2r"), compiled, optimizer)
    )
    return out


def _divergent_calls(rank, world, root, model, optimizer) -> dict[str, str | None]:
    """Rank-divergent checkpoint calls: an error in seconds on the ranks that made them, never a wait."""

    def outcome(fn):
        try:
            fn()
        except (ckpt.CheckpointError, RankDivergenceError) as error:
            return f"{type(error).__name__}: {error}"
        return None

    # a path made per rank: one directory each and no checkpoint; refused on every rank
    out = {"per_rank_path": outcome(lambda: ckpt.save(os.path.join(root, f"mine_{rank}"), model, optimizer))}
    out["per_rank_path_wrote"] = any(
        os.path.exists(os.path.join(root, f"mine_{r}")) and os.listdir(os.path.join(root, f"mine_{r}"))
        for r in range(world)
    )
    # a parameter frozen on one rank only: the ranks would leave out different tensors; refused on both
    frozen_here = next(iter(model.parameters()))
    frozen_here.requires_grad_(rank != 1)
    out["frozen_on_one_rank"] = outcome(
        lambda: ckpt.save(os.path.join(root, "frozen_one"), model, optimizer, exclude_frozen_parameters=True)
    )
    frozen_here.requires_grad_(True)
    # checksums off on one rank only: a record without that rank's files would refuse every load of it
    out["checksums_on_one_rank"] = outcome(
        lambda: ckpt.save(os.path.join(root, "checksums_one"), model, optimizer, checksums=rank != 1)
    )
    out["checksums_on_one_rank_wrote"] = os.path.exists(os.path.join(root, "checksums_one"))
    # rank 1 alone finding another checkpoint at the path (what a filesystem not shared by the ranks shows after
    # a save stopped while it swapped in): each rank would read its own checkpoint; refused on both
    real_readable = ckpt.readable_checkpoint
    if rank == 1:
        ckpt.readable_checkpoint = lambda path: os.path.join(root, "gpt_end")
    before = _params(model)
    try:
        out["read_differs"] = outcome(lambda: ckpt.load(os.path.join(root, "gpt_2r"), model, optimizer))
    finally:
        ckpt.readable_checkpoint = real_readable
    out["read_differs_untouched"] = all(torch.equal(before[k], v) for k, v in _params(model).items())
    # the last calls on this group: after a lone call the ranks' call counts differ (the job would stop)
    start = time.perf_counter()
    if rank == 0:  # `if rank == 0: save(...)`, the torch.save habit
        out["lone_save"] = outcome(lambda: ckpt.save(os.path.join(root, "lone"), model, optimizer, timeout_s=3))
    out["seconds"] = time.perf_counter() - start
    return out


def second_launch(rank: int, world: int, root: str) -> dict:
    """4 ranks: resume the 2-rank checkpoints (gpt at stage 2, llama at stage 3); save a 4-rank one."""
    out = {}
    model, compiled, optimizer, spec = _fresh("gpt", 2)
    out["extra"] = ckpt.load(os.path.join(root, "gpt_2r"), compiled, optimizer)
    out["gpt"] = train_steps(spec, compiled, optimizer, range(HALF, STEPS), rank, world)
    model, compiled, optimizer, spec = _fresh("hf_llama", 3)
    ckpt.load(os.path.join(root, "hf_llama_2r"), compiled, optimizer)
    out["hf_llama"] = train_steps(spec, compiled, optimizer, range(HALF, STEPS), rank, world)
    model, compiled, optimizer, spec = _fresh_frozen(2)  # the frozen base's values, cut in 4 now, still match
    ckpt.load(os.path.join(root, "frozen_2r"), compiled, optimizer)
    out["frozen"] = train_steps(spec, compiled, optimizer, range(HALF, STEPS), rank, world)
    model, compiled, optimizer, spec = _fresh("gpt", 3)
    out["gpt_full_4r"] = train_steps(spec, compiled, optimizer, range(HALF), rank, world)
    ckpt.save(os.path.join(root, "gpt_4r"), compiled, optimizer)
    out["gpt_full_4r"] += train_steps(spec, compiled, optimizer, range(HALF, STEPS), rank, world)
    return out


def third_launch(rank: int, world: int, root: str) -> dict:
    """2 ranks: resume the 4-rank checkpoint; weights given new storage and saved at stages 1 and 2."""
    model, compiled, optimizer, spec = _fresh("gpt", 3)
    ckpt.load(os.path.join(root, "gpt_4r"), model, optimizer)
    out = {"gpt": train_steps(spec, compiled, optimizer, range(HALF, STEPS), rank, world)}
    for stage in (1, 2):
        model, compiled, optimizer, spec = _fresh("gpt", stage)
        train_steps(spec, compiled, optimizer, [0], rank, world)
        name, weight = next((n, p) for n, p in model.named_parameters() if p.dim() == 2)
        weight.data = torch.full_like(weight, 0.25)  # weights loaded by `.data =` after a step, saved before the next
        full = ckpt.full_state_dict(compiled)  # every rank calls it; rank 0 gets the weights
        out[f"new_storage_saved_{stage}"] = bool((full[name] == 0.25).all()) if rank == 0 else True
    return out


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("checkpoints"))
    first = run_ranks(2, first_launch, root, timeout_s=600)
    second = run_ranks(4, second_launch, root, timeout_s=600)
    third = run_ranks(2, third_launch, root, timeout_s=600)
    return root, first, second, third


def _close(a: list[float], b: list[float]) -> bool:
    return all(abs(x - y) <= LOSS_RTOL * abs(y) for x, y in zip(a, b, strict=True))


def test_read_extra_reads_each_ranks_extra_without_a_model(launches):
    """``read_extra``: what a script needs before it builds its model (nanoGPT's model_args), per rank,
    with no process group; a rank the save did not have is a clear error."""
    root = launches[0]
    for rank in (0, 1):
        assert ckpt_package.read_extra(os.path.join(root, "gpt_2r"), rank) == {"rank": rank, "step": HALF}
    with pytest.raises(ckpt.CheckpointError, match="no extra of rank 2"):
        ckpt_package.read_extra(os.path.join(root, "gpt_2r"), 2)


def test_resume_same_world_is_bitwise(launches):
    _, first, _, _ = launches
    for rank, result in enumerate(first):
        full = result["gpt_full"]
        assert result["resumed_before_compile"] == full[HALF:]
        assert result["resumed_after_compile"] == full[HALF:]
        assert result["extra"] == {"rank": rank, "step": HALF}  # the background save replaced the step-6 one
        assert result["left_beside"] == []  # nor its staging directory nor the replaced one left


def _weights(model) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _moved(model, by: float) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        for param in model.parameters():
            param.add_(by)
    return _weights(model)


def _same(model, weights) -> bool:
    return all(torch.equal(value, weights[name]) for name, value in model.state_dict().items())


def test_a_save_stopped_part_way_leaves_the_last_checkpoint_whole(tmp_path, monkeypatch):
    """A save over the last checkpoint that stops while DCP writes (a preemption): the last checkpoint
    loads as it was saved. DCP writes in place, so before zcompile.checkpoint.commit it was cut (and with
    one rank's file rewritten and another's not yet, a mix of two steps loaded without an error)."""
    path = str(tmp_path / "latest")
    model = build_model("gpt")
    ckpt.save(path, model)
    saved = _weights(model)
    _moved(model, 1.0)
    real_save = dcp.save

    def stopped(state, checkpoint_id, **kwargs):  # the files written, then half of each gone, then the stop
        real_save(state, checkpoint_id=checkpoint_id, **kwargs)
        for file in os.listdir(checkpoint_id):
            if file.endswith(".distcp"):
                with open(os.path.join(checkpoint_id, file), "r+b") as handle:
                    handle.truncate(os.path.getsize(os.path.join(checkpoint_id, file)) // 2)
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.dcp, "save", stopped)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(path, model)
    monkeypatch.undo()
    ckpt.load(path, model)
    assert _same(model, saved)
    # the next save clears what the stopped one left and replaces the checkpoint
    later = _moved(model, 2.0)
    ckpt.save(path, model)
    assert sorted(os.listdir(tmp_path)) == ["latest"]
    _moved(model, 1.0)
    ckpt.load(path, model)
    assert _same(model, later)


def test_a_save_into_a_directory_holding_other_files_is_refused_and_deletes_nothing(tmp_path):
    """The swap replaces the whole directory: a run's logs there (or a file at the path) would go with it."""
    model = build_model("gpt")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "log.txt").write_text("step 1")
    (tmp_path / "model.pt").write_text("weights")
    for path in (tmp_path / "run", tmp_path / "model.pt"):
        with pytest.raises(ckpt.CheckpointError, match="save into a directory of its own"):
            ckpt.save(path, model)
    assert (tmp_path / "run" / "log.txt").read_text() == "step 1" and (tmp_path / "model.pt").read_text() == "weights"
    assert sorted(os.listdir(tmp_path / "run")) == ["log.txt"]


def _save_stopped_mid_swap(path: str, model, monkeypatch) -> None:
    """A save of ``model`` to ``path`` stopped between the swap's two renames (the old checkpoint moved
    away, the new one complete in ``<path>.zcompile-saving``)."""
    real_rename = os.rename

    def rename(source, destination):
        if os.fspath(source).endswith(".zcompile-saving"):
            raise KeyboardInterrupt
        real_rename(source, destination)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(path, model)
    monkeypatch.undo()


def test_a_save_stopped_while_it_is_swapped_in_is_read_where_it_was_written(tmp_path, monkeypatch, caplog):
    """Stopped between the swap's two renames: no checkpoint at the path, the new one complete beside it.
    ``load`` and ``consolidate`` read that one (with a warning); the next save moves it into place first."""
    path = str(tmp_path / "latest")
    model = build_model("gpt")
    ckpt.save(path, model)
    newer = _moved(model, 1.0)
    _save_stopped_mid_swap(path, model, monkeypatch)
    assert not os.path.exists(path)
    _moved(model, 5.0)
    with caplog.at_level("WARNING", logger="zcompile.checkpoint.commit"):
        ckpt.load(path, model)
    assert _same(model, newer) and "a save stopped while it swapped them in" in caplog.text
    consolidate(path, str(tmp_path / "full.pt"))
    assert torch.equal(torch.load(tmp_path / "full.pt")["wte.weight"], newer["wte.weight"])
    later = _moved(model, 2.0)
    ckpt.save(path, model)
    assert sorted(os.listdir(tmp_path)) == ["full.pt", "latest"]
    ckpt.load(path, build_model("gpt"))  # a model of its own: loads the latest
    _moved(model, 1.0)
    ckpt.load(path, model)
    assert _same(model, later)


def _overwrite_in_the_middle(directory: str, file: str, nbytes: int = 64) -> str:
    """``nbytes`` overwritten in the middle of ``file`` of checkpoint ``directory`` (a bad disk): for a data
    file, inside its largest tensor, where DCP reads the changed values without an error. The file hit."""
    offset = os.path.getsize(os.path.join(directory, file)) // 2
    if file.endswith(".distcp"):
        pieces = dcp.FileSystemReader(directory).read_metadata().storage_data.values()
        largest = max((p for p in pieces if p.relative_path == file), key=lambda p: p.length)
        offset = largest.offset + largest.length // 2
    with open(os.path.join(directory, file), "r+b") as handle:
        handle.seek(offset)
        old = handle.read(nbytes)
        handle.seek(offset)
        handle.write(bytes(255 - b for b in old))
    return os.path.join(directory, file)


def _damage(directory, how: str) -> str:
    """Damages the checkpoint in ``directory`` as a crash or a bad disk would; returns the file hit."""
    data = os.path.join(directory, sorted(f for f in os.listdir(directory) if f.endswith(".distcp"))[0])
    metadata = os.path.join(directory, ".metadata")
    if how == "data cut by 1 byte":
        os.truncate(data, os.path.getsize(data) - 1)
    elif how == "data cut to half":
        os.truncate(data, os.path.getsize(data) // 2)
    elif how == "data deleted":
        os.remove(data)
    elif how == "metadata cut":
        os.truncate(metadata, 10)
        return metadata
    elif how == "data bytes overwritten":
        return _overwrite_in_the_middle(directory, os.path.basename(data))
    elif how == "metadata bytes overwritten":
        return _overwrite_in_the_middle(directory, ".metadata")
    return data


DAMAGES = [
    "data cut by 1 byte",
    "data cut to half",
    "data deleted",
    "metadata cut",
    "data bytes overwritten",
    "metadata bytes overwritten",
]


@pytest.mark.parametrize("how", DAMAGES)
def test_consolidate_names_a_damaged_checkpoint_and_writes_nothing(tmp_path, capsys, how):
    """A checkpoint cut or missing a file: ``consolidate`` raises ``CheckpointError`` naming the file and
    ``zcompile consolidate`` exits 2 with that message, no traceback and no output file (a cut of bytes that
    no tensor read asked for was consolidated as if whole; the others raised DCP's own errors). The same
    checkpoint intact consolidates to the model's weights."""
    model = build_model("gpt")
    intact, damaged = str(tmp_path / "intact"), str(tmp_path / "damaged")
    ckpt.save(intact, model)
    shutil.copytree(intact, damaged)
    hit = _damage(damaged, how)
    out = tmp_path / "full.pt"
    with pytest.raises(ckpt.CheckpointError, match="zcompile.checkpoint.consolidate: .*damaged") as raised:
        consolidate(damaged, out)
    assert hit in str(raised.value)
    assert cli_main(["consolidate", damaged, str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zcompile consolidate: error: zcompile.checkpoint.consolidate:") and "Traceback" not in err
    assert not out.exists()
    consolidate(intact, out)
    full = torch.load(out)
    assert all(torch.equal(full[name], value.detach()) for name, value in model.state_dict().items())


def test_every_file_a_save_writes_has_its_checksum_recorded(tmp_path):
    """The record lists every file DCP wrote, each with its size and the SHA-256 of its bytes (computed
    here by hashlib over the whole file), and a save is swapped in with its record."""
    path = str(tmp_path / "ck")
    ckpt.save(path, build_model("gpt"), extra={"step": 3})
    with open(os.path.join(path, RECORD_FILE)) as handle:
        record = json.load(handle)
    on_disk = sorted(name for name in os.listdir(path) if name != RECORD_FILE)
    assert record["algorithm"] == "sha256" and sorted(record["files"]) == on_disk == [".metadata", "__0_0.distcp"]
    for name, digest in record["files"].items():
        with open(os.path.join(path, name), "rb") as handle:
            data = handle.read()
        assert digest == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_bytes_overwritten_in_a_checkpoint_are_refused_and_load_nothing(tmp_path):
    """64 bytes overwritten inside a tensor (a bad disk): ``load`` refuses naming the file and the rank
    that wrote it, the model unchanged. Unverified (``verify_checksums=False``) the same checkpoint loads
    without a word and gives other weights: the check is what finds it. Saved with ``checksums=False``
    there is no record, and the checkpoint loads."""
    model = build_model("gpt")
    path, damaged = str(tmp_path / "ck"), str(tmp_path / "damaged")
    ckpt.save(path, model)
    shutil.copytree(path, damaged)
    hit = _overwrite_in_the_middle(damaged, "__0_0.distcp")
    fresh = build_model("gpt")
    before = _moved(fresh, 1.0)
    with pytest.raises(ckpt.CheckpointError, match="is damaged") as raised:
        ckpt.load(damaged, fresh)
    assert f"{hit} (written by rank 0): its bytes changed since the save" in str(raised.value)
    assert _same(fresh, before)
    ckpt.load(damaged, fresh, verify_checksums=False)
    assert not _same(fresh, _weights(model))
    ckpt.load(path, fresh)
    assert _same(fresh, _weights(model))
    unrecorded = str(tmp_path / "unrecorded")
    ckpt.save(unrecorded, model, checksums=False)
    assert RECORD_FILE not in os.listdir(unrecorded)
    _moved(fresh, 1.0)
    ckpt.load(unrecorded, fresh)
    assert _same(fresh, _weights(model))


def test_consolidate_reads_the_swap_window_as_load_does(tmp_path, monkeypatch, capsys):
    """The path gone and a complete save beside it (stopped between the swap's renames): the command
    consolidates that one, as ``load`` reads it; a path with nothing there is a clear error."""
    path = str(tmp_path / "latest")
    model = build_model("gpt")
    ckpt.save(path, model)
    newer = _moved(model, 1.0)
    _save_stopped_mid_swap(path, model, monkeypatch)
    assert not os.path.exists(path)
    assert cli_main(["consolidate", path, str(tmp_path / "full.pt")]) == 0
    assert torch.equal(torch.load(tmp_path / "full.pt")["wte.weight"], newer["wte.weight"])
    assert cli_main(["consolidate", str(tmp_path / "nowhere"), str(tmp_path / "other.pt")]) == 2
    assert "nowhere does not exist" in capsys.readouterr().err


def test_clean_saves_lists_and_removes_what_stopped_saves_left(tmp_path, capsys):
    """A directory per save (``ck/step2``, ``ck/step3``): a save stopped before its metadata leaves its
    staging directory, which no later save (another path) removes. ``zcompile clean-saves`` lists it and a
    replaced checkpoint a swap left, ``--remove`` deletes them; checkpoints, and a finished save waiting
    in the swap window, stay and still consolidate."""
    ck = tmp_path / "ck"
    model = build_model("gpt")
    ckpt.save(str(ck / "step1"), model)
    shutil.copytree(ck / "step1", ck / "step3.zcompile-saving")  # finished, path missing: the checkpoint
    stopped = ck / "step2.zcompile-saving"  # a save stopped by SIGTERM while DCP wrote
    shutil.copytree(ck / "step1", stopped)
    os.remove(stopped / ".metadata")
    shutil.copytree(ck / "step1", ck / "step0.zcompile-old")
    assert cli_main(["clean-saves", str(ck), "--plain"]) == 0
    listed = capsys.readouterr().out
    assert "step2.zcompile-saving: a save stopped before it finished" in listed
    assert "step0.zcompile-old: a replaced checkpoint" in listed and "step3" not in listed
    assert sorted(os.listdir(ck)) == ["step0.zcompile-old", "step1", "step2.zcompile-saving", "step3.zcompile-saving"]
    assert cli_main(["clean-saves", str(ck), "--remove", "--plain"]) == 0
    assert sorted(os.listdir(ck)) == ["step1", "step3.zcompile-saving"]
    assert (
        cli_main(["clean-saves", str(ck), "--plain"]) == 0
        and "nothing left by stopped saves" in capsys.readouterr().out
    )
    for path in ("step1", "step3"):
        consolidate(str(ck / path), tmp_path / f"{path}.pt")


def test_resume_on_another_world_size_and_stage(launches):
    _, first, second, third = launches
    full_2r, full_4r = first[0], second[0]["gpt_full_4r"]
    assert _close(second[0]["gpt"], full_2r["gpt_full"][HALF:])  # 2 -> 4 ranks, stage 3 -> 2
    assert _close(second[0]["hf_llama"], full_2r["hf_llama_full"][HALF:])  # 2 -> 4 ranks, Llama
    assert _close(third[0]["gpt"], full_4r[HALF:])  # 4 -> 2 ranks
    # ranks beyond the saved ones get rank 0's extra; the others their own
    assert [r["extra"]["rank"] for r in second] == [0, 1, 0, 0]


def test_full_state_dict_and_consolidated_file_equal_the_trained_weights(launches, tmp_path):
    root, first, _, _ = launches
    trained = first[0]["gpt_params"]
    full = first[0]["full_state_dict"]
    assert first[1]["full_state_dict"] is None  # rank 0 only
    for path in (tmp_path / "gpt.pt", tmp_path / "gpt.safetensors"):
        if path.suffix == ".pt":
            assert cli_main(["consolidate", os.path.join(root, "gpt_end"), str(path)]) == 0  # the command
        else:
            assert consolidate(os.path.join(root, "gpt_end"), path)["saved_world_size"] == 2
        plain = build_model("gpt")  # a plain, non-distributed model of the same architecture
        if path.suffix == ".pt":
            state = torch.load(path)
        else:
            from safetensors.torch import load_file

            state = load_file(path)
        plain.load_state_dict(state)  # strict: every key, tied names and buffers included
        for name, param in plain.named_parameters():
            assert torch.equal(param.detach(), trained[name]), name
            assert torch.equal(full[name], trained[name]), name
    reference = train_reference(RunSpec(model="gpt", stage=3, steps=STEPS), world=2)
    for name, value in reference.params.items():
        # the AdamW tolerance of support.training (6 steps at lr 1e-2, eps 1e-6)
        torch.testing.assert_close(full[name], value, rtol=0, atol=STEPS * 1e-2 * 1e-9 / 1e-6)


def test_a_weight_given_new_storage_is_what_a_checkpoint_saves(launches):
    """``p.data = loaded`` at stages 1 and 2 (the master weight lives in the parameter's own storage),
    then the full weights read before any call (``full_state_dict``; ``save`` reads them the same way):
    the loaded values; they were the old master weight's."""
    _, _, _, third = launches
    assert third[0]["new_storage_saved_1"] and third[0]["new_storage_saved_2"]


def test_rank_divergent_calls_are_errors_not_hangs(launches):
    _, first, _, _ = launches
    for result in first:
        divergent = result["divergent"]
        assert (
            "different 'path'" in divergent["per_rank_path"] and "broadcast_object_list" in divergent["per_rank_path"]
        )
        assert not divergent["per_rank_path_wrote"]
        assert "different 'frozen'" in divergent["frozen_on_one_rank"]
        assert "different 'checksums'" in divergent["checksums_on_one_rank"]
        assert not divergent["checksums_on_one_rank_wrote"]
        assert "freeze the same parameters on every rank" in divergent["frozen_on_one_rank"]
        assert "different 'read'" in divergent["read_differs"] and "every rank shares" in divergent["read_differs"]
        assert divergent["read_differs_untouched"]
    lone = first[0]["divergent"]
    assert lone["lone_save"].startswith("RankDivergenceError") and "ranks [1] did not within 3s" in lone["lone_save"]
    assert "if rank == 0" in lone["lone_save"] and lone["seconds"] < 30


def test_bad_checkpoints_fail_on_every_rank_and_change_nothing(launches):
    _, first, _, _ = launches
    for result in first:
        errors = result["errors"]
        assert "'wte.weight'" in errors["other_model"]  # the first parameter whose size differs
        assert errors["truncated"] and "__0_0.distcp (written by rank 0): " in errors["truncated"]
        assert "bytes, saved with" in errors["truncated"] and "is damaged" in errors["truncated"]
        assert "__1_0.distcp (written by rank 1): its bytes changed since the save" in errors["overwritten"]
        assert ".metadata: its bytes changed since the save" in errors["metadata_overwritten"]
        assert errors["missing"] and "nowhere" in errors["missing"]
        assert result["other_untouched"] and result["model_untouched"]


def test_a_frozen_base_is_left_out_of_checkpoints_and_kept_on_resume(launches, tmp_path):
    """``exclude_frozen_parameters``: the checkpoint holds the trained block only; resumed into a model
    built the same way it trains on as the uninterrupted run (bitwise at the same world size and
    stage; at 4 ranks and stage 2 within LOSS_RTOL, the frozen values checked after resharding); a
    model whose frozen weights differ, on every rank or in one rank's copy only, is refused on every
    rank before anything is written."""
    _, first, second, _ = launches
    trains = sorted(f"model/{name}" for name in first[0]["frozen_params"] if name.startswith(FROZEN_RUN_TRAINS))
    assert first[0]["frozen_saved"] == trains and len(trains) < len(first[0]["frozen_params"])
    for result in first:
        assert result["frozen_resumed"] == result["frozen_full"][HALF:]
        error = result["frozen_other_base"]
        assert error and "exclude_frozen_parameters=True" in error and "ln_f.weight" in error
        assert "1 of them" in error  # only the weight that differs is named
        assert result["frozen_other_base_untouched"]
        one_rank = result["frozen_other_base_one_rank"]  # rank 1's copy alone: both ranks stop
        assert one_rank and "1 of them (ln_f.weight)" in one_rank
    assert _close(second[0]["frozen"], first[0]["frozen_full"][HALF:])
    trained_only = first[0]["frozen_trained_only"]
    assert sorted(f"model/{name}" for name in trained_only) == trains and first[1]["frozen_trained_only"] is None
    for name, value in trained_only.items():
        assert torch.equal(value, first[0]["frozen_params"][name]), name
    summary = consolidate(os.path.join(launches[0], "frozen_2r"), tmp_path / "frozen.pt")  # says what it lacks
    frozen = sorted(name for name in first[0]["frozen_params"] if not name.startswith(FROZEN_RUN_TRAINS))
    assert summary["excluded_frozen"] == frozen and sorted(torch.load(tmp_path / "frozen.pt")) == sorted(trained_only)
