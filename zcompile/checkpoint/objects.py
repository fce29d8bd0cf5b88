"""Checkpoints shaped like ``torch.save``'s: ``save(path, obj)`` and ``obj = load(path)``.

A DDP script saves one dict on rank 0 (``{"model": model.state_dict(), "optimizer":
optimizer.state_dict(), "iter_num": ...}``) and reads it back with ``torch.load`` before it builds its
model. The same dict, saved with ``zcompile.checkpoint.save(path, obj)`` on every rank, becomes a DCP
directory: each rank writes its own pieces of the sharded values (the optimizer's moments, flat
DTensor pieces in ``optimizer.state_dict()``), rank 0 writes everything else, as ``torch.save`` on
rank 0 would (plain tensors such as the model's full weights, and every other value).

``load(path)`` needs no model and no process group: each rank reads the whole object back, the
pieces joined into full tensors (flat, which ``optimizer.load_state_dict`` takes and cuts to the
rank's shard for any number of ranks), the structure, keys and values as they were saved. Memory:
the whole object on every rank, as ``torch.load`` of the DDP file; ``save(path, model, optimizer)``
and ``load(path, model, optimizer)`` move only each rank's shards.

Keys: ``object/{i}`` the i-th tensor of the object (depth first), ``zcompile/object`` the object
with each tensor replaced by its index (rank 0's, pickled bytes).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from zcompile.agreement.store_exchange import names_digest
from zcompile.checkpoint.checksums import damage, data_file_ends
from zcompile.checkpoint.commit import (
    incomplete_save_note,
    is_complete,
    prepare_save,
    readable_checkpoint,
    replaced_whole,
    staging_dir,
    swap_in_written_save,
)
from zcompile.checkpoint.consolidate import read_state
from zcompile.checkpoint.layout import CheckpointError, agree_on_call, from_bytes, refuse_tensor_parallel, to_bytes
from zcompile.common.process_group import DataParallelGroup

log = logging.getLogger(__name__)

OBJECT_KEY = "zcompile/object"


def tensor_key(index: int) -> str:
    return f"object/{index}"


SLOT_TAG = "zcompile.checkpoint.tensor"  # (SLOT_TAG, index): where the index-th tensor was (a tuple unpickles)


def _is_slot(value: Any) -> bool:
    return type(value) is tuple and len(value) == 2 and value[0] == SLOT_TAG


def split_tensors(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with each tensor (in dicts, lists and tuples, depth first) appended to ``tensors`` and
    replaced by its slot; other values kept as they are."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return (SLOT_TAG, len(tensors) - 1)
    if isinstance(obj, Mapping):
        return _same_mapping(obj, {key: split_tensors(value, tensors) for key, value in obj.items()})
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(split_tensors(value, tensors) for value in obj)
    return obj


def _same_mapping(original: Mapping, items: dict) -> Mapping:
    """``items`` in ``original``'s type (a dict, ``OrderedDict``), with its attributes: a state dict's
    ``_metadata`` (module versions ``load_state_dict`` reads), not zcompile's own marks."""
    try:
        rebuilt = type(original)(items)
    except TypeError:  # a mapping type that cannot be built from a dict
        return items
    for name, value in getattr(original, "__dict__", {}).items():
        if not name.startswith("_zcompile"):
            setattr(rebuilt, name, value)
    return rebuilt


def join_tensors(obj: Any, tensors: dict[int, torch.Tensor]) -> Any:
    """The inverse of ``split_tensors``."""
    if _is_slot(obj):
        return tensors[obj[1]]
    if isinstance(obj, Mapping):
        return _same_mapping(obj, {key: join_tensors(value, tensors) for key, value in obj.items()})
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(join_tensors(value, tensors) for value in obj)
    return obj


def _is_piece(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "to_local") and hasattr(tensor, "device_mesh")


def _group_of(tensors: list[torch.Tensor]) -> DataParallelGroup:
    """The group of the object's sharded pieces (the default group when it has none)."""
    for tensor in tensors:
        if _is_piece(tensor):  # a 2-D mesh is hybrid sharding's, over the whole world
            mesh = tensor.device_mesh
            return DataParallelGroup.resolve(mesh.get_group() if mesh.ndim == 1 else None)
    return DataParallelGroup.resolve(None)


