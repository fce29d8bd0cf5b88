"""Insert plain torch code into an FX graph: trace it on the graph's fake values, copy the nodes in.

A pass that replaces one node by a dozen (a quantized all-gather, a hierarchical reduce-scatter)
is clearest written as ordinary torch code. ``inline_call`` traces that code with ``make_fx`` on
the fake values of its arguments (so every inserted node has ``meta["val"]``, which later passes
read) and copies the traced nodes at the graph's current insertion point.

``write_out_calls`` is the other direction's mechanism: an op of zcompile's that AOTAutograd traced
as one node (a gradient's reduction, a stage-3 gather) replaced by the aten ops and collectives it
stands for, node by node, each with the op's metadata and a fake value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from zcompile.passes import metadata


def graph_fake_mode(gm: torch.fx.GraphModule):
    """The fake mode of the graph's ``meta["val"]`` tensors (None if it has none)."""
    return torch._guards.detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if "val" in n.meta])


def inline_call(
    graph: torch.fx.Graph, fn: Callable[..., Any], args: list[torch.fx.Node], fake_mode, tags: dict | None = None
) -> Any:
    """Inserts ``fn(*args)`` (tensor args are nodes) before the current insertion point.

    Returns the node(s) standing for ``fn``'s result, in its structure (a node, or a tuple of
    nodes). ``tags`` (zcompile metadata) are set on every inserted node.
    """
    values = [a.meta["val"] for a in args]
    with fake_mode:
        traced = make_fx(fn, tracing_mode="real", pre_dispatch=False)(*values)
    placeholders = traced.graph.find_nodes(op="placeholder")
    value_map = dict(zip(placeholders, args))
    result = graph.graph_copy(traced.graph, value_map)  # fills value_map: traced node -> inserted node
    if tags:
        for inserted in (value_map[n] for n in traced.graph.nodes if n.op != "output" and n not in placeholders):
            metadata.tag(inserted, **tags)
    return result


# what describes the written-out op's own output, not the nodes that replace it
_OUTPUT_META = ("val", "tensor_meta", "original_aten")


class AddNode(Protocol):
    def __call__(self, target: Callable, args: list, kwargs: dict | None = None) -> torch.fx.Node: ...


def write_out_calls(gm: torch.fx.GraphModule, target, write_out: Callable[..., torch.fx.Node]) -> int:
    """Replaces every call of op ``target`` in ``gm`` by what ``write_out(add, *call.args)`` builds with
    ``add(op, args, kwargs=None)`` before it, returning the node that stands for the call's value.
    Each added node gets the call's metadata (zcompile's tags, the stack trace, seq_nr, the
    partitioner's recompute tag) and its ``meta["val"]`` from running ``op`` in the graph's fake mode.
    Returns how many calls it replaced; ``gm`` is linted and recompiled when there were any."""
    calls = gm.graph.find_nodes(op="call_function", target=target)
    if not calls:
        return 0
    graph, fake_mode = gm.graph, graph_fake_mode(gm)
    for call in calls:
        meta = {key: value for key, value in call.meta.items() if key not in _OUTPUT_META}

        def add(op, args, kwargs=None) -> torch.fx.Node:
            made = graph.call_function(op, tuple(args), kwargs or {})
            made.meta.update(meta)
            values = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
            with fake_mode:
                made.meta["val"] = op(*values, **(kwargs or {}))
            return made

        with graph.inserting_before(call):
            result = write_out(add, *call.args)
        call.replace_all_uses_with(result)
        graph.erase_node(call)
    graph.lint()
    gm.recompile()
    return len(calls)
