"""Re-linearize an FX graph after a rewrite: a stable topological order with priorities.

Rewrites that replace several nodes by one (a bucket) can leave a node before one of its inputs
or users; the scheduling passes move collectives on purpose. Both end by calling
``topological_order`` / ``apply_order``, which order the nodes so that every input comes first
and, among the nodes that are ready, the one with the smallest priority goes first (by default
its current position, pulled forward to the earliest position of anything that needs it, so a
node is placed just before its earliest consumer rather than wherever it was created).
"""

from __future__ import annotations

import heapq

import torch


def needed_by_priority(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, float]:
    """Each node's position, lowered to the lowest priority of its users (producers go early).

    Users may currently sit before their producer (that is what re-ordering repairs), so the
    minimum is taken over the dependency graph, not over the node list.
    """
    position = {node: float(i) for i, node in enumerate(gm.graph.nodes)}
    priority: dict[torch.fx.Node, float] = {}
    for root in gm.graph.nodes:
        stack = [(root, False)]
        while stack:  # iterative post-order DFS over users
            node, users_done = stack.pop()
            if node in priority:
                continue
            if users_done:
                priority[node] = min([position[node]] + [priority[user] for user in node.users])
                continue
            stack.append((node, True))
            stack.extend((user, False) for user in node.users if user not in priority)
    return priority


def topological_order(
    gm: torch.fx.GraphModule, priority: dict[torch.fx.Node, float] | None = None
) -> list[torch.fx.Node]:
    """Nodes in an order that respects data dependencies, ties broken by (priority, position)."""
    nodes = list(gm.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    priority = priority if priority is not None else needed_by_priority(gm)
    waiting = {node: len(set(node.all_input_nodes)) for node in nodes}
    ready = [(priority[node], position[node], node) for node in nodes if waiting[node] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, _, node = heapq.heappop(ready)
        order.append(node)
        for user in node.users:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, (priority[user], position[user], user))
    if len(order) != len(nodes):
        raise RuntimeError("graph has a cycle: cannot order it topologically")
    # placeholders first, output last, as FX requires
    return (
        [n for n in order if n.op == "placeholder"]
        + [n for n in order if n.op not in ("placeholder", "output")]
        + [n for n in order if n.op == "output"]
    )


def apply_order(gm: torch.fx.GraphModule, order: list[torch.fx.Node]) -> torch.fx.GraphModule:
    """Moves the nodes of ``gm`` into ``order`` (a permutation of its nodes)."""
    graph = gm.graph
    first = next(iter(graph.nodes))
    if first is not order[0]:
        first.prepend(order[0])
    for previous, node in zip(order, order[1:]):
        if previous.next is not node:
            previous.append(node)
    graph.lint()
    gm.recompile()
    return gm
