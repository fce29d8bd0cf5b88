"""The data-parallel process group and the eager collectives of the runtime (optimizer step, ``gathered``).

Graphs issue their collectives through ``zcompile.passes.collectives`` (functional ops, traced);
code that runs outside graphs uses the public ``torch.distributed`` API through the helpers here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

@dataclass(frozen=True)
class DataParallelGroup:
    """The ranks that share one model replica's states: ``world_size == 1`` means no communication."""

    rank: int
    world_size: int
    name: str | None
    process_group: dist.ProcessGroup | None

    @classmethod
    def resolve(cls, group: dist.ProcessGroup | None = None) -> DataParallelGroup:
        if not (dist.is_available() and dist.is_initialized()):
            if group is not None:
                raise RuntimeError("zero backend: a group was given but torch.distributed is not initialized")
            return cls(rank=0, world_size=1, name=None, process_group=None)
        group = group if group is not None else dist.group.WORLD
        return cls(
            rank=dist.get_rank(group),
            world_size=dist.get_world_size(group),
            name=group.group_name,
            process_group=group,
        )


# torch 2.13 renamed the flat collectives (*_into_tensor / *_tensor -> *_single); 2.11 has the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_eager(out: torch.Tensor, shard: torch.Tensor, group: DataParallelGroup,
                     async_op: bool = False) -> dist.Work | None:
    """``out`` = every rank's ``shard`` concatenated; with ``async_op`` returns the work to wait on."""
    return _all_gather_flat(out, shard, group=group.process_group, async_op=async_op)


def reduce_scatter_eager(out: torch.Tensor, full: torch.Tensor, group: DataParallelGroup,
                         async_op: bool = False) -> dist.Work | None:
    """``out`` = this rank's slice of the sum of every rank's ``full``; ``async_op`` as above."""
    return _reduce_scatter_flat(out, full, op=dist.ReduceOp.SUM, group=group.process_group, async_op=async_op)


def gather_to_first_eager(out: torch.Tensor | None, shard: torch.Tensor, group: DataParallelGroup) -> None:
    """``out`` (on the group's rank 0; None elsewhere) = every rank's ``shard`` concatenated."""
    pieces = list(out.view(group.world_size, -1).unbind(0)) if group.rank == 0 else None
    dist.gather(shard, pieces, group_dst=0, group=group.process_group)


def all_reduce_eager(tensor: torch.Tensor, group: DataParallelGroup, op: dist.ReduceOp.RedOpType) -> None:
    """``tensor`` (in place) = ``op`` over every rank's ``tensor`` (a scalar, for gradient clipping)."""
    dist.all_reduce(tensor, op=op, group=group.process_group)


def find_group(ranks: list[int]) -> dist.ProcessGroup | None:
    """A process group already made with exactly ``ranks`` (global ranks, in group-rank order), or None.

    Reads torch's registry of groups (``_world.pg_group_ranks``, semi-private; kept here).
    """
    for group, members in dist.distributed_c10d._world.pg_group_ranks.items():
        if group is dist.GroupMember.NON_GROUP_MEMBER or len(members) != len(ranks):
            continue
        if sorted(members, key=members.__getitem__) == list(ranks):
            return group
    return None


def group_ranks_by_name() -> dict[str, tuple[int, ...]]:
    """The global ranks (in group-rank order) of every process group this rank is in, by group name:
    what the ``group_name`` argument of a graph's collective stands for. Reads the registry
    ``find_group`` reads."""
    return {group.group_name: tuple(sorted(members, key=members.__getitem__))
            for group, members in dist.distributed_c10d._world.pg_group_ranks.items()
            if group is not dist.GroupMember.NON_GROUP_MEMBER}


def default_store() -> dist.Store:
    """The key-value store of the default process group (used for rank checks, never for data)."""
    return dist.distributed_c10d._get_default_store()
