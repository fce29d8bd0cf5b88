"""``optimizer.state_dict()`` / ``load_state_dict()`` of the sharded optimizers, safe with DCP.

torch's format (``{"state": {index: {...}}, "param_groups": [...]}``) with one difference: a
state tensor of a parameter's shard (Adam's moments, SGD's momentum) is returned as this rank's
piece of a flat tensor of the parameter's ``numel`` elements, a DTensor ``Shard(0)`` in a group of
several ranks (``zcompile.checkpoint.layout``). A plain tensor would look replicated to DCP, which
keeps one rank's copy for all (each rank would load rank 1's moments); a DTensor says whose piece
it is, so ``dcp.save`` / ``dcp.load`` of ``optimizer.state_dict()`` is right and reshards to
another number of ranks. ``torch.save`` per rank works too (DTensors pickle). A tensor-parallel
parameter's state is a piece of the same flat tensor (``zcompile.checkpoint.tensor_parallel_layout``), so
DCP also reshards between dp x tp layouts.

``load_state_dict`` takes such pieces (from this layout, or resharded by ``dcp.load`` into it),
full flat tensors (a save on one rank) or shard-sized plain tensors, and keeps the state fp32 on
the shard's device: torch's own loader would cast it to the parameter's dtype (bf16 models).
"""

from __future__ import annotations

import torch

from zcompile.agreement.abort_note import leave_abort_note
from zcompile.checkpoint.layout import SAVED_BY_ATTR, as_flat_piece, flat_mesh, group_of
from zcompile.checkpoint.tensor_parallel_layout import TensorParallelStateLayout, tensor_parallel_layout
from zcompile.common.process_group import DataParallelGroup, all_gather_eager
from zcompile.passes.dtensor_params import is_dtensor, local_tensor
from zcompile.sharding.shards import FlatPiece, shard_of


def _group(optimizer) -> DataParallelGroup:
    return group_of(p for g in optimizer.param_groups for p in g["params"])


# on a state tensor loaded before its parameter was sharded: (ranks, rank) of the layout it was cut for,
# the whole world's; a compile with hybrid sharding cuts over the shard group instead (``recut_loaded_state``)
CUT_FOR_ATTR = "_zcompile_cut_for"


def sharded_state_dict(optimizer, torch_state_dict: dict) -> dict:
    """``torch_state_dict`` (torch's ``Optimizer.state_dict()``) with shard tensors as flat pieces."""
    group = _group(optimizer)
    tensor_parallel = _tensor_parallel_layout(optimizer, group, "state_dict()")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    mesh = flat_mesh(group, params[0].device.type if params else "cpu")
    state = {}
    for index, entry in torch_state_dict["state"].items():
        param = params[index]
        piece = FlatPiece(local_tensor(param).numel(), group.world_size, group.rank)
        state[index] = {
            key: _piece_of(value, param, piece, mesh, group, tensor_parallel) if piece.is_shard(value) else value
            for key, value in entry.items()
        }
    return {"state": state, "param_groups": torch_state_dict["param_groups"]}


def _tensor_parallel_layout(optimizer, group: DataParallelGroup, what: str) -> TensorParallelStateLayout | None:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return tensor_parallel_layout(params, group, f"{type(optimizer).__name__}.{what}", optimizer.check_timeout_s)


def _piece_of(
    shard_value: torch.Tensor,
    param: torch.Tensor,
    piece: FlatPiece,
    mesh,
    group: DataParallelGroup,
    tensor_parallel: TensorParallelStateLayout | None,
) -> torch.Tensor:
    if is_dtensor(param):
        value = tensor_parallel.piece(shard_value, param, piece)
    else:
        value = as_flat_piece(shard_value.detach()[: piece.owned], param.numel(), mesh)
    if mesh is not None or is_dtensor(param):
        setattr(value, SAVED_BY_ATTR, _saved_by(piece, param, group))
    return value


def _saved_by(piece: FlatPiece, param: torch.Tensor, group: DataParallelGroup) -> tuple:
    """Who a piece belongs to: (rank, ranks) in the shard group, and the tensor-parallel rank."""
    return (piece.rank, piece.world) + ((group.tensor_parallel.rank,) if is_dtensor(param) else ())


def _my_shard(
    value: torch.Tensor,
    param: torch.Tensor,
    piece: FlatPiece,
    key: str,
    group: DataParallelGroup,
    tensor_parallel: TensorParallelStateLayout | None,
) -> torch.Tensor:
    """This rank's padded fp32 shard of a saved state tensor, whatever form it was saved in."""
    if is_dtensor(param) and value.numel() == param.numel() and not hasattr(value, "to_local"):
        local = tensor_parallel.shard_of_full(value, param, piece)  # a full flat tensor (consolidated)
    elif hasattr(value, "to_local"):  # a flat piece in this rank's layout (saved so, or resharded by dcp.load)
        _check_saved_by_this_rank(value, _saved_by(piece, param, group), key)
        if tuple(value.shape) != (param.numel(),) or value.to_local().numel() != piece.owned:
            raise ValueError(
                f"optimizer state {key!r} is a piece of a tensor of {tuple(value.shape)} laid out for "
                f"another number of ranks; load it with dcp.load into optimizer.state_dict() (which "
                "reshards) or with zcompile.checkpoint.load"
            )
        local = tensor_parallel.shard(value, param, piece) if is_dtensor(param) else value.to_local()
    elif is_dtensor(param):
        raise ValueError(
            f"optimizer state {key!r} of a tensor-parallel parameter is a plain tensor of {value.numel()} elements: "
            "load the pieces optimizer.state_dict() makes (with dcp.load into optimizer.state_dict()) or a full flat "
            f"tensor of the weight's {param.numel()} elements"
        )
    elif value.numel() == param.numel():  # a full flat tensor (a save on one rank)
        local = value.reshape(-1)[piece.offset : piece.offset + piece.owned]
    elif value.numel() == piece.chunk:  # a shard saved by this rank in this layout
        local = value.reshape(-1)[: piece.owned]
    else:
        raise ValueError(
            f"optimizer state {key!r} has {value.numel()} elements; a parameter of {param.numel()} "
            f"elements on {piece.world} ranks takes {param.numel()} (full) or {piece.chunk} (a shard)"
        )
    device = shard_of(param).shard.device if shard_of(param) is not None else param.device
    return mark_cut_for(piece.padded(local.to(device), device), param, piece)


