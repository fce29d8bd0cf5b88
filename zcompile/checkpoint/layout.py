"""What a zcompile checkpoint holds, and how a tensor is cut between ranks: shared by save, load and consolidate.

A checkpoint is a ``torch.distributed.checkpoint`` (DCP) directory. Every parameter is stored as a
flat fp32 tensor of its ``numel`` elements (the master weights), cut between ranks the way
``zcompile.sharding.shards.FlatPiece`` cuts it (rank ``r`` owns ``[r * c, min((r + 1) * c, numel))``
with ``c = ceil(numel / N)``), which is exactly DTensor's ``Shard(0)`` chunking: DCP records the global
size and each rank's piece, and reshards on load to any other number of ranks. Optimizer state
tensors of a parameter's shard size are stored the same way; everything else is replicated.

Keys (a flat dict, so DCP never re-nests them):

- ``model/{name}``: the flat parameter; ``buffer/{name}``: a persistent buffer (replicated);
- ``optim/{name}/{key}``: a per-parameter state tensor (flat) or value (``step``);
- ``optim/param_groups``: the groups' hyper-parameters and parameter names (pickled bytes);
- ``zcompile/meta``: JSON text: format version, world size and stage at save time, each
  parameter's shape, dtype and aliases (tied names), the optimizer's class, and the frozen
  parameters left out (``exclude_frozen_parameters``) with each one's shape, dtype and digest;
- ``extra/rank{R}``: the ``extra`` dict each rank passed (pickled bytes).
"""

from __future__ import annotations

import io
import json
import os
from typing import Any

import torch

from zcompile.agreement.fixes import SAVE_DECISION_FIX
from zcompile.agreement.store_exchange import exchange_on_store
from zcompile.common.process_group import DataParallelGroup
from zcompile.sharding.shards import shard_of

FORMAT = 1
META_KEY = "zcompile/meta"
PARAM_GROUPS_KEY = "optim/param_groups"


def param_key(name: str) -> str:
    return f"model/{name}"


def buffer_key(name: str) -> str:
    return f"buffer/{name}"


def optim_key(name: str, state_key: str) -> str:
    return f"optim/{name}/{state_key}"


def extra_key(rank: int) -> str:
    return f"extra/rank{rank}"


class CheckpointError(RuntimeError):
    """A checkpoint call that cannot go on (raised on every rank that made it; the model is untouched)."""


# the end of every error of a load or save that stopped before it changed anything
UNCHANGED = "the model and optimizer are unchanged"

# what to do when the ranks' calls differ in one of these, beyond saying so
_DIFFERENT_FIXES = {
    "path": " A path made per rank (the rank, a time stamp) gives each rank a directory of its own and no readable "
    "checkpoint: make it the same everywhere (a step number, or rank 0's path sent with "
    "dist.broadcast_object_list).",
    "read": " The ranks found different checkpoints at the path (a save stopped while it swapped its directory in, "
    "seen by some ranks only): the path must be on a filesystem every rank shares, as DCP's loads need.",
    "frozen": " These are digests of the names of the parameters with requires_grad False, which "
    "exclude_frozen_parameters leaves out: freeze the same parameters on every rank.",
}


def agree_on_call(
    call: str,
    path: str | os.PathLike | None,
    group: DataParallelGroup,
    timeout_s: float,
    problem: str | None = None,
    purpose: str = "checkpoint",
    **same: Any,
) -> None:
    """Every rank of ``group`` made the same checkpoint ``call`` with the same ``path`` and ``same``
    arguments, and no rank found a ``problem``; otherwise an error on every rank that came.

    Saving and loading are collective: a rank that skips the call (``if rank == 0: save(...)``)
    would leave the others waiting in DCP's collectives until the process group's timeout, and a
    path made per rank (a time stamp) would write one directory per rank and no readable checkpoint.
    ``purpose``: what the store counts these calls under (``store_exchange.exchange_on_store``); calls made on
    another thread need one of their own.
    """
    mine = {
        "call": call,
        "path": None if path is None else os.path.abspath(os.fspath(path)),
        "problem": problem,
        **same,
    }
    everyone = exchange_on_store(
        mine,
        group,
        timeout_s,
        purpose,
        f"zcompile.checkpoint.{call}",
        SAVE_DECISION_FIX,
    )
    for key in ("call", "path", *same):
        values = [entry[key] for entry in everyone]
        if len({json.dumps(v) for v in values}) > 1:
            raise CheckpointError(
                f"zcompile.checkpoint.{call}: the ranks passed different {key!r}: "
                f"{dict(enumerate(values))}.{_DIFFERENT_FIXES.get(key, '')}"
            )
    found = [(rank, entry["problem"]) for rank, entry in enumerate(everyone) if entry["problem"]]
    if found:
        rank, text = found[0]
        raise CheckpointError(
            f"zcompile.checkpoint.{call}({os.fspath(path)!r}): {text} (found on rank {rank}); {UNCHANGED}"
        )


