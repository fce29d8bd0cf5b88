"""Sharded checkpoints in DCP format that reshard on load: ``save``, ``load``, ``full_state_dict``.

``save(path, model, optimizer, extra)`` writes each rank's own shards (master weights, optimizer
state) with ``torch.distributed.checkpoint``; nothing is gathered, so the extra memory is at most
one shard set (none for compiled models: the shards are written as they are). ``load`` restores
into a freshly built model and optimizer, before or after ``torch.compile``, at any number of
ranks and any stage: DCP reads each rank's new piece from whatever pieces were saved. The
layout is in ``zcompile.checkpoint.layout``.

``exclude_frozen_parameters=True`` leaves out the parameters that do not train (``requires_grad``
False: a LoRA run's base model, a frozen backbone), as DeepSpeed's option of that name does: a
checkpoint of a fine-tuning run then holds what it changes, not the base model again at every
save. A digest of each (``initial_values.value_digest``, a sum that adds up the same however the
weight is cut: its shards' digests summed over the ranks) is kept in the checkpoint; ``load`` keeps
the model's own values of those parameters, each rank compares what it holds (a copy not sharded
yet, whole), and every rank refuses if any found them not the values they had at the save (the run
resumed from other base weights, or a weight trained before it was frozen).

Loading is all-or-nothing and never hangs: every rank checks the checkpoint against its model
first (missing directory, names, sizes, optimizer type), the ranks agree on the outcome before
any collective read, and the values are read into new buffers and copied into the model only
once DCP has read all of them on every rank. A failure is a ``CheckpointError`` on every rank.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from zcompile.agreement.initial_values import value_digest
from zcompile.agreement.store_exchange import names_digest
from zcompile.checkpoint.checksums import damage, data_file_ends
from zcompile.checkpoint.commit import (
    incomplete_save_note,
    prepare_save,
    readable_checkpoint,
    replaced_whole,
    staging_dir,
    swap_in_written_save,
)
from zcompile.checkpoint.consolidate import full_state_dict, read_meta
from zcompile.checkpoint.layout import (
    FORMAT,
    META_KEY,
    PARAM_GROUPS_KEY,
    UNCHANGED,
    CheckpointError,
    agree_on_call,
    as_flat_piece,
    buffer_key,
    extra_key,
    flat_mesh,
    from_bytes,
    group_of,
    named_unique_params,
    optim_key,
    param_aliases,
    param_key,
    persistent_buffers,
    to_bytes,
    unwrap,
)
from zcompile.checkpoint.objects import load_object, save_object
from zcompile.checkpoint.tensor_parallel_layout import tensor_parallel_layout
from zcompile.common.process_group import DataParallelGroup, all_gather_eager, all_reduce_eager
from zcompile.optim.state_dict import mark_cut_for
from zcompile.passes.dtensor_params import is_dtensor, local_tensor
from zcompile.sharding.shards import FlatPiece, shard_of

log = logging.getLogger(__name__)

_STRICT_FIX = "pass strict=False to ignore them"  # the fix of a strict load's refusals of extra names

ASYNC_GROUP_ATTR = "_zcompile_async_checkpoint_group"  # on the user's module: the group of its background saves
PENDING_SAVE_ATTR = "_zcompile_pending_checkpoint_save"  # on the user's module: its background save not yet waited

__all__ = ["CheckpointError", "save", "load", "full_state_dict"]


# ----------------------------------------------------------------------------- pieces
def device_type(params) -> str:
    return params[0][1].device.type if params else "cpu"


def _piece(numel: int, group: DataParallelGroup) -> FlatPiece:
    return FlatPiece(numel, group.world_size, group.rank)


def _master_piece(param: torch.nn.Parameter, piece: FlatPiece) -> torch.Tensor:
    """This rank's fp32 values of ``param``: a view of its shard, or (not sharded yet) a copy of its slice."""
    sharded = shard_of(param)
    if sharded is not None:
        sharded.follow_replaced_storage()  # `param.data = loaded` since the last call: its values are the master
        return sharded.shard.detach()[: piece.owned]
    flat = param.detach().reshape(-1)
    return flat[piece.offset : piece.offset + piece.owned].float().clone()


# value_digest sums bit patterns into an int64 that wraps, so the pieces' digests add up to the whole's
# modulo 2**64; kept modulo 2**40 (which divides it), the sum over any number of ranks fits an int64
_DIGEST_MODULUS = 2**40


