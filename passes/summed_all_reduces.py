"""Tensor parallelism's backward: all-reduces whose results are only added up, made one all-reduce of
the sum.

A tensor-parallel layer whose input several column-wise linears read (q, k and v; an MLP's gate and
up) gets one partial input gradient from each, and each is all-reduced over the tp group on its own
(torch's DTensor turns each linear's Partial gradient into Replicate where that linear's input was
made a DTensor); autograd then adds the results. A sum of all-reduces is the all-reduce of the sum,
so ``add(wait(all_reduce(x)), wait(all_reduce(y)))`` becomes ``wait(all_reduce(add(x, y)))``: for a
Llama layer 2 all-reduces in backward instead of 5, the same bytes each. The sum is reassociated
(each rank adds its partials before the ranks are added), a change in rounding only.

Only the model's own all-reduces with the sum, on one group, of one shape and dtype, each read by
its wait alone and the wait by the add alone, are merged: zcompile's (tagged with a role) and
anything else read elsewhere stay as they are. Chains (``(a + b) + c``) merge to one. The merged
all-reduce is issued right after the later of ``x`` and ``y`` is made, and waited where the add was.
"""

from __future__ import annotations

import logging

import torch

from zcompile.passes.collectives import ALL_REDUCE, WAIT, is_zero_collective

log = logging.getLogger(__name__)
aten = torch.ops.aten


def merge_summed_all_reduces_pass(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Each ``add`` of two waited sum all-reduces on one group becomes one all-reduce of the added
    inputs (module docstring). Reads ``meta["val"]`` of the inputs and the add; writes it on the new
    nodes."""
    graph = gm.graph
    merged = 0
    # one pass in graph order: an outer add of a chain meets the wait its inner add became
    for add in list(graph.nodes):
        pair = _summed_pair(add)
        if pair is None:
            continue
        (x, first), (y, second), group_name = pair
        with graph.inserting_after(_later(x, y)):
            total = graph.call_function(aten.add.Tensor, (x, y))
        with graph.inserting_after(total):
            reduced = graph.call_function(ALL_REDUCE, (total, "sum", group_name))
        with graph.inserting_before(add):
            arrived = graph.call_function(WAIT, (reduced,))
        value = add.meta["val"]
        for node in (total, reduced, arrived):
            node.meta["val"] = value.new_empty(value.shape)
        add.replace_all_uses_with(arrived)
        for node in (add, *first, *second):
            graph.erase_node(node)
        merged += 1
    if merged:
        log.info("merge_summed_all_reduces: %d all-reduces of the model's merged into their sums", merged)
    graph.lint()
    gm.recompile()
    return gm


def _later(a: torch.fx.Node, b: torch.fx.Node) -> torch.fx.Node:
    """Whichever of ``a`` and ``b`` comes later in the graph: both walked forward in step, the one
    the other's walk meets first is the later (steps: their distance, not the graph's length)."""
    from_a, from_b = a, b
    while True:
        from_a, from_b = from_a.next, from_b.next
        if from_a is b or from_b.op == "root":
            return b
        if from_b is a or from_a.op == "root":
            return a


def _summed_pair(add: torch.fx.Node):
    """``((x, nodes), (y, nodes), group)`` when ``add`` adds two waited sum all-reduces of ``x`` and ``y``
    on one group, alike in shape and dtype, read nowhere else (``nodes``: the wait and the
    all-reduce, to erase); else None."""
    if add.op != "call_function" or add.target is not aten.add.Tensor or len(add.args) != 2 or add.kwargs:
        return None
    sides = [_waited_sum(arg, add) for arg in add.args]
    if None in sides:
        return None
    (x, x_nodes, x_group), (y, y_nodes, y_group) = sides
    if x_group != y_group or x is y:
        return None
    x_val, y_val = x.meta.get("val"), y.meta.get("val")
    if not isinstance(x_val, torch.Tensor) or not isinstance(y_val, torch.Tensor):
        return None
    if x_val.shape != y_val.shape or x_val.dtype != y_val.dtype or "val" not in add.meta:
        return None
    return (x, x_nodes), (y, y_nodes), x_group


def _waited_sum(node, reader: torch.fx.Node):
    """``(input, (wait, all_reduce), group)`` when ``node`` is the wait of the model's sum all-reduce,
    read by ``reader`` alone and its all-reduce by the wait alone; else None."""
    if not isinstance(node, torch.fx.Node) or node.target is not WAIT or list(node.users) != [reader]:
        return None
    reduce = node.args[0]
    if not isinstance(reduce, torch.fx.Node) or reduce.target is not ALL_REDUCE or list(reduce.users) != [node]:
        return None
    if is_zero_collective(reduce) or len(reduce.args) != 3 or reduce.args[1] != "sum" or reduce.kwargs:
        return None
    source = reduce.args[0]
    if not isinstance(source, torch.fx.Node):
        return None
    return source, (node, reduce), reduce.args[2]
