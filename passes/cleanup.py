"""Remove collectives whose results nobody reads.

AOTAutograd can leave, in a forward or backward graph, an all-gather whose result is used only
for its size (the partitioner recomputes a shape from it) or not at all. Each one still costs a
collective on every rank, issued with no wait. Shapes of parameters are static, so the size
queries are folded to constants and the whole chain is erased.
"""

from __future__ import annotations

import logging

import torch

from zcompile.passes.collectives import ALL_GATHER
from zcompile.passes.op_sets import PASS_THROUGH, SIZE_QUERIES

log = logging.getLogger(__name__)


def _unread_chain(gather: torch.fx.Node) -> tuple[list[torch.fx.Node], list[torch.fx.Node]] | None:
    """The chain from ``gather`` and its size queries, or ``None`` if its data is read."""
    chain, size_queries, frontier = [gather], [], [gather]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.op == "call_function" and user.target in SIZE_QUERIES:
                if not isinstance(user.meta.get("val"), int):
                    return None
                size_queries.append(user)
            elif user.op == "call_function" and user.target in PASS_THROUGH:
                if user not in chain:
                    chain.append(user)
                    frontier.append(user)
            else:
                return None
    return chain, size_queries


def remove_unused_gathers_pass(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Erases all-gathers whose result (through views, casts and waits) is unused or only sized.

    Reads ``node.meta["val"]`` of size queries to fold them to constants. Returns ``gm`` unchanged
    when every all-gather's data is read.
    """
    graph = gm.graph
    removed = 0
    for gather in list(graph.find_nodes(op="call_function", target=ALL_GATHER)):
        found = _unread_chain(gather)
        if found is None:
            continue
        chain, size_queries = found
        for query in size_queries:
            query.replace_all_uses_with(query.meta["val"])
            graph.erase_node(query)
        for node in reversed(chain):
            graph.erase_node(node)
        removed += 1
    if removed:
        graph.lint()
        gm.recompile()
        log.info("remove_unused_gathers: erased %d all-gathers whose result was never read", removed)
    return gm