def _full_value_digests(params, group: DataParallelGroup) -> list[int]:
    """The digest of each parameter's full value in fp32 as this rank holds it, the same however the
    weight is cut between ranks: a sharded one's pieces digested on their ranks and added (one
    all-reduce; collective), one not sharded yet from this rank's own whole copy (each rank's copy
    is its own: a copy that differs on one rank is seen there, not hidden in a sum of slices)."""
    if not params:
        return []
    sharded = [shard_of(p) is not None for _, p in params]
    pieces = torch.tensor(
        [
            value_digest(_master_piece(p, _piece(p.numel(), group)).float()) % _DIGEST_MODULUS if is_sharded else 0
            for (_, p), is_sharded in zip(params, sharded)
        ],
        dtype=torch.int64,
        device=params[0][1].device,
    )
    if group.world_size > 1:
        all_reduce_eager(pieces, group, dist.ReduceOp.SUM)
    return [
        int(total) % _DIGEST_MODULUS if is_sharded else value_digest(p.detach().float()) % _DIGEST_MODULUS
        for (_, p), is_sharded, total in zip(params, sharded, pieces.tolist())
    ]


# ----------------------------------------------------------------------------- save
def save(
    path: str | os.PathLike,
    model: torch.nn.Module | Mapping,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict | None = None,
    async_save: bool = False,
    timeout_s: float = 300.0,
    exclude_frozen_parameters: bool = False,
    checksums: bool = True,
):
    """Writes ``model``'s (and ``optimizer``'s) shards and this rank's ``extra`` to the directory ``path``.

    ``save(path, obj)``, ``obj`` a dict (``{"model": model.state_dict(), "optimizer":
    optimizer.state_dict(), ...}``, what a DDP script hands ``torch.save`` on rank 0): called on
    every rank, it writes each rank's pieces of the optimizer's state and rank 0's everything else;
    ``load(path)`` gives the dict back (``zcompile.checkpoint.objects``).

    Collective: every rank of the model's group calls it. ``extra`` (scheduler, data-loader
    state...) is saved per rank and returned by ``load``. With ``async_save`` the values are staged
    in host memory and written in the background: the returned ``Future`` completes when the files
    are written (keep training meanwhile; wait for it before another save of the same path).
    A rank that does not make the same call within ``timeout_s`` is an error on the others.
    ``exclude_frozen_parameters``: the parameters with ``requires_grad`` False are left out, their
    digests kept (module docstring); ``load`` then takes them from the model it loads into.

    A checkpoint already at ``path`` is replaced whole or not at all: the save is written into
    ``<path>.zcompile-saving`` and swapped in once every rank's files are written
    (``zcompile.checkpoint.commit``), so a save stopped part way leaves the last checkpoint readable.
    ``checksums``: each rank hashes the files it wrote and the record goes into the checkpoint before
    it is swapped in, for ``load`` and ``consolidate`` to verify (``zcompile.checkpoint.checksums``;
    a path with a scheme, written in place, gets none).
    """
    path = os.fspath(path)
    if not isinstance(model, torch.nn.Module):
        return _save_object(path, model, optimizer, extra, async_save, exclude_frozen_parameters, timeout_s, checksums)
    _wait_for_background_save(model)  # its swap, and its writes into the same staging directory, come first
    params = named_unique_params(model)
    group = group_of([p for _, p in params])  # the pieces' group (hybrid sharding: the shard group)
    tensor_parallel = _tensor_parallel_layout(params, group, "zcompile.checkpoint.save", exclude_frozen_parameters)
    ranks = group.everyone  # who saves: every rank, each piece written once
    frozen = [(name, p) for name, p in params if not p.requires_grad] if exclude_frozen_parameters else []
    whole = replaced_whole(path)
    problem = None
    if whole and ranks.rank == 0:  # DCP's coordinating rank, which writes the metadata, owns the directories
        try:
            prepare_save(path)
        except CheckpointError as error:
            problem = str(error)
        except OSError as error:
            problem = f"clearing what an earlier save left beside {path} failed ({error})"
    agree_on_call(
        "save",
        path,
        ranks,
        timeout_s,
        problem,
        optimizer=optimizer is not None,
        async_save=async_save,
        exclude_frozen_parameters=exclude_frozen_parameters,
        checksums=checksums and whole,  # a record of some ranks' files would fail every later load
        frozen=names_digest(name for name, _ in frozen),
    )  # else each writes other entries
    target = staging_dir(path) if whole else path
    excluded = {
        name: {"shape": list(p.shape), "dtype": str(p.dtype), "digest": digest}
        for (name, p), digest in zip(frozen, _full_value_digests(frozen, group))
    }
    trained = [(name, p) for name, p in params if name not in excluded]
    mesh = flat_mesh(group, device_type(params))
    state: dict[str, Any] = {}
    for name, param in trained:
        piece = _piece(local_tensor(param).numel(), group)
        if is_dtensor(param):
            shard_of(param).follow_replaced_storage()
            state[param_key(name)] = tensor_parallel.piece(shard_of(param).shard.detach(), param, piece)
        else:
            state[param_key(name)] = as_flat_piece(_master_piece(param, piece), param.numel(), mesh)
    for name, buffer in persistent_buffers(model):
        state[buffer_key(name)] = buffer.detach()
    if optimizer is not None:
        state.update(_optimizer_entries(optimizer, params, group, mesh, tensor_parallel))
    state[META_KEY] = json.dumps(_meta(model, trained, optimizer, ranks) | {"excluded_frozen": excluded})
    state[extra_key(ranks.rank)] = to_bytes(extra or {})
    if async_save:
        result = dcp.async_save(
            state, checkpoint_id=target, process_group=_async_group(model, ranks), no_dist=ranks.world_size == 1
        )
        result = getattr(result, "upload_completion", result)  # (other checkpointer types: a response)
        if whole:
            result = _committed_when_written(result, path, ranks, timeout_s, checksums)
        unwrap(model).__dict__[PENDING_SAVE_ATTR] = result
    else:
        result = dcp.save(state, checkpoint_id=target, process_group=ranks.process_group, no_dist=ranks.world_size == 1)
        if whole:
            swap_in_written_save(path, ranks, timeout_s, checksums=checksums)
    log.info(
        "checkpoint: %s %d parameters to %s (rank %d of %d)%s",
        "saving" if async_save else "saved",
        len(trained),
        path,
        ranks.rank,
        ranks.world_size,
        f", {len(excluded)} frozen ones left out" if excluded else "",
    )
    return result


