"""The functional collectives of zcompile's graphs: the ops, their kinds, and one view of a collective node.

This module owns the vocabulary every pass, report and cost model speaks about collectives:

- the ``_c10d_functional`` ops the graphs call (what ``torch.distributed._functional_collectives``
  lowers to, and what inductor's collective passes recognise) and their kind names;
- ``CollectiveNode``: a collective node decoded once (kind, input, group size and name, reduce op,
  its wait) with the volume it moves, counted per rank the way ZeRO's formulas count it: an
  all-gather moves its output (input x group size), the others their input;
- ``is_zero_collective``: whether a collective moves parameters or gradients for ZeRO (the passes
  rewrite only those) or is the model's own;
- ``all_gather_in_graph`` / ``reduce_scatter_in_graph``: traceable helpers that issue and wait.

Argument layouts (torch 2.11-2.13): ``all_gather_into_tensor(input, group_size, group_name)``,
``reduce_scatter_tensor(input, reduce_op, group_size, group_name)``, ``all_reduce(input, reduce_op,
group_name)``, ``all_to_all_single(input, output_split_sizes, input_split_sizes, group_name)``,
``wait_tensor(input)``. The group name is always the last argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zcompile.passes.metadata import GROUP_SIZE, LOWERED_FROM, ROLE, ZERO_COLLECTIVE_ROLES, tags
from zcompile.passes.sizes import traced_int

_functional = torch.ops._c10d_functional

ALL_GATHER = _functional.all_gather_into_tensor.default
REDUCE_SCATTER = _functional.reduce_scatter_tensor.default
ALL_REDUCE = _functional.all_reduce.default
ALL_TO_ALL = _functional.all_to_all_single.default
WAIT = _functional.wait_tensor.default
COLLECTIVE_KINDS = {
    ALL_GATHER: "all_gather",
    REDUCE_SCATTER: "reduce_scatter",
    ALL_REDUCE: "all_reduce",
    ALL_TO_ALL: "all_to_all",
}  # op -> the name reports, plans, dumps and cost models use
COLLECTIVE_OPS = tuple(COLLECTIVE_KINDS)
KINDS = tuple(COLLECTIVE_KINDS.values())


def collective_kind(node: torch.fx.Node) -> str | None:
    """The kind of a collective node (``"all_gather"``, ...), or None for any other node: what the
    collective does, also where it runs in another form (``reduce_scatter_lowering``)."""
    if node.op != "call_function" or node.target not in COLLECTIVE_KINDS:
        return None
    return tags(node).get(LOWERED_FROM) or COLLECTIVE_KINDS[node.target]


def is_zero_collective(node: torch.fx.Node) -> bool:
    """Whether collective ``node`` moves parameters or gradients for ZeRO: zcompile inserted it (or
    AOTAutograd traced it from a node zcompile inserted), so it carries a role. A collective the
    model calls itself (``torch.distributed._functional_collectives`` in a contrastive loss, say)
    has none; bucketing, lowering and quantizing, which assume a flat shard of a parameter or a
    gradient, must leave it as the model wrote it."""
    return tags(node).get(ROLE) in ZERO_COLLECTIVE_ROLES


@dataclass(frozen=True)
class CollectiveNode:
    """One collective node of an aten-level graph, its arguments decoded.

    ``group_size`` is 0 for an all-reduce (its arguments do not say), but one zcompile inserted and
    tagged with ``GROUP_SIZE``.
    """

    node: torch.fx.Node
    kind: str
    input: torch.fx.Node
    group_size: int
    group_name: str
    reduce_op: str | None = None

    @classmethod
    def of(cls, node: torch.fx.Node) -> CollectiveNode | None:
        """The view of ``node``, or None when it is not a collective."""
        kind = collective_kind(node)
        if kind is None:
            return None
        args = node.args
        if kind == "all_gather":
            return cls(node, kind, args[0], int(args[1]), str(args[2]))
        if node.target is ALL_TO_ALL:  # also a reduce-scatter run as one: input, splits, splits, group
            return cls(node, kind, args[0], len(args[1]), str(args[3]), "sum" if kind == "reduce_scatter" else None)
        if kind == "reduce_scatter":
            return cls(node, kind, args[0], int(args[2]), str(args[3]), str(args[1]))
        if kind == "all_reduce":
            return cls(node, kind, args[0], int(tags(node).get(GROUP_SIZE, 0)), str(args[2]), str(args[1]))

    @property
    def is_zero(self) -> bool:
        """See ``is_zero_collective``."""
        return is_zero_collective(self.node)

    @property
    def waits(self) -> list[torch.fx.Node]:
        return [user for user in self.node.users if user.target is WAIT]

    @property
    def wait(self) -> torch.fx.Node | None:
        """The ``wait_tensor`` of this collective when it is its only user (the form passes rewrite)."""
        users = list(self.node.users)
        return users[0] if len(users) == 1 and users[0].target is WAIT else None

    @property
    def input_val(self) -> torch.Tensor | None:
        return self.input.meta.get("val")

    @property
    def dtype(self) -> torch.dtype:
        return self.input_val.dtype

    @property
    def elements(self) -> int:
        """Elements this rank moves: an all-gather's output, any other collective's input (a dynamic
        size at its traced value: the model's own gather of a batch, say)."""
        numel = traced_int(self.input_val.numel())
        return numel * self.group_size if self.kind == "all_gather" else numel

    @property
    def bytes(self) -> int:
        return self.elements * self.dtype.itemsize

    @property
    def shard_elements(self) -> int:
        """Elements of one rank's shard: an all-gather's input, a reduce-scatter's output."""
        numel = traced_int(self.input_val.numel())
        return numel // self.group_size if self.kind == "reduce_scatter" else numel


def collective_nodes(gm: torch.fx.GraphModule | None) -> list[CollectiveNode]:
    """The collectives of ``gm`` in graph order (none for ``None``: a graph not compiled yet)."""
    if gm is None:
        return []
    return [c for c in map(CollectiveNode.of, gm.graph.nodes) if c is not None]


def all_gather_in_graph(shard: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    """Concatenation of every rank's ``shard`` along dim 0 (functional; traceable)."""
    return WAIT(ALL_GATHER(shard, world_size, group_name))


def reduce_scatter_in_graph(full: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    """This rank's 1/N slice of the sum of every rank's ``full`` (functional; traceable)."""
    return WAIT(REDUCE_SCATTER(full, "sum", world_size, group_name))
