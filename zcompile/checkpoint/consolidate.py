"""Full (unsharded) weights: ``full_state_dict`` from a live model, ``consolidate`` from a checkpoint directory.

Both produce what a plain, non-distributed copy of the model reads with ``load_state_dict``: the
user's own keys (no ``_orig_mod.`` prefix, every name of a tied weight, persistent buffers) and
fp32 master values. Besides the result, ``full_state_dict`` holds one bucket of full weights at a
time (gathered by one collective), ``consolidate`` one tensor (read without a process group).

``exclude_frozen_parameters``: what a fine-tuning run changed (the parameters with
``requires_grad``; a LoRA adapter), without the frozen base model: ``full_state_dict`` gathers only
those, and ``consolidate`` of a checkpoint saved that way has only those (it says which it lacks).
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from zcompile.agreement.store_exchange import names_digest
from zcompile.checkpoint.checksums import RECORD_FILE, damage, data_file_ends, read_record
from zcompile.checkpoint.commit import incomplete_save_note, is_complete, readable_checkpoint
from zcompile.checkpoint.layout import (
    META_KEY,
    CheckpointError,
    agree_on_call,
    buffer_key,
    extra_key,
    from_bytes,
    param_key,
    unwrap,
)
from zcompile.common.process_group import DataParallelGroup
from zcompile.eager.gathered import gather_into_full
from zcompile.sharding.shards import shard_of

log = logging.getLogger(__name__)


@torch.no_grad()
def full_state_dict(
    model: torch.nn.Module, rank: int = 0, timeout_s: float = 300.0, exclude_frozen_parameters: bool = False
) -> dict[str, torch.Tensor] | None:
    """The model's full state dict (fp32 master weights, on the CPU) on ``rank``; ``None`` on the others.

    Collective over the model's group: every rank calls it. Memory: the result on ``rank``, and on
    every rank one bucket of full weights at a time (``eager.gathered.GATHER_BUCKET_BYTES``, 4 MiB, or
    one larger weight alone), gathered by one collective each: one per parameter would make an export
    of many small weights latency-bound. A rank that does not call it within ``timeout_s``
    (``if rank == 0: full_state_dict(model)``) is an error on the others, not a hang.
    ``exclude_frozen_parameters``: the parameters with ``requires_grad`` False are left out (buffers
    stay): a LoRA adapter's weights without gathering the base model, e.g. for
    ``peft_model.save_pretrained(out, state_dict=...)``.
    """
    refs = _state_refs(unwrap(model))
    if exclude_frozen_parameters:
        frozen = [
            name for name, value in refs.items() if isinstance(value, torch.nn.Parameter) and not value.requires_grad
        ]
        left_out = set(frozen)
        refs = {name: value for name, value in refs.items() if name not in left_out}
    else:
        frozen = []
    group = next((s.group for s in map(shard_of, refs.values()) if s is not None), None)
    group = group or DataParallelGroup.resolve(None)
    if group.tensor_parallel is not None:  # its shards are of each rank's pieces: the result would hold tp rank 0's
        raise CheckpointError(
            "zcompile.checkpoint.full_state_dict: a tensor-parallel model's shards hold each rank's pieces, not the "
            "weights. Take model.state_dict() (DTensors of the whole weights; .full_tensor() each), or "
            "zcompile.checkpoint.save(path, model, optimizer) and consolidate it (docs/tensor-parallel.md)"
        )
    # (``rank`` may differ: every rank gathers); what is gathered may not
    agree_on_call(
        "full_state_dict",
        None,
        group,
        timeout_s,
        exclude_frozen_parameters=exclude_frozen_parameters,
        frozen=names_digest(frozen),
    )
    mine = group.rank == rank
    # each sharded weight once (a tied one has several names), its master shards gathered a bucket at
    # a time into the result's CPU tensors on ``rank`` (``eager.gathered.gather_into_full``); the other
    # ranks take part and keep nothing
    masters = list({id(s): s for s in map(shard_of, refs.values()) if s is not None}.values())
    for sharded in masters:
        sharded.follow_replaced_storage()  # `param.data = loaded` since the last call: its values are the master
    fulls = {id(s): torch.empty(s.numel, dtype=s.shard.dtype) if mine else None for s in masters}
    gather_into_full([(fulls[id(s)], s.shard.detach(), s) for s in masters])
    out: dict[str, torch.Tensor] | None = {} if mine else None
    copied: dict[int, torch.Tensor] = {}  # a tied weight not sharded: one copy for its names
    for name, value in refs.items():
        if not mine:
            break
        if not isinstance(value, torch.Tensor):
            out[name] = value  # extra state (``get_extra_state``) as the module returns it
        elif (sharded := shard_of(value)) is not None:
            out[name] = fulls[id(sharded)].view(sharded.shape)
        else:
            if id(value) not in copied:
                copied[id(value)] = value.detach().to("cpu", copy=True)
            out[name] = copied[id(value)]
    return out


def _state_refs(root: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What ``root.state_dict(keep_vars=True)`` holds, collected without calling it (a stage-3
    ``state_dict`` refuses freed parameters): every name of every parameter, persistent buffers,
    and each module's extra state."""
    refs: dict[str, torch.Tensor] = {}
    for prefix, module in root.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, param in module._parameters.items():
            if param is not None:
                refs[dot + name] = param
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                refs[dot + name] = buffer
        if type(module).get_extra_state is not torch.nn.Module.get_extra_state:
            refs[dot + "_extra_state"] = module.get_extra_state()
    return refs