def _save_object(path, obj, optimizer, extra, async_save, exclude_frozen_parameters, timeout_s, checksums):
    if not isinstance(obj, Mapping):
        raise TypeError(
            f"zcompile.checkpoint.save: the second argument is a {type(obj).__name__}; pass the model "
            "(save(path, model, optimizer)) or a dict of what to save (save(path, {'model': model.state_dict(), ...}))"
        )
    given = {"optimizer": optimizer, "extra": extra, "async_save": async_save or None}
    given["exclude_frozen_parameters"] = exclude_frozen_parameters or None
    if unused := [name for name, value in given.items() if value is not None]:
        raise TypeError(
            f"zcompile.checkpoint.save(path, obj): {', '.join(unused)} apply to save(path, model, ...) only; put "
            "what you want saved into the dict"
        )
    save_object(path, obj, timeout_s, checksums)


def _committed_when_written(
    written: concurrent.futures.Future, path: str, group: DataParallelGroup, timeout_s: float, checksums: bool
) -> concurrent.futures.Future:
    """A future of a background save that completes once it is swapped in at ``path`` on every rank: the
    swap runs on DCP's thread when the files are written, and so does its exchange through the store."""
    committed: concurrent.futures.Future = concurrent.futures.Future()

    def swap(done: concurrent.futures.Future) -> None:
        try:
            value, problem = done.result(), None
        except BaseException as error:  # reported on every rank through the commit's agreement
            value, problem = None, f"writing it failed ({type(error).__name__}: {_first_line(error)})"
        try:
            swap_in_written_save(path, group, timeout_s, problem, checksums)
        except BaseException as error:
            committed.set_exception(error)
        else:
            committed.set_result(value)

    written.add_done_callback(swap)
    return committed


def _wait_for_background_save(model: torch.nn.Module) -> None:
    """Waits for ``model``'s last background save before another save or a load (its error, if any, is
    its own future's: the caller may have handled it already)."""
    pending = unwrap(model).__dict__.pop(PENDING_SAVE_ATTR, None)
    if pending is not None:
        concurrent.futures.wait([pending])


