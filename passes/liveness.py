"""Bytes of tensors in a graph and how long they live: the memory rules of the schedule and the report.

- ``tensor_bytes(value)``: bytes of every tensor in a (nested) value; ``node_bytes(node)``: of the
  node's ``meta["val"]``.
- ``storages``: the storages a gathered buffer lives in, each from where it is made to its last
  reader (through views; a copy is a reader and a storage of its own).
- ``peak_bytes``: the most bytes alive at once over such intervals.
- ``gathered_peak_bytes(gm)``: the gathered-parameter peak of a graph as it is ordered now.
- ``saved_activation_bytes(forward, backward)``: what the forward saves for the backward, less
  inputs (parameters, shards) and gathered weights kept for backward (counted with the gathers).

The planner predicts with these rules and the report measures the final graph with the same ones,
so a plan and its report agree by construction.
"""

from __future__ import annotations

import networkx as nx
import torch

from zcompile.passes.collectives import ALL_GATHER
from zcompile.passes.op_sets import COPIES, PREP_OPS, VIEW_OPS, is_call_to
from zcompile.passes.regions import subgraph_output_origin


def tensor_bytes(value) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or lists/tuples/dicts of them)."""
    leaves = torch.utils._pytree.tree_leaves(value)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def node_bytes(node: torch.fx.Node) -> int:
    """Bytes of the value ``node`` produces (0 when it has no ``meta["val"]``)."""
    return tensor_bytes(node.meta.get("val"))


def dependency_graph(gm: torch.fx.GraphModule) -> nx.DiGraph:
    """The nodes of ``gm`` as a networkx DAG (edge: producer -> user), with their positions."""
    dag = nx.DiGraph()
    for position, node in enumerate(gm.graph.nodes):
        dag.add_node(node, position=position)
        for source in node.all_input_nodes:
            dag.add_edge(source, node)
    return dag


def storages(dag: nx.DiGraph, position: dict, collective: torch.fx.Node) -> list[tuple[torch.fx.Node, int, int, int]]:
    """The storages a gathered buffer lives in: (node that makes it, from, last read, bytes).

    The collective's output lives from the collective to its last reader through views; a copy
    (a bucket piece made contiguous, a cast) is a reader of it and a storage of its own, counted
    until its own last reader. Bucketing copies every piece right after the wait, so a bucket
    costs its buffer plus its pieces for a moment, then only the pieces (each until its last
    reader; a piece kept for backward, read by the output, to the end). Copying each piece just
    before its reader instead was measured worse with prefetch: the buffer then lives through the
    bucket's compute beside the next bucket's buffer (8.85 vs 8.03 MiB in bench_schedule).
    """
    out, todo = [], [collective]
    while todo:
        storage = todo.pop()
        last, stack, seen = position[storage], [storage], {storage}
        while stack:
            for user in dag.successors(stack.pop()):
                last = max(last, position[user])
                if user in seen:
                    continue
                seen.add(user)
                if is_call_to(user, COPIES):
                    todo.append(user)
                elif is_call_to(user, PREP_OPS):
                    stack.append(user)
        out.append((storage, position[storage], last, node_bytes(storage)))
    return out


def peak_bytes(intervals: list[tuple[float, float, int]]) -> int:
    """Most bytes alive at once over ``(from, last use, bytes)`` intervals (both ends included)."""
    events = sorted([(start, nbytes) for start, _, nbytes in intervals]
                    + [(end + 0.1, -nbytes) for _, end, nbytes in intervals])
    peak = live = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def gathered_peak_bytes(gm: torch.fx.GraphModule | None) -> int:
    """Most bytes of gathered parameters alive at once in ``gm`` as it is ordered now.

    Each all-gather's output counts from the gather's issue to its last reader, and each copy made
    of it (bucket pieces) from the copy to the copy's last reader (``storages``). A weight kept for
    backward is read by the output, so it counts to the end.
    """
    if gm is None:
        return 0
    dag = dependency_graph(gm)
    position = nx.get_node_attributes(dag, "position")
    live = []
    for node in gm.graph.find_nodes(op="call_function", target=ALL_GATHER):
        live += [(start, last, nbytes) for _, start, last, nbytes in storages(dag, position, node)]
    return peak_bytes(live)


def saved_for_backward(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The forward's nodes the backward receives: AOTAutograd's forward returns its outputs, then
    the saved values, one per backward placeholder that is not a tangent."""
    saved_count = sum(1 for p in backward.graph.find_nodes(op="placeholder") if not p.name.startswith("tangents"))
    outputs = list(torch.utils._pytree.tree_leaves(forward.graph.output_node().args))
    return [node for node in outputs[len(outputs) - saved_count:] if isinstance(node, torch.fx.Node)]


def saved_activation_bytes(forward: torch.fx.GraphModule | None, backward: torch.fx.GraphModule | None) -> int:
    """Bytes the forward saves for the backward that are activations: not graph inputs (parameters,
    shards, the batch) and not gathered weights (all-gather outputs kept for backward, counted by
    ``gathered_peak_bytes``)."""
    if forward is None or backward is None:
        return 0
    gathered = gathered_values(forward)
    saved = dict.fromkeys(saved_for_backward(forward, backward))  # a node saved twice is one storage
    return sum(node_bytes(node) for node in saved if is_saved_activation(forward, node, gathered))


def gathered_values(forward: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The forward's all-gathers and what prepares their buffers for the readers (``PREP_OPS``)."""
    gathered: set[torch.fx.Node] = set()
    for collective in forward.graph.find_nodes(op="call_function", target=ALL_GATHER):
        stack = [collective]
        while stack:
            node = stack.pop()
            gathered.add(node)
            stack += [user for user in node.users if user not in gathered and is_call_to(user, PREP_OPS)]
    return gathered


def is_saved_activation(forward: torch.fx.GraphModule, node: torch.fx.Node, gathered: set[torch.fx.Node]) -> bool:
    """Whether saved value ``node`` is an activation: not an input or a view of one, not a gathered
    weight (``gathered``: ``gathered_values(forward)``). A block subgraph's input handed back by its
    call (``mark_repeated_blocks``) is judged by the operand it is."""
    origin = subgraph_output_origin(forward, node)
    start = node if origin is None else origin[0]
    return not _aliases_an_input(start) and start not in gathered


def _aliases_an_input(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a graph input or a view of one (a weight's transpose saved for a matmul's
    backward): no storage of its own."""
    while is_call_to(node, VIEW_OPS) and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node.op == "placeholder"
