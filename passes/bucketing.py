"""Bucket per-parameter collectives: several all-gathers (or reduce-scatters) become one.

Every collective costs a fixed latency on every rank, whatever its size; the per-parameter
collectives of ZeRO-3 are many and small (a LayerNorm bias is a few hundred bytes). Grouping
those that run together into one collective over a flat buffer pays the latency once.

``plan_buckets`` (data, identical on every rank because it reads only the graph) walks the graph's
collectives in order and groups consecutive ones of the same kind, dtype and group until a bucket
reaches ``bucket_bytes``. ``bucket_collectives_pass`` rewrites each bucket:

- all-gather: the members' shards packed into one (``zcompile::pack_bucket``) -> one all-gather ->
  ``zcompile::unpack_bucket``: each member's rank-major ``[N * s_i]``, the value the member produced
  (``passes.bucket_ops``: one op per bucket and direction, not ops per member);
- reduce-scatter: ``zcompile::pack_bucket``: the members' ``[N * s_i]`` inputs side by side per
  rank -> one reduce-scatter -> ``zcompile::unpack_bucket``: the members' ``[s_i]`` results, each
  in a storage of its own. When every member's result is divided by the same N (the mean over
  ranks), the unpack divides too.

The nodes are then re-ordered (``graph_order``) so that each bucket sits before its first use and
after its last input. Inserted nodes carry the members' zcompile tags (``bucket`` index, params).
"""

from __future__ import annotations

import json
import logging
import operator
from dataclasses import asdict, dataclass, field

import torch

from zcompile.passes import metadata
from zcompile.passes.bucket_ops import PACK_BUCKET, UNPACK_BUCKET
from zcompile.passes.collectives import ALL_GATHER, REDUCE_SCATTER, WAIT, CollectiveNode
from zcompile.passes.graph_order import apply_order, topological_order
from zcompile.passes.inline import graph_fake_mode
from zcompile.passes.op_sets import SHAPE_VIEWS

log = logging.getLogger(__name__)

aten = torch.ops.aten


@dataclass(frozen=True)
class Bucket:
    """Collectives merged into one: their node names, parameters and per-rank sizes (elements)."""

    kind: str
    members: tuple[str, ...]
    params: tuple[str, ...]
    sizes: tuple[int, ...]  # per member: shard elements (all_gather input, reduce_scatter output)
    dtype: str
    group_size: int
    group_name: str

    @property
    def elements(self) -> int:
        return sum(self.sizes)


@dataclass
class BucketPlan:
    graph: str
    bucket_bytes: int
    buckets: list[Bucket] = field(default_factory=list)

    @property
    def collectives_before(self) -> int:
        return sum(len(b.members) for b in self.buckets)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def _bucketable(node: torch.fx.Node) -> CollectiveNode | None:
    """``node`` as a collective that can join a bucket: ZeRO's all-gather, or its sum reduce-scatter of
    whole shards, with a known input and waited by its only user (the model's own collectives keep
    their shapes: a bucket is flat)."""
    collective = CollectiveNode.of(node)
    if collective is None or not collective.is_zero or collective.kind not in ("all_gather", "reduce_scatter"):
        return None
    if collective.input_val is None or collective.wait is None:
        return None
    if collective.kind == "reduce_scatter" and (
        collective.reduce_op != "sum" or collective.input_val.numel() % collective.group_size
    ):
        return None
    return collective


def plan_buckets(gm: torch.fx.GraphModule, bucket_bytes: int, graph: str = "") -> BucketPlan:
    """Groups consecutive collectives of one kind into buckets of at most ``bucket_bytes`` per rank.

    Size is counted as ZeRO counts volume: an all-gather's output, a reduce-scatter's input. A
    collective larger than the budget forms a bucket of its own; a bucket of one is left alone.
    """
    plan = BucketPlan(graph, bucket_bytes)
    # one open bucket per (kind, group, dtype): a backward interleaves gathers and reductions,
    # and each kind is bucketed along its own sequence
    open_buckets: dict[tuple, list[tuple[torch.fx.Node, int]]] = {}

    def close(key) -> None:
        members = open_buckets.pop(key, [])
        if len(members) > 1:
            kind, group_name, group_size, dtype = key
            plan.buckets.append(
                Bucket(
                    kind,
                    tuple(n.name for n, _ in members),
                    tuple(metadata.tags(n).get(metadata.PARAM, "?") for n, _ in members),
                    tuple(size for _, size in members),
                    str(dtype),
                    group_size,
                    group_name,
                )
            )

    for node in gm.graph.nodes:
        collective = _bucketable(node)
        if collective is None:
            continue
        shard_elements, group_size, dtype = collective.shard_elements, collective.group_size, collective.dtype
        key = (collective.kind, collective.group_name, group_size, dtype)
        bucket = open_buckets.get(key, [])
        used = sum(size for _, size in bucket) * group_size * dtype.itemsize
        if bucket and used + shard_elements * group_size * dtype.itemsize > bucket_bytes:
            close(key)
        open_buckets.setdefault(key, []).append((node, shard_elements))
    for key in list(open_buckets):
        close(key)
    position = {node.name: index for index, node in enumerate(gm.graph.nodes)}
    plan.buckets.sort(key=lambda b: min(position[name] for name in b.members))
    return plan