def group_of(params) -> DataParallelGroup:
    """The data-parallel group ``params`` are sharded over (the default group before any compile)."""
    for param in params:
        sharded = shard_of(param)
        if sharded is not None:
            return sharded.group
    return DataParallelGroup.resolve(None)


def flat_mesh(group: DataParallelGroup, device_type: str):
    """The 1-D device mesh of ``group`` that flat pieces live on (None in a world of one). Made once
    per save or load, not per tensor: making a mesh costs more than writing a small tensor."""
    if group.world_size == 1:
        return None
    if group.replicate is not None:  # hybrid sharding: pieces of the shard group, the same on every replica
        return group.mesh if group.mesh.ndim == 2 else group.mesh["replicate", "shard"]  # 3-D: less the "tp" dim
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group.process_group, device_type)


def as_flat_piece(local: torch.Tensor, numel: int, mesh) -> torch.Tensor:
    """``local`` (this rank's piece) as the piece of a flat ``[numel]`` tensor that DCP reshards: a
    DTensor ``Shard(0)`` on ``mesh`` (``flat_mesh``), or ``local`` itself in a world of one."""
    if mesh is None:
        return local
    from torch.distributed.tensor import DTensor, Replicate, Shard

    placements = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]  # hybrid: ("replicate", "shard")
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size([numel]), stride=(1,))


def to_bytes(value: Any) -> bytes:
    """``value`` pickled by ``torch.save`` (tensors inside allowed), for a DCP object entry."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> Any:
    """The inverse of ``to_bytes``. Unpickling runs code: read only checkpoints you trust (as ``torch.load``)."""
    return torch.load(io.BytesIO(data), weights_only=False)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module: ``torch.compile``'s wrapper (``_orig_mod``) removed, so names carry no prefix."""
    while isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
        model = model._orig_mod
    return model


def named_unique_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """Each parameter once, under its first name (a tied weight is one parameter)."""
    return list(unwrap(model).named_parameters())


def param_aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """First name of each parameter -> every name it has (tied weights have several)."""
    first: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, param in unwrap(model).named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(param), name)
        aliases.setdefault(owner, []).append(name)
    return aliases


def persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers ``state_dict`` would hold (non-persistent ones excluded), each once."""
    out, seen = [], set()
    for module_name, module in unwrap(model).named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is None or name in module._non_persistent_buffers_set or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            out.append((f"{module_name}.{name}" if module_name else name, buffer))
    return out


# on each piece ``optimizer.state_dict()`` returns: (rank, ranks) in the shard group whose piece it is, and
# the tensor-parallel rank for a tensor-parallel model's. ``torch.save`` keeps a tensor's attributes and a
# DTensor's mesh does not say whose piece it holds: rank 0's file loaded on every rank (DDP's checkpoint
# habit) would give each rank rank 0's moments, silently. DCP loads into this rank's pieces.
SAVED_BY_ATTR = "_zcompile_saved_by_rank"


def refuse_tensor_parallel(named: list[tuple[str, torch.Tensor]]) -> None:
    """``CheckpointError`` for a tensor-parallel model's DTensors in the dict form of a save or load (its
    state dict's values, its optimizer's pieces): that form writes rank 0's values of what is not an
    optimizer piece, which would keep one tensor-parallel rank's piece under the whole weight's name.
    The optimizer's flat pieces of a model without tensor parallelism pass (``SAVED_BY_ATTR`` of a
    data-parallel rank). Raised alike on every rank (each holds such DTensors)."""
    from zcompile.passes.dtensor_params import is_dtensor

    found = [name for name, value in named if is_dtensor(value) and len(getattr(value, SAVED_BY_ATTR, ())) != 2]
    if found:
        raise CheckpointError(
            f"{found[0]!r} (and {len(found) - 1} more) are DTensors of a tensor-parallel model: the dict form of "
            "zcompile.checkpoint.save/load does not take them. Save the model and optimizer themselves, "
            "zcompile.checkpoint.save(path, model, optimizer), or the dict with torch.distributed.checkpoint.save "
            "(docs/tensor-parallel.md)"
        )
