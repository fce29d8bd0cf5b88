"""``sync_module_states``: every rank's parameters and buffers made rank 0's, as DDP does when it
wraps a model."""

from __future__ import annotations

import torch
import torch.distributed as dist

from zcompile.agreement.abort_note import RankDivergenceError
from zcompile.agreement.initial_values import value_digest
from zcompile.agreement.store_exchange import exchange_on_store
from zcompile.common.process_group import DataParallelGroup, broadcast_from_first
from zcompile.sharding.sharded_parameter import shard_of

SYNC_BUCKET_BYTES = 256 * 2**20  # DDP's broadcast bucket at wrap time is 250 MiB


def sync_module_states(
    module: torch.nn.Module, group: dist.ProcessGroup | None = None, timeout_s: float = 60.0
) -> None:
    """Every rank's parameters and buffers = rank 0's (of ``group``), as DDP does when it wraps a
    model: call it before the first call of the compiled model when the ranks built or loaded the
    model differently (a checkpoint loaded on rank 0 only). Flat broadcasts of up to 256 MiB, none where
    every rank's values are already equal.

    Every rank must call it, with a model of the same shapes: the ranks first meet through the store
    (no collective), so a rank that calls it alone, or with another model, gets a
    ``RankDivergenceError`` within ``timeout_s`` on every rank that came, instead of a broadcast
    that waits for the process group's timeout or pairs tensors of other sizes."""
    sharded = [name for name, p in module.named_parameters() if shard_of(p) is not None]
    if sharded:
        raise ValueError(
            f"zcompile.sync_module_states: parameters are already sharded ({', '.join(sharded[:3])}"
            f"{', ...' if len(sharded) > 3 else ''}): call it before the first call of the compiled model"
        )
    resolved = DataParallelGroup.resolve(group)
    if resolved.world_size == 1:
        return
    take_first_ranks_values(
        [*module.parameters(), *module.buffers()],
        resolved,
        timeout_s,
        "sync",
        "zcompile.sync_module_states",
        "Call zcompile.sync_module_states(model) on every rank, with the same model.",
    )


def take_first_ranks_values(
    tensors: list[torch.Tensor], group: DataParallelGroup, timeout_s: float, purpose: str, doing: str, fix: str
) -> bool:
    """Every rank's ``tensors`` = rank 0's (through the replicate group too, with hybrid sharding);
    whether any rank's differed. The ranks first exchange, through
    the store (``purpose``), each tensor's shape, dtype and digest (``initial_values.value_digest``): other
    shapes are a ``RankDivergenceError`` (a broadcast would pair tensors of other sizes, and one a rank
    does not make would wait for the process group's timeout), and where every value is already equal
    (the same seed on every rank) nothing is broadcast."""
    mine = [[list(t.shape), str(t.dtype), _digest(t)] for t in tensors]
    per_rank = exchange_on_store(mine, group, timeout_s, purpose, doing, fix)
    if any([entry[:2] for entry in other] != [entry[:2] for entry in mine] for other in per_rank):
        raise RankDivergenceError(
            f"{doing}: the ranks hold different tensors to take rank 0's values of (per rank: "
            f"{', '.join(f'rank {rank} {len(other)}' for rank, other in enumerate(per_rank))}; or their shapes or "
            "dtypes), so rank 0's cannot be copied onto them. Build the same model on every rank."
        )
    took = not (all(other == mine for other in per_rank) and all(entry[2] is not None for entry in mine))
    if took:
        broadcast_from_first(tensors, group, SYNC_BUCKET_BYTES)
    if group.replicate is not None:  # hybrid sharding: then from the first shard group to the others
        took = take_first_ranks_values(tensors, group.replicate, timeout_s, purpose, doing, fix) or took
    return took


def _digest(tensor: torch.Tensor) -> int | None:
    """``value_digest``, or None for an element size it does not read (then the values are taken anyway)."""
    return value_digest(tensor) if tensor.element_size() in (1, 2, 4, 8) else None


def from_rank0(value, group: dist.ProcessGroup | None = None):
    """Rank 0's ``value`` on every rank (any picklable object; collective): a decision every rank must
    share, made from what rank 0 computed, as under DDP's ``if rank == 0:`` (save when rank 0's
    validation loss improved). ``value`` itself in a world of one."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]