def _async_group(model: torch.nn.Module, group: DataParallelGroup) -> dist.ProcessGroup | None:
    """A gloo group of the same ranks for background saves, made once per model and kept on it.

    The background thread runs DCP's collectives while training issues its own: on the training
    group they would interleave differently on each rank and deadlock or crash it.
    """
    if group.world_size == 1:
        return None
    root = unwrap(model)
    cached = root.__dict__.get(ASYNC_GROUP_ATTR)
    if cached is None:
        if dist.get_world_size() != group.world_size:
            raise ValueError(
                "zcompile.checkpoint.save: async_save=True makes a process group for the background "
                "save, which needs the data-parallel group to span every rank; save synchronously"
            )
        cached = dist.new_group(dist.get_process_group_ranks(group.process_group), backend="gloo")
        root.__dict__[ASYNC_GROUP_ATTR] = cached
    return cached


def _meta(model, params, optimizer, group: DataParallelGroup) -> dict:
    stages = {name: getattr(shard_of(p), "stage", None) for name, p in params}
    return {
        "format": FORMAT,
        "world_size": group.world_size,
        "stages": stages,
        "params": {name: {"shape": list(p.shape), "dtype": str(p.dtype)} for name, p in params},
        "aliases": param_aliases(model),
        "buffers": [name for name, _ in persistent_buffers(model)],
        "optimizer": None if optimizer is None else type(optimizer).__name__,
    }


