"""Insert plain torch code into an FX graph: trace it on the graph's fake values, copy the nodes in.

A pass that replaces one node by a dozen (a quantized all-gather, a hierarchical reduce-scatter)
is clearest written as ordinary torch code. ``inline_call`` traces that code with ``make_fx`` on
the fake values of its arguments (so every inserted node has ``meta["val"]``, which later passes
read) and copies the traced nodes at the graph's current insertion point.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from zcompile.passes import metadata


def graph_fake_mode(gm: torch.fx.GraphModule):
    """The fake mode of the graph's ``meta["val"]`` tensors (None if it has none)."""
    return torch._guards.detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if "val" in n.meta])


def inline_call(graph: torch.fx.Graph, fn: Callable[..., Any], args: list[torch.fx.Node], fake_mode,
                tags: dict | None = None) -> Any:
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