def mark_cut_for(shard: torch.Tensor, param: torch.Tensor, piece: FlatPiece) -> torch.Tensor:
    """``shard``, marked with ``piece``'s layout when ``param`` is not sharded yet (``CUT_FOR_ATTR``)."""
    if shard_of(param) is None and piece.world > 1:
        setattr(shard, CUT_FOR_ATTR, (piece.world, piece.rank))
    return shard


@torch.no_grad()
def recut_loaded_state(optimizer, members) -> None:
    """Optimizer state loaded before a compile with hybrid sharding, cut for the whole world's
    layout, cut again for the shard group's: each such tensor's world pieces all-gathered (over every
    rank; collective, the same tensors on every rank: one checkpoint, one model), this rank's shard
    kept. Once, at the first step."""
    for member in members:
        state = optimizer.state.get(member.param)
        if not state or member.group.replicate is None:
            continue
        world = member.group.everyone
        piece = FlatPiece(member.numel, member.group.world_size, member.group.rank)
        for key, value in list(state.items()):
            cut_for = getattr(value, CUT_FOR_ATTR, None) if isinstance(value, torch.Tensor) else None
            if cut_for is None or tuple(cut_for) == (piece.world, piece.rank):
                continue
            if tuple(cut_for) != (world.world_size, world.rank):
                raise ValueError(
                    f"optimizer state {key!r} of {member.name!r} was loaded cut for {cut_for[0]} ranks, and neither the "
                    f"world ({world.world_size}) nor the shard group ({piece.world}) is that; load it after the "
                    "first compiled call"
                )
            full = torch.empty(value.numel() * world.world_size, dtype=value.dtype, device=value.device)
            all_gather_eager(full, value.contiguous(), world)
            state[key] = piece.padded(full[piece.offset : piece.offset + piece.owned], value.device)


def _check_saved_by_this_rank(value: torch.Tensor, mine: tuple, key: str) -> None:
    saved_by = getattr(value, SAVED_BY_ATTR, None)
    if saved_by is None or tuple(saved_by) == mine:
        return
    rank, world = saved_by[:2]
    where = f" (tensor-parallel rank {saved_by[2]})" if len(saved_by) > 2 else ""
    raise ValueError(
        f"optimizer state {key!r}: rank {mine[0]} is loading the piece rank {rank} of {world}{where} saved; "
        "optimizer.state_dict() holds only the saving rank's piece, so every rank would resume with its moments. "
        "Save and load with zcompile.checkpoint.save/load (or dcp.save/dcp.load of optimizer.state_dict()), or "
        "torch.save a file per rank and load each rank's own"
    )


def _merged_state(state: dict) -> dict[str, dict]:
    """The per-parameter entries by ``str`` id. A ``dcp.load`` into ``optimizer.state_dict()`` fills the
    tensors in place under the int ids but puts the values it read for non-tensors (``step``)
    under string ids ``"0"``, ``"1"``...: those are the loaded ones, so they win."""
    merged: dict[str, dict] = {}
    for key in sorted(state, key=lambda k: isinstance(k, str)):  # int ids first, DCP's string ids after
        merged.setdefault(str(key), {}).update(state[key])
    return merged


@torch.no_grad()
def load_sharded_state_dict(optimizer, state_dict: dict) -> None:
    """Restores ``optimizer`` from ``state_dict`` (see the module docstring); raises ``ValueError`` on a
    mismatch (another number of parameter groups or parameters per group) before changing anything."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups) or any(
        len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, optimizer.param_groups)
    ):
        raise ValueError(
            f"{type(optimizer).__name__}.load_state_dict: the state dict has groups of "
            f"{[len(g['params']) for g in saved_groups]} parameters, this optimizer "
            f"{[len(g['params']) for g in optimizer.param_groups]}"
        )
    group = _group(optimizer)
    tensor_parallel = _tensor_parallel_layout(optimizer, group, "load_state_dict()")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    # ids as torch numbers them (0, 1, ...); a DCP round trip turns the state's keys into strings
    saved_ids = [str(saved_id) for g in saved_groups for saved_id in g["params"]]
    index_of = {saved_id: position for position, saved_id in enumerate(saved_ids)}
    new_state = {}
    try:
        for saved_index, entry in _merged_state(state_dict["state"]).items():
            param = params[index_of[saved_index]]
            piece = FlatPiece(local_tensor(param).numel(), group.world_size, group.rank)
            new_state[param] = {
                key: _my_shard(value, param, piece, key, group, tensor_parallel)
                if isinstance(value, torch.Tensor) and value.dim() >= 1
                else value
                for key, value in entry.items()
            }
    except ValueError as error:  # maybe this rank alone: the others, waiting for it later, quote it
        leave_abort_note(group, str(error))
        raise
    for saved, live in zip(saved_groups, optimizer.param_groups):
        live.update({key: value for key, value in saved.items() if key != "params"})
    optimizer.state.clear()
    optimizer.state.update(new_state)