def _optimizer_entries(optimizer, params, group: DataParallelGroup, mesh, tensor_parallel) -> dict[str, Any]:
    entries: dict[str, Any] = {}
    names = {id(p): name for name, p in params}
    for param, state in optimizer.state.items():
        name = names.get(id(param))
        if name is None:
            raise ValueError(
                "zcompile.checkpoint.save: the optimizer holds state for a parameter that is not "
                "in the model; pass the model the optimizer trains"
            )
        piece = _piece(local_tensor(param).numel(), group)
        for key, value in state.items():
            if piece.is_shard(value) and is_dtensor(param):
                entries[optim_key(name, key)] = tensor_parallel.piece(value.detach(), param, piece)
            elif piece.is_shard(value):
                entries[optim_key(name, key)] = as_flat_piece(value.detach()[: piece.owned], param.numel(), mesh)
            else:  # a step count or another replicated value
                entries[optim_key(name, key)] = to_bytes(value)
    groups = [
        {k: v for k, v in g.items() if k != "params"} | {"param_names": [names[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    entries[PARAM_GROUPS_KEY] = to_bytes(groups)
    return entries


# ----------------------------------------------------------------------------- load
def load(
    path: str | os.PathLike,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
    timeout_s: float = 300.0,
    verify_checksums: bool = True,
) -> dict:
    """Restores ``model`` (and ``optimizer``) from ``path``; returns the ``extra`` dict saved with it.

    ``load(path)``, no model: the object ``save(path, obj)`` wrote, read whole by this process (as
    ``torch.load``), its optimizer state as full flat tensors that ``optimizer.load_state_dict`` cuts
    to this rank's shard.

    Works before or after ``torch.compile`` and at another number of ranks or stage than the save.
    Collective: every rank of the model's group calls it. ``strict``: every parameter of the
    model must be in the checkpoint and nothing else (a missing name is always an error, but for
    one saved with ``exclude_frozen_parameters``: the model's own value is kept, and must be the one
    it had at the save). A rank that does not make the same call within ``timeout_s`` is an error on
    the others. Every file is first compared with the checksums its save recorded, each rank hashing
    its share (``zcompile.checkpoint.checksums``); ``verify_checksums=False`` skips that (the data
    files' sizes are still checked).
    """
    if model is None:
        if optimizer is not None:
            raise TypeError(
                "zcompile.checkpoint.load(path, optimizer=...) needs the model too: load(path, model, optimizer)"
            )
        return load_object(os.fspath(path), verify_checksums)
    _wait_for_background_save(model)  # a save of this path must be swapped in before it is read
    params = named_unique_params(model)
    group = group_of([p for _, p in params])  # the pieces' group (hybrid sharding: the shard group)
    tensor_parallel = _tensor_parallel_layout(params, group, "zcompile.checkpoint.load")
    ranks = group.everyone  # who loads: every rank
    path = os.fspath(path)
    directory = readable_checkpoint(path)  # path, or a complete save stopped while it was swapped in
    problem, meta = None, {}
    try:
        reader = dcp.FileSystemReader(directory)
        damaged = damage(
            directory, lambda: data_file_ends(reader.read_metadata()), ranks.rank, ranks.world_size, verify_checksums
        )
        if damaged:
            raise CheckpointError(
                f"{directory} is damaged: {'; '.join(damaged)}; load another checkpoint (an earlier save)"
            )
        metadata = reader.read_metadata()
        if META_KEY in metadata.state_dict_metadata:  # read first: it says which parameters were left out
            meta = read_meta(directory)
        _check(metadata.state_dict_metadata, params, model, optimizer, strict, meta.get("excluded_frozen", {}))
    except (Exception, CheckpointException) as error:  # reported on every rank below, never alone (no hang)
        problem = f"{type(error).__name__}: {error}" if not isinstance(error, CheckpointError) else str(error)
        problem += incomplete_save_note(path)
    # the directory too: ranks that resolve the path differently would each read another checkpoint
    agree_on_call(
        "load",
        path,
        ranks,
        timeout_s,
        problem,
        optimizer=optimizer is not None,
        strict=strict,
        verify_checksums=verify_checksums,
        read=os.path.abspath(directory),
    )
    keys, excluded = metadata.state_dict_metadata, meta.get("excluded_frozen", {})
    kept = [(name, p) for name, p in params if name in excluded]  # the same on every rank: one checkpoint
    dest, optimizer_shards = _destination(keys, params, model, optimizer, group, ranks.rank, tensor_parallel)
    try:
        dcp.load(dest, checkpoint_id=directory, process_group=ranks.process_group, no_dist=ranks.world_size == 1)
    except (Exception, CheckpointException) as error:  # DCP's is a BaseException; it reaches every rank
        raise CheckpointError(
            f"zcompile.checkpoint.load: reading {path} failed ({type(error).__name__}: "
            f"{_first_line(error)}); {UNCHANGED}"
        ) from error
    _check_kept_values(kept, excluded, group, path)  # before anything is written
    if tensor_parallel is not None:
        _from_tensor_parallel_pieces(dest, optimizer_shards, params, group, tensor_parallel)
    _apply_model(dest, params, model, group)
    if optimizer is not None and meta.get("optimizer") is not None:
        _apply_optimizer(dest, optimizer_shards, optimizer, params)
    saved_ranks = meta["world_size"]
    extra_rank = ranks.rank if ranks.rank < saved_ranks else 0  # a rank the save did not have gets rank 0's
    extra = dest.get(extra_key(extra_rank))
    if ranks.world_size != saved_ranks:
        log.warning(
            "zcompile.checkpoint.load: saved on %d ranks, loaded on %d (resharded); rank %d gets the extra of "
            "saved rank %d",
            saved_ranks,
            ranks.world_size,
            ranks.rank,
            extra_rank,
        )
    log.info(
        "checkpoint: loaded %s (saved on %d ranks) on rank %d of %d%s",
        path,
        saved_ranks,
        ranks.rank,
        ranks.world_size,
        f"; {len(kept)} frozen parameters kept as the model has them" if kept else "",
    )
    return from_bytes(extra) if extra is not None else {}


def _first_line(error: BaseException) -> str:
    """DCP's exceptions carry every rank's traceback; the message needs the failure, not the trace."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    failures = [
        line
        for line in lines
        if line.startswith(
            ("EOFError", "RuntimeError", "ValueError", "OSError", "FileNotFoundError", "KeyError", "pickle")
        )
    ]
    return (failures or lines or [type(error).__name__])[-1][:300]


def _check_kept_values(kept, excluded: dict, group: DataParallelGroup, path: str) -> None:
    """The parameters a save left out (``exclude_frozen_parameters``) hold, in the model loaded into,
    the values they had at the save; else ``CheckpointError`` on every rank: each rank compares what
    it holds, and the ranks' findings are all-reduced, so a copy that differs on one rank only stops
    them all. Collective."""
    now = _full_value_digests(kept, group)
    found = torch.tensor(
        [int(digest != excluded[name]["digest"]) for (name, _), digest in zip(kept, now)],
        dtype=torch.int64,
        device=kept[0][1].device if kept else "cpu",
    )
    if group.everyone.world_size > 1 and kept:
        all_reduce_eager(found, group.everyone, dist.ReduceOp.MAX)
    differing = [name for (name, _), on_some_rank in zip(kept, found.tolist()) if on_some_rank]
    if differing:
        shown = ", ".join(differing[:5]) + (f" and {len(differing) - 5} more" if len(differing) > 5 else "")
        raise CheckpointError(
            f"zcompile.checkpoint.load({path!r}): saved with exclude_frozen_parameters=True, it takes the "
            f"frozen parameters from the model, and {len(differing)} of them ({shown}) differ from their values "
            "at the save. Build the model from the same base weights before loading; save a "
            f"model whose frozen weights move (an EMA) without that option; {UNCHANGED}"
        )


def _check(keys: dict, params, model, optimizer, strict: bool, excluded: dict | None = None) -> None:
    """Raises ``CheckpointError`` naming the first tensor that does not match. ``excluded``: the
    frozen parameters the save left out (name -> shape, dtype, digest)."""
    if META_KEY not in keys:
        raise CheckpointError(
            "not a zcompile checkpoint (no zcompile/meta entry); write it with zcompile.checkpoint.save"
        )
    excluded = excluded or {}
    for name, param in params:
        entry = keys.get(param_key(name))
        if entry is None and name in excluded:
            if excluded[name]["shape"] != list(param.shape):
                raise CheckpointError(
                    f"parameter {name!r} has shape {tuple(param.shape)} in the model but "
                    f"{tuple(excluded[name]['shape'])} in the checkpoint (left out there as frozen)"
                )
            continue
        if entry is None:
            raise CheckpointError(
                f"parameter {name!r} of the model is not in the checkpoint (the checkpoint is of another model)"
            )
        if tuple(entry.size) != (param.numel(),):
            raise CheckpointError(
                f"parameter {name!r} has {param.numel()} elements {tuple(param.shape)} in the "
                f"model but {tuple(entry.size)[0] if entry.size else 0} in the checkpoint"
            )
    if strict:
        names = {param_key(name) for name, _ in params}
        missing = sorted(set(excluded) - {name for name, _ in params})
        if missing:
            raise CheckpointError(
                f"the checkpoint left out frozen parameters the model lacks: {missing[:5]}; {_STRICT_FIX}"
            )
        unexpected = sorted(k for k in keys if k.startswith("model/") and k not in names)
        if unexpected:
            raise CheckpointError(f"the checkpoint has parameters the model lacks: {unexpected[:5]}; {_STRICT_FIX}")
    if optimizer is not None and not any(k.startswith("optim/") for k in keys):
        raise CheckpointError("an optimizer was given but the checkpoint holds no optimizer state")


def _destination(keys: dict, params, model, optimizer, group: DataParallelGroup, rank: int, tensor_parallel=None):
    """New buffers, in this rank's layout, for every entry that will be read; and, by key, the
    padded shards the optimizer-state pieces are views of (read in place, kept as the state; a
    tensor-parallel weight's are filled from its pieces after the read: ``_from_tensor_parallel_pieces``).
    ``rank``: this rank among every rank that loads (its extra)."""
    mesh = flat_mesh(group, device_type(params))
    optimizer_shards: dict[str, torch.Tensor] = {}
    dest: dict[str, Any] = {extra_key(rank): b""}
    if rank != 0:
        dest[extra_key(0)] = b""
    dest = {k: v for k, v in dest.items() if k in keys}
    for name, param in params:
        if param_key(name) not in keys:  # left out as frozen (``_check``): the model keeps its value
            continue
        piece = _piece(local_tensor(param).numel(), group)
        if is_dtensor(param):
            dest[param_key(name)] = tensor_parallel.template(param, piece, param.device)
        else:
            dest[param_key(name)] = as_flat_piece(torch.empty(piece.owned, device=param.device), param.numel(), mesh)
    for name, buffer in persistent_buffers(model):
        if buffer_key(name) in keys:
            dest[buffer_key(name)] = torch.empty_like(buffer)
    if optimizer is not None:
        for name, param in params:
            piece = _piece(local_tensor(param).numel(), group)
            for key in (k for k in keys if k.startswith(optim_key(name, ""))):
                if hasattr(keys[key], "size"):  # a flat per-parameter tensor, read into a padded shard
                    shard = mark_cut_for(torch.zeros(piece.chunk, device=param.device), param, piece)  # padding zero
                    optimizer_shards[key] = shard
                    if is_dtensor(param):
                        dest[key] = tensor_parallel.template(param, piece, param.device)
                    else:
                        dest[key] = as_flat_piece(shard[: piece.owned], param.numel(), mesh)
                else:
                    dest[key] = b""
        if PARAM_GROUPS_KEY in keys:
            dest[PARAM_GROUPS_KEY] = b""
    return dest, optimizer_shards


def _tensor_parallel_layout(params, group: DataParallelGroup, call: str, exclude_frozen: bool = False):
    """``tensor_parallel_layout`` with its refusals as ``CheckpointError``s (the same on every rank: one
    model), and ``exclude_frozen_parameters``, which a tensor-parallel model does not take."""
    try:
        layout = tensor_parallel_layout([p for _, p in params], group, call)
    except ValueError as error:
        raise CheckpointError(f"{error}; {UNCHANGED}") from None
    if layout is not None and exclude_frozen:
        raise CheckpointError(
            f"{call}: exclude_frozen_parameters with a tensor-parallel model is not supported; save it whole. {UNCHANGED}"
        )
    return layout


@torch.no_grad()
def _from_tensor_parallel_pieces(dest: dict, optimizer_shards: dict, params, group, tensor_parallel) -> None:
    """A tensor-parallel weight's read pieces (its global order) turned into this rank's shard values:
    the weight's entry in place, its optimizer state into its padded shards (collective for row-wise
    weights, the same parameters in the same order on every rank)."""
    for name, param in params:
        if not is_dtensor(param):
            continue
        piece = _piece(local_tensor(param).numel(), group)
        if param_key(name) in dest:
            dest[param_key(name)] = tensor_parallel.shard(dest[param_key(name)], param, piece)
        for key in [k for k in optimizer_shards if k.startswith(optim_key(name, ""))]:
            optimizer_shards[key][: piece.owned].copy_(tensor_parallel.shard(dest[key], param, piece))


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


@torch.no_grad()
def _apply_model(dest: dict, params, model, group: DataParallelGroup) -> None:
    for name, param in params:
        if param_key(name) not in dest:  # left out as frozen: kept, its values checked (_check_kept_values)
            continue
        values = _local(dest[param_key(name)])
        sharded = shard_of(param)
        if sharded is not None:
            sharded.follow_replaced_storage()  # the shard written below is the one the parameter's storage holds
            sharded.shard[: values.numel()].copy_(values)
            sharded.initial_digest = (
                None  # the checkpoint's values now, the same on every rank (zcompile.agreement.initial_values)
            )
            if sharded.stage in (1, 2):
                sharded.refresh_replicated()  # the replicated parameter (or replica) from the new shards
        else:
            _fill_full(param, values, group)
    buffers = dict(persistent_buffers(model))
    for name, buffer in buffers.items():
        if buffer_key(name) in dest:
            buffer.copy_(dest[buffer_key(name)])


def _fill_full(param: torch.nn.Parameter, values: torch.Tensor, group: DataParallelGroup) -> None:
    """A parameter not sharded yet (load before compile): its full value from every rank's piece."""
    piece = _piece(param.numel(), group)
    padded = piece.padded(values)
    if group.world_size == 1:
        full = padded
    else:
        full = torch.empty(piece.chunk * group.world_size, device=values.device)
        all_gather_eager(full, padded, group)
    param.copy_(full[: param.numel()].view(param.shape))


@torch.no_grad()
def _apply_optimizer(dest: dict, optimizer_shards: dict[str, torch.Tensor], optimizer, params) -> None:
    groups = from_bytes(dest[PARAM_GROUPS_KEY]) if PARAM_GROUPS_KEY in dest else []
    if len(groups) == len(optimizer.param_groups):
        for saved, live in zip(groups, optimizer.param_groups):
            live.update(
                {
                    k: tuple(v) if isinstance(live.get(k), tuple) else v
                    for k, v in saved.items()
                    if k not in ("param_names", "params")
                }
            )
    for name, param in params:
        prefix = optim_key(name, "")
        state = {
            key[len(prefix) :]: optimizer_shards[key] if key in optimizer_shards else from_bytes(dest[key])
            for key in dest
            if key.startswith(prefix)
        }
        if state:
            optimizer.state[param] = state
