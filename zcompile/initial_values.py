"""Every rank starts from the same weights: a digest of each parameter's values when it is sharded,
compared at the first step, and ``sync_module_states`` to take rank 0's.

Why: a rank's shard is cut from its own copy of the parameter. Ranks that built the model with
different weights (no common seed, or a checkpoint loaded on rank 0 only, counting on DDP, which
broadcasts rank 0's parameters when it wraps the model) then train a mix of their weights: rank 0's
first slice, rank 1's second, with no word. Measured before this check on 2 ranks: a 3-layer MLP
initialized with seed = rank trained to weights 0.49 away from DDP's at stages 1 and 3.

How: ``value_digest`` is the sum of the values' bit patterns as integers, exact and independent of
the order of the sum (so the same on any device and thread count); ``zcompile.param_shards`` takes
it when it shards a parameter, before the full value is freed, and the next step's agreement
(``zcompile.step_agreement``) compares every rank's digests of the parameters sharded since the
last agreement, before anything is updated: different weights are a ``RankDivergenceError`` on
every rank naming the parameters and the fixes. It costs one pass over each parameter when it is
sharded and no collective: the digests ride the step's store exchange.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zcompile.process_group import DataParallelGroup

_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def value_digest(tensor: torch.Tensor) -> int:
    """The sum of ``tensor``'s values' bit patterns, as a Python int (exact; module doc)."""
    flat = tensor.detach().reshape(-1)
    return int(flat.view(_BITS[flat.element_size()]).sum(dtype=torch.int64))


def pending_digests(members: list) -> dict[str, int]:
    """Name -> digest of the members sharded since the ranks last compared them."""
    return {m.name: m.initial_digest for m in members if m.initial_digest is not None}


def differing_parameters(per_rank: list[dict[str, int]], rank: int) -> list[str]:
    """The parameters whose digest on some rank differs from ``rank``'s (or that some rank lacks)."""
    mine = per_rank[rank]
    names = dict.fromkeys(name for digests in per_rank for name in digests)
    return [name for name in names if any(digests.get(name) != mine.get(name) for digests in per_rank)]


@torch.no_grad()
def sync_module_states(module: torch.nn.Module, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Every rank's parameters and buffers = rank ``src``'s (of ``group``), as DDP does when it wraps a
    model: call it before ``torch.compile`` when the ranks built or loaded the model differently
    (a checkpoint loaded on rank 0 only). One broadcast per tensor."""
    from zcompile.param_shards import shard_of  # local: param_shards imports this module

    sharded = [name for name, p in module.named_parameters() if shard_of(p) is not None]
    if sharded:
        raise ValueError(
            f"zcompile.sync_module_states: parameters are already sharded ({', '.join(sharded[:3])}"
            f"{', ...' if len(sharded) > 3 else ''}): call it before the first call of the compiled model")
    resolved = DataParallelGroup.resolve(group)
    if resolved.world_size == 1:
        return
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, group_src=src, group=resolved.process_group)
