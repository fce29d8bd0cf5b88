"""A graph's first all-gather split off into a prologue, so that the call before can issue it.

Blocks compiled one by one (``block.compile(backend="zero")``) are one graph called once per layer.
Inside a graph the schedule issues each bucket's all-gather while the bucket before computes; the
first bucket of a call has nothing before it in its graph, so each layer's call waits for its first
gather exposed, in forward and again in backward (stage 3 re-gathers). The call before it can issue
that gather if the gather is a function of the call's parameter shards alone::

    prologue(shards...) -> issued           the first all-gather and what it reads (pack, cast,
                                            quantize, the buffer it runs into), issued, not waited
    body(*inputs, issued) -> outputs        the graph, that gather taken as its last input

``zcompile.backend.call_prefetch`` runs them: a call takes the gather the call before issued for it, or
runs its own prologue, and issues the next call's. The split is of the graph a compiled function
runs (after ``all_gather_lowering``); the pipeline's graphs, which reports and walks read, keep
the gather where it was.

Only a prologue that reads nothing but parameter shards is split off: the next call's shards are
known a call early (the same tensors every step), its activations are not.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch

from zcompile.passes.all_gather_lowering import ALL_GATHER_OUT
from zcompile.passes.collectives import ALL_GATHER, COLLECTIVE_OPS
from zcompile.passes.metadata import FORWARD_INPUT_PREFIX

log = logging.getLogger(__name__)
GATHERS = (ALL_GATHER, ALL_GATHER_OUT)


@dataclass(frozen=True)
class CallSplit:
    """A graph split at its first all-gather (module docstring).

    ``prologue``: placeholders for the graph's inputs at ``input_indices``, in order; returns the
    issued all-gather. ``body``: the graph's placeholders and then the issued gather. ``gathered_bytes``:
    the gather's output, held from the call before to the call that reads it."""

    prologue: torch.fx.GraphModule
    body: torch.fx.GraphModule
    input_indices: tuple[int, ...]
    gathered_bytes: int
    # the Dynamo graph's input each prologue input is (``primals_<i + 1>``: i), the same in a forward
    # and in its backward: how a backward call finds the forward call it is the backward of
    dynamo_indices: tuple[int, ...] = ()


def issued_input_name(collective: str, group_name: str) -> str:
    """The body's input for the gather issued by the call before, named after that collective and its
    group (hex: a group's name need not be an identifier). fx's code and inductor's keep an input's
    name, so the line where the body waits for it still says what it waits for, as ``issued_by``
    reads it back (``zcompile.agreement.heartbeat`` tells the other ranks a rank waits there)."""
    return f"{_ISSUED_PREFIX}{collective}__group_{group_name.encode().hex()}"


def issued_by(name: str) -> tuple[str, str] | None:
    """``(collective, group name)`` of an input named by ``issued_input_name``; None for any other name."""
    found = _ISSUED_NAME.fullmatch(name)
    if found is None:
        return None
    return found.group(1), bytes.fromhex(found.group(2)).decode()


_ISSUED_PREFIX = "issued_by_call_before__"
_ISSUED_NAME = re.compile(rf"{_ISSUED_PREFIX}(\w+?)__group_((?:[0-9a-f]{{2}})*)")


def issued_example(split: CallSplit):
    """The issued gather's example value (the body's last input, as its graph's metadata has it):
    what an inner compiler that specializes on its inputs is given for it."""
    return list(split.body.graph.find_nodes(op="placeholder"))[-1].meta["val"]


def shard_placeholder_names(param_indices) -> frozenset[str]:
    """The names AOTAutograd gives the placeholders of the Dynamo graph's inputs at ``param_indices``
    (``primals_<index + 1>``), in a forward graph and, where it saves them, in a backward graph."""
    return frozenset(_PRIMAL.format(index + 1) for index in param_indices)


_PRIMAL = FORWARD_INPUT_PREFIX + "{}"


def dynamo_index(name: str) -> int:
    """The Dynamo graph's input a ``primals_<i + 1>`` placeholder is: ``i``."""
    return int(name.removeprefix(_PRIMAL.format(""))) - 1


def split_first_gather(gm: torch.fx.GraphModule, shard_inputs: frozenset[str]) -> CallSplit | None:
    """``gm`` split at its first collective (module docstring), or None when that collective is not
    an all-gather, or what the gather reads depends on anything but the placeholders named in
    ``shard_inputs`` or on a node with side effects. ``gm`` is left as it was."""
    graph = gm.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    first = next(
        (n for n in graph.nodes if n.op == "call_function" and n.target in COLLECTIVE_OPS + (ALL_GATHER_OUT,)), None
    )
    if first is None or first.target not in GATHERS:
        return None
    reads = _ancestors(first)
    inputs = [n for n in placeholders if n in reads]
    if not inputs or any(n.name not in shard_inputs for n in inputs):
        return None
    if any(n.op != "placeholder" and (n.op != "call_function" or n.is_impure()) for n in reads):
        return None
    gathered = first.meta.get("val")
    if gathered is None:
        return None
    prologue = _prologue(gm, first, reads, inputs)
    body = _body(gm, first, reads, placeholders)
    indices = tuple(placeholders.index(n) for n in inputs)
    return CallSplit(
        prologue, body, indices, gathered.numel() * gathered.element_size(), tuple(dynamo_index(n.name) for n in inputs)
    )


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(current.all_input_nodes)
    return seen


def _prologue(gm, first, reads, inputs) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta.update(node.meta)
    for node in gm.graph.nodes:  # in the graph's order: each read after what it reads
        if node in reads and node.op != "placeholder":
            env[node] = graph.node_copy(node, env.__getitem__)
    env[first] = graph.node_copy(first, env.__getitem__)
    graph.output(env[first])
    graph.lint()
    return torch.fx.GraphModule(gm, graph)


def _body(gm, first, reads, placeholders) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    output_node = graph.graph_copy(gm.graph, env)
    graph.output(output_node)
    with graph.inserting_after(env[placeholders[-1]]):
        issued = graph.placeholder(issued_input_name(first.target._opname, first.args[-1]))
    issued.meta.update(first.meta)
    env[first].replace_all_uses_with(issued)
    graph.erase_node(env[first])
    for node in reversed(list(gm.graph.nodes)):  # what only the gather read goes with it
        if node in reads and node.op != "placeholder" and not env[node].users:
            graph.erase_node(env[node])
    graph.lint()
    return torch.fx.GraphModule(gm, graph)
