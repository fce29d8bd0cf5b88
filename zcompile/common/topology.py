"""Nodes of the data-parallel group, and the process groups ZeRO++ runs its collectives on.

Ranks are laid out node-major, as torchrun numbers them: rank ``r`` is local rank ``r % K`` of
node ``r // K`` for ``K`` ranks per node. ZeRO++ needs two families of sub-groups:

- *intra-node*: the K ranks of one node (hpZ's secondary partition, qgZ's first all-to-all);
- *inter-node*: the M = N / K ranks with the same local rank, one per node (qgZ's second
  all-to-all).

Creating a process group is itself collective over the default group, so the groups are made at
compile time, identically on every rank, and found again (torch keeps every group it made, with its
ranks) by later compiles instead of being made twice.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch.distributed as dist

from zcompile.common.process_group import DataParallelGroup, find_group

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeLayout:
    """N ranks as M nodes of K consecutive ranks."""

    world_size: int
    node_size: int

    def __post_init__(self) -> None:
        if self.node_size < 1 or self.world_size % self.node_size:
            raise ValueError(
                f"zcompile: {self.world_size} ranks do not split into nodes of {self.node_size}; "
                "set node_size to a divisor of the world size"
            )

    @property
    def nodes(self) -> int:
        return self.world_size // self.node_size

    def node_of(self, rank: int) -> int:
        return rank // self.node_size

    def local_rank(self, rank: int) -> int:
        return rank % self.node_size

    def intra_ranks(self, node: int) -> list[int]:
        """The ranks of ``node``, in local-rank order."""
        return [node * self.node_size + local for local in range(self.node_size)]

    def inter_ranks(self, local_rank: int) -> list[int]:
        """The ranks with local rank ``local_rank``, one per node, in node order."""
        return [node * self.node_size + local_rank for node in range(self.nodes)]


def spans_nodes(ranks: list[int] | tuple[int, ...], node_size: int) -> bool:
    """Whether the global ``ranks`` lie on more than one node of ``node_size`` ranks (node-major layout)."""
    return len({rank // node_size for rank in ranks}) > 1


@dataclass(frozen=True)
class NodeGroups:
    """This rank's intra-node and inter-node groups."""

    layout: NodeLayout
    intra: DataParallelGroup
    inter: DataParallelGroup


def node_size_from_env(option: int | None, world_size: int) -> int:
    """``option``, else torchrun's ``$LOCAL_WORLD_SIZE``, else ``world_size`` (one node)."""
    if option is not None:
        return option
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local) if local and local.isdigit() and int(local) > 0 else world_size


def node_groups(group: DataParallelGroup, node_size: int) -> NodeGroups:
    """The intra- and inter-node groups of ``group`` for nodes of ``node_size`` ranks (made once).

    Every rank of the default group must call this with the same arguments, in the same order
    (it creates process groups); the backend calls it after the rank check has compared options.
    """
    if group.process_group is None:
        raise ValueError("zcompile: the ZeRO++ node groups need an initialized process group (init_process_group)")
    if dist.get_world_size() != group.world_size:
        raise ValueError(
            "zcompile: the ZeRO++ options (quantize_grads, hpz_size) split the data-parallel group into "
            f"nodes, which needs it to span every rank ({group.world_size} of {dist.get_world_size()} here); "
            "pass group=None or drop those options"
        )
    layout = NodeLayout(group.world_size, node_size)
    ranks = dist.get_process_group_ranks(group.process_group)
    me = group.rank
    intra_ranks = [ranks[r] for r in layout.intra_ranks(layout.node_of(me))]
    inter_ranks = [ranks[r] for r in layout.inter_ranks(layout.local_rank(me))]
    intra, inter = find_group(intra_ranks), find_group(inter_ranks)
    if intra is None or inter is None:  # the same on every rank: all made them, or none did
        intra, _ = dist.new_subgroups_by_enumeration(
            [[ranks[r] for r in layout.intra_ranks(node)] for node in range(layout.nodes)]
        )
        inter, _ = dist.new_subgroups_by_enumeration(
            [[ranks[r] for r in layout.inter_ranks(local)] for local in range(layout.node_size)]
        )
    result = NodeGroups(layout, as_data_parallel_group(intra), as_data_parallel_group(inter))
    log.info(
        "node groups: %d nodes of %d ranks (intra group %s, inter group %s)",
        layout.nodes,
        node_size,
        result.intra.name,
        result.inter.name,
    )
    return result


def as_data_parallel_group(process_group: dist.ProcessGroup) -> DataParallelGroup:
    return DataParallelGroup(
        rank=dist.get_rank(process_group),
        world_size=dist.get_world_size(process_group),
        name=process_group.group_name,
        process_group=process_group,
    )