def save_object(path: str, obj: Mapping, timeout_s: float, checksums: bool) -> None:
    """``zcompile.checkpoint.save(path, obj)``: see the module docstring. Collective."""
    tensors: list[torch.Tensor] = []
    skeleton = split_tensors(obj, tensors)
    refuse_tensor_parallel([(f"tensor {index} of the object", tensor) for index, tensor in enumerate(tensors)])
    group = _group_of(tensors)
    whole = replaced_whole(path)
    problem, skeleton_bytes = None, b""
    if group.rank == 0:  # what rank 0 writes of the object, made before any rank starts writing
        try:
            skeleton_bytes = to_bytes(skeleton)
        except Exception as error:  # noqa: BLE001 - whatever pickle raises, said on every rank
            problem = (
                f"the object's parts other than tensors cannot be pickled ({type(error).__name__}: {error}). "
                "Save state dicts ({'model': model.state_dict(), 'optimizer': optimizer.state_dict()}), not "
                "the model or optimizer themselves, or call save(path, model, optimizer)"
            )
    if whole and group.rank == 0 and problem is None:
        try:
            prepare_save(path)
        except CheckpointError as error:
            problem = str(error)
        except OSError as error:
            problem = f"clearing what an earlier save left beside {path} failed ({error})"
    layout = [(_is_piece(t), tuple(t.shape), str(t.dtype)) for t in tensors]
    agree_on_call(
        "save",
        path,
        group,
        timeout_s,
        problem,
        checksums=checksums and whole,
        tensors=len(tensors),
        tensor_layout=names_digest(map(repr, layout)),  # the same structure, or the pieces would not pair
    )
    state: dict[str, Any] = {}
    for index, tensor in enumerate(tensors):
        if _is_piece(tensor):
            state[tensor_key(index)] = tensor.detach()
        elif group.rank == 0:  # rank 0's, as torch.save on rank 0 writes
            state[tensor_key(index)] = tensor.detach()
    if group.rank == 0:
        state[OBJECT_KEY] = skeleton_bytes
    target = staging_dir(path) if whole else path
    dcp.save(state, checkpoint_id=target, process_group=group.process_group, no_dist=group.world_size == 1)
    if whole:
        swap_in_written_save(path, group, timeout_s, checksums=checksums)
    log.info(
        "checkpoint: saved an object of %d tensors (%d sharded) to %s (rank %d of %d)",
        len(tensors),
        sum(map(_is_piece, tensors)),
        path,
        group.rank,
        group.world_size,
    )


def load_object(path: str, verify_checksums: bool) -> Any:
    """``zcompile.checkpoint.load(path)``: the object ``save(path, obj)`` wrote, read by this process alone."""
    directory = readable_checkpoint(path)
    if not is_complete(directory):
        what = "does not exist" if not os.path.exists(directory) else "is not a complete checkpoint (no .metadata)"
        raise CheckpointError(f"zcompile.checkpoint.load: {path} {what}.{incomplete_save_note(path)}")
    reader = dcp.FileSystemReader(directory)
    if damaged := damage(directory, lambda: data_file_ends(reader.read_metadata()), verify=verify_checksums):
        raise CheckpointError(
            f"zcompile.checkpoint.load: {directory} is damaged: {'; '.join(damaged)}; load another checkpoint "
            "(an earlier save)"
        )
    keys = reader.read_metadata().state_dict_metadata
    if OBJECT_KEY not in keys:
        raise CheckpointError(
            f"zcompile.checkpoint.load: {path} was saved with save(path, model, optimizer), not save(path, obj); "
            "load it into a model with zcompile.checkpoint.load(path, model, optimizer) (read_extra(path) gives "
            "its extra without a model)"
        )
    state: dict[str, Any] = {OBJECT_KEY: b""}
    for key, entry in keys.items():
        if key.startswith(tensor_key(0)[:-1]) and isinstance(entry, TensorStorageMetadata):
            state[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
    read_state(state, directory)
    tensors = {int(key.removeprefix(tensor_key(0)[:-1])): value for key, value in state.items() if key != OBJECT_KEY}
    return join_tensors(from_bytes(state[OBJECT_KEY]), tensors)
