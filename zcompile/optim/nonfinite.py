"""Steps whose gradients are not finite, skipped by every rank together.

A NaN or inf gradient on one rank reaches the others only through the reductions, and at stages
2 and 3 only the shards its elements fall in: a rank deciding from its own gradients would skip a
step the others take, and the ranks' weights (and then their collectives) diverge. So every
rank decides from every rank's flag: the flags ride on the store exchange the step makes anyway
(``zcompile.agreement.step_agreement``), or, with that check off, one flag is all-reduced (MAX) over the
group: every rank skips, or none. When the step clips, the global gradient norm already went through an all-reduce and is not finite exactly when
some rank's gradient is not: it decides, with no extra collective.

The rank-local ``if not torch.isfinite(loss): continue`` is the pattern this replaces: a rank that
skips alone leaves the others waiting in their step (zcompile.agreement.step_agreement then fails every rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zcompile.backend.compiled import compiled_graphs_of_params
from zcompile.common.comm_volume import CollectiveRecord
from zcompile.common.process_group import DataParallelGroup, all_reduce_eager
from zcompile.sharding.shards import ShardedParam


def local_grads_finite(members: list[ShardedParam]) -> bool:
    """Whether every gradient this rank holds for ``members`` (shard and full) is finite.

    Read from each gradient's fp32 norm, which is finite exactly when its elements are (or they are
    so large, beyond about 1e19, that their squares overflow fp32: a step worth skipping too). One
    vectorized pass per gradient: ``torch.isfinite(g).all()`` makes a boolean tensor of the
    gradient's size first and costs several times as much on CPU."""
    grads = [g.detach() for m in members for g in (m.shard_grad, m.full_grad) if g is not None]
    if not grads:
        return True
    norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
    return bool(torch.isfinite(norms).all())


def nonfinite_flag(members: list[ShardedParam]) -> tuple[bool, CollectiveRecord | None]:
    """Whether any rank of the members' group has a non-finite gradient (collective: one scalar
    all-reduce), and the record of that all-reduce (None in a world of one)."""
    nonfinite = not local_grads_finite(members)
    group = members[0].group if members else None
    if group is None or group.world_size == 1:
        return nonfinite, None
    flag = torch.tensor(float(nonfinite), device=members[0].shard.device)
    record = any_rank_flag(flag, group)
    return bool(flag.item() > 0), record


def any_rank_flag(flag: torch.Tensor, group: DataParallelGroup | None) -> CollectiveRecord | None:
    """``flag`` (fp32; 1.0 for "not finite here", and any other values to take the max of) becomes
    every rank's: one MAX all-reduce over ``group``, in place. Returns its record (None in a world of
    one: nothing to do)."""
    if group is None or group.world_size == 1:
        return None
    all_reduce_eager(flag, group, dist.ReduceOp.MAX)
    if group.tensor_parallel is not None:  # a tensor-parallel model: its other pieces' ranks decide with it
        all_reduce_eager(flag, group.tensor_parallel, dist.ReduceOp.MAX)
    return CollectiveRecord(
        "all_reduce", flag.numel(), torch.float32, "optimizer", (), group.name or "", group.world_size
    )


def skip_nonfinite_by_default(params: list[torch.nn.Parameter]) -> bool:
    """``skip_nonfinite=None``: on under fp16 (parameters in fp16, or compiled with param_dtype fp16),
    where overflowing gradients are expected; off otherwise."""
    if any(p.dtype == torch.float16 for p in params):
        return True
    return any(g.context.config.param_dtype == torch.float16 for g in compiled_graphs_of_params(params))