def read_state(state: dict, path: str) -> None:
    """``dcp.load`` of ``state`` in this process alone (DCP warns that it assumes so: it is meant)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=True)


def read_meta(path: str | os.PathLike) -> dict:
    """The ``zcompile/meta`` entry of a checkpoint directory (no process group needed)."""
    state = {META_KEY: ""}
    read_state(state, os.fspath(path))
    return json.loads(state[META_KEY])


def read_extra(path: str | os.PathLike, rank: int = 0) -> dict:
    """The ``extra`` dict rank ``rank`` passed to the save of checkpoint ``path``, read without a model or a
    process group: what a script needs before it can build its model (the model's configuration a
    nanoGPT-style ``init_from="resume"`` takes from the checkpoint). ``CheckpointError`` when the path
    holds no complete checkpoint or no extra of that rank. Unpickling runs code: read only checkpoints you
    trust (as ``torch.load``)."""
    given = os.fspath(path)
    path = readable_checkpoint(given)
    if not is_complete(path):
        what = "does not exist" if not os.path.exists(path) else "is not a complete checkpoint (no .metadata)"
        raise CheckpointError(f"zcompile.checkpoint.read_extra: {given} {what}.{incomplete_save_note(given)}")
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    if extra_key(rank) not in keys:
        saved = sorted(int(k.removeprefix(extra_key(0)[:-1])) for k in keys if k.startswith(extra_key(0)[:-1]))
        raise CheckpointError(
            f"zcompile.checkpoint.read_extra: {given} holds no extra of rank {rank} (saved ranks: {saved}); "
            "pass one of those"
        )
    state = {extra_key(rank): b""}
    read_state(state, path)
    return from_bytes(state[extra_key(rank)])


def _read_full_weights(path: str, verify_checksums: bool) -> tuple[dict[str, torch.Tensor], dict]:
    """Every parameter (under each of its names) and buffer of checkpoint ``path``, and its meta;
    ``CheckpointError`` when a file is missing, cut, or (``verify_checksums``) not what the save wrote."""
    reader = dcp.FileSystemReader(path)
    if damaged := damage(path, lambda: data_file_ends(reader.read_metadata()), verify=verify_checksums):
        raise CheckpointError(
            f"zcompile.checkpoint.consolidate: {path} is damaged: {'; '.join(damaged)}. Consolidate another "
            "checkpoint (an earlier save); nothing was written"
        )
    if verify_checksums and read_record(path) is None:
        log.info("consolidate: %s has no %s (saved without checksums): read unverified", path, RECORD_FILE)
    meta = read_meta(path)
    keys = reader.read_metadata().state_dict_metadata
    result: dict[str, torch.Tensor] = {}
    for name, info in meta["params"].items():
        flat = torch.empty(keys[param_key(name)].size)
        read_state({param_key(name): flat}, path)
        full = flat.view(info["shape"])
        for alias in meta["aliases"].get(name, [name]):
            result[alias] = full
    for name in meta.get("buffers", []):
        entry = keys.get(buffer_key(name))
        if entry is None:
            continue
        buffer = torch.empty(entry.size, dtype=entry.properties.dtype)
        read_state({buffer_key(name): buffer}, path)
        result[name] = buffer
    return result, meta


def consolidate(path: str | os.PathLike, out: str | os.PathLike, verify_checksums: bool = True) -> dict[str, Any]:
    """Writes the full fp32 weights of checkpoint ``path`` to the file ``out`` and returns a summary.

    Every file is first compared with the checksums its save recorded (``checksums``);
    ``verify_checksums=False`` skips that (the files' sizes are still checked).

    ``out`` ending in ``.safetensors`` is written with safetensors (tied names get their own copy:
    the format has no aliases), anything else with ``torch.save``. Runs without a process group,
    reading one tensor at a time.
    """
    given = os.fspath(path)
    path = readable_checkpoint(given)  # or a complete save stopped while it was swapped in
    if not is_complete(path):
        what = "does not exist" if not os.path.exists(path) else "is not a complete checkpoint (no .metadata)"
        raise CheckpointError(f"zcompile.checkpoint.consolidate: {given} {what}.{incomplete_save_note(given)}")
    try:
        result, meta = _read_full_weights(path, verify_checksums)
    except CheckpointError:
        raise
    except Exception as error:  # DCP's own errors on a damaged checkpoint: a traceback says less than this
        raise CheckpointError(
            f"zcompile.checkpoint.consolidate: reading {path} failed ({type(error).__name__}: {error}): the "
            "checkpoint is damaged; consolidate another one (an earlier save), nothing was written"
        ) from error
    out = os.fspath(out)
    if out.endswith(".safetensors"):
        from safetensors.torch import save_file

        seen: set[int] = set()
        unique = {}
        for name, tensor in result.items():  # safetensors refuses tensors that share memory
            unique[name] = tensor.clone() if id(tensor) in seen else tensor.contiguous()
            seen.add(id(tensor))
        save_file(unique, out)
    else:
        torch.save(result, out)
    numel = sum(t.numel() for name, t in result.items() if name in meta["params"])
    log.info("consolidate: %d tensors (%d parameters' elements) from %s to %s", len(result), numel, path, out)
    excluded = sorted(meta.get("excluded_frozen", {}))
    if excluded:
        log.warning(
            "zcompile.checkpoint.consolidate: %s holds only what trained: %d frozen parameters (%s%s) were "
            "left out when it was saved (exclude_frozen_parameters=True), so %s lacks them; take them from "
            "the weights the run started from",
            path,
            len(excluded),
            ", ".join(excluded[:3]),
            ", ..." if len(excluded) > 3 else "",
            out,
        )
    return {
        "tensors": len(result),
        "parameters": len(meta["params"]),
        "elements": numel,
        "saved_world_size": meta["world_size"],
        "out": out,
        "excluded_frozen": excluded,
    }