def bucket_collectives_pass(gm: torch.fx.GraphModule, plan: BucketPlan) -> torch.fx.GraphModule:
    """Rewrites every bucket of ``plan`` into one collective (see the module docstring)."""
    if not plan.buckets:
        return gm
    graph = gm.graph
    by_name = {node.name: node for node in graph.nodes}
    fake_mode = graph_fake_mode(gm)
    for index, bucket in enumerate(plan.buckets):
        members = [by_name[name] for name in bucket.members]
        waits = [next(iter(m.users)) for m in members]
        anchor = members[0] if bucket.kind == "all_gather" else members[-1]
        # the nodes inserted are those between the anchor's old predecessor and the anchor: found
        # there, not by a scan of the whole graph per bucket (quadratic in the parameters)
        before_insertion = anchor.prev
        averaged = _averages(waits) if bucket.kind == "reduce_scatter" else []
        with graph.inserting_before(anchor):
            if bucket.kind == "all_gather":
                results = _gather_bucket(graph, members, bucket)
            else:
                results = _reduce_bucket(graph, members, bucket, averaged[0].args[1] if averaged else None)
        new_nodes = []
        node = before_insertion.next
        while node is not anchor:
            new_nodes.append(node)
            node = node.next
        for average, result in zip(averaged, results):  # the bucket was averaged as a whole
            average.replace_all_uses_with(result)
            graph.erase_node(average)
        for wait, result in zip(waits, results):
            wait.replace_all_uses_with(result)
        for wait, member in zip(waits, members):
            member_input = member.args[0]
            graph.erase_node(wait)
            graph.erase_node(member)
            if not member_input.users and member_input.target in SHAPE_VIEWS:  # read around (_unflattened)
                graph.erase_node(member_input)
        for node in new_nodes:
            metadata.tag(
                node,
                bucket=index,
                params=list(bucket.params),
                role=metadata.ROLE_GATHER if bucket.kind == "all_gather" else metadata.ROLE_REDUCE,
            )
            by_name[node.name] = node
            _set_val(node, fake_mode)
    apply_order(gm, topological_order(gm))
    log.info("bucketing (%s): %d collectives -> %d buckets", plan.graph, plan.collectives_before, len(plan.buckets))
    return gm


def _gather_bucket(graph: torch.fx.Graph, members: list[torch.fx.Node], bucket: Bucket) -> list[torch.fx.Node]:
    flat = graph.call_function(PACK_BUCKET, ([m.args[0] for m in members], 1))
    gathered = graph.call_function(ALL_GATHER, (flat, bucket.group_size, bucket.group_name))
    waited = graph.call_function(WAIT, (gathered,))
    pieces = graph.call_function(UNPACK_BUCKET, (waited, bucket.group_size, list(bucket.sizes), 1.0))
    return [graph.call_function(operator.getitem, (pieces, i)) for i in range(len(bucket.sizes))]


def _averages(waits: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The members' ``div(wait, N)`` (the mean over ranks), one per member, when every member is
    divided by the same number and read only so: then the bucket's ``unpack_bucket`` divides (the
    same values, element by element; one op where there were as many as members)."""
    averages = [next(iter(wait.users)) if len(wait.users) == 1 else None for wait in waits]
    if any(
        a is None or a.target is not aten.div.Tensor or a.args[0] is not w or isinstance(a.args[1], torch.fx.Node)
        for a, w in zip(averages, waits)
    ):
        return []
    return averages if len({a.args[1] for a in averages}) == 1 else []


def _unflattened(gradient: torch.fx.Node) -> torch.fx.Node:
    """The gradient before its flattening ``view(grad, [-1])``, where it was flattened only to be
    reduce-scattered: ``pack_bucket`` reads each member as ``[N, numel / N]`` whatever its shape, so
    the flattening view is one node per parameter for the inner compiler and nothing for the data."""
    source = gradient.args[0] if gradient.op == "call_function" and gradient.target in SHAPE_VIEWS else None
    if (
        source is None
        or len(gradient.users) != 1
        or not isinstance(source, torch.fx.Node)
        or not isinstance(source.meta.get("val"), torch.Tensor)
        or not isinstance(gradient.meta.get("val"), torch.Tensor)
        or gradient.meta["val"].dim() != 1
    ):
        return gradient
    return source


def _reduce_bucket(
    graph: torch.fx.Graph, members: list[torch.fx.Node], bucket: Bucket, divisor: int | float | None
) -> list[torch.fx.Node]:
    flat = graph.call_function(PACK_BUCKET, ([_unflattened(m.args[0]) for m in members], bucket.group_size))
    reduced = graph.call_function(REDUCE_SCATTER, (flat, "sum", bucket.group_size, bucket.group_name))
    waited = graph.call_function(WAIT, (reduced,))
    pieces = graph.call_function(UNPACK_BUCKET, (waited, 1, list(bucket.sizes), float(divisor or 1)))
    return [graph.call_function(operator.getitem, (pieces, i)) for i in range(len(bucket.sizes))]


def _set_val(node: torch.fx.Node, fake_mode) -> None:
    """Fills ``meta["val"]`` of an inserted node by running it on its inputs' fake values."""

    def val(arg):
        if isinstance(arg, torch.fx.Node):
            return arg.meta["val"]
        if isinstance(arg, (list, tuple)):
            return type(arg)(val(a) for a in arg)
        return arg

    args, kwargs = val(node.args), val(node.kwargs)
    if fake_mode is None:
        node.meta["val"] = node.target(*args, **kwargs)
        return
    with fake_mode:
        node.meta["val"] = node.target(*args, **kwargs)
