"""Stage-3 weights re-gathered, not saved, across the calls of a block traced once.

With regional compilation (``zcompile.mark_repeated_blocks``) each layer is an ``invoke_subgraph``
call. AOTAutograd partitions the block's subgraph on its own: its forward returns, next to the
block's output, what its backward needs, and that includes the block's weight inputs (and views
of them: ``t``, ``transpose``, ``detach``). In the outer joint graph those come back as outputs of
the forward call that the backward call reads, and a call's output cannot be recomputed: the
partitioner saves them, so every gathered weight of every layer would stay alive from forward to
backward, which is the memory ZeRO-3 exists to free.

``regather_through_regions_pass`` rewires each such argument of a backward call to the weight it
is (the forward call's operand, the gathered weight, tagged ``MUST_RECOMPUTE`` by stage 3's
gathers) through the same views, rebuilt in the outer graph with the weight's tags. The
partitioner then re-gathers the weight in backward, as it does without regions. It runs before
``keep_gathered``, which then sees the backward reading each block's weights and may keep some
(lifting the rebuilt views' tags with the gather's). Everything else a block saves (activations)
is left as it is.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch.utils.checkpoint import CheckpointPolicy

from zcompile.passes import metadata
from zcompile.passes.op_sets import VIEW_OPS, is_call_to

log = logging.getLogger(__name__)

INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph
_OPERANDS = 2  # invoke_subgraph(subgraph, identifier, *operands)


def regather_through_regions_pass(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewires backward subgraph calls to re-gathered weights (module docstring)."""
    rewired = 0
    graph = gm.graph
    for call in list(graph.nodes):
        if not _is_subgraph_call(call):
            continue
        for argument in call.args[_OPERANDS:]:
            origin = subgraph_output_origin(gm, argument)
            if origin is None or origin[0].meta.get(metadata.RECOMPUTE) != CheckpointPolicy.MUST_RECOMPUTE:
                continue  # an activation (or a stage 1/2 weight): saving it is right
            source, views = origin
            with graph.inserting_before(call):
                rebuilt = source
                for view in views:
                    rebuilt = graph.call_function(view.target, (rebuilt, *view.args[1:]), dict(view.kwargs))
                    rebuilt.meta["val"] = view.meta.get("val")
                    rebuilt.meta[metadata.RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE
                    metadata.tag(rebuilt, **metadata.tags(source))
            call.replace_input_with(argument, rebuilt)
            rewired += 1
    if rewired:  # the forward call's outputs nobody reads now are left: the partitioner saves no unread value
        graph.lint()
        gm.recompile()
        log.info("regions: %d weight arguments of subgraph calls re-gathered instead of saved", rewired)
    return gm


def _is_subgraph_call(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is INVOKE_SUBGRAPH


def subgraph_calls(gm: torch.fx.GraphModule) -> int:
    """How many calls of block subgraphs (``mark_repeated_blocks``) graph ``gm`` makes."""
    return sum(map(_is_subgraph_call, gm.graph.nodes))


def subgraph_output_origin(gm: torch.fx.GraphModule, argument) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """For ``getitem(call, k)`` of a subgraph call whose subgraph returns at ``k`` one of its inputs,
    or views of it: the call's operand behind that input and the views to apply to it, in order.
    ``None`` for anything the subgraph computed."""
    if not (
        isinstance(argument, torch.fx.Node)
        and argument.op == "call_function"
        and argument.target is operator.getitem
        and _is_subgraph_call(argument.args[0])
    ):
        return None
    forward_call, index = argument.args
    subgraph = called_subgraph(gm, forward_call)
    if subgraph is None:
        return None
    returned = subgraph.graph.output_node().args[0]
    if not isinstance(returned, (tuple, list)) or index >= len(returned):
        return None
    node, views = returned[index], []
    while isinstance(node, torch.fx.Node) and is_call_to(node, VIEW_OPS) and not _reads_other_nodes(node):
        views.append(node)
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or node.op != "placeholder":
        return None
    position = list(subgraph.graph.find_nodes(op="placeholder")).index(node)
    source = forward_call.args[_OPERANDS + position]
    return (source, list(reversed(views))) if isinstance(source, torch.fx.Node) else None


def _reads_other_nodes(view: torch.fx.Node) -> bool:
    """A view whose arguments past the first are graph values (symbolic sizes) cannot be rebuilt outside."""
    return any(isinstance(a, torch.fx.Node) for a in (*view.args[1:], *view.kwargs.values()))


def called_subgraph(gm: torch.fx.GraphModule, call: torch.fx.Node) -> torch.fx.GraphModule | None:
    """The graph module the ``invoke_subgraph`` node ``call`` of ``gm`` runs (its first argument, an
    attribute of ``gm``); None for any other node."""
    if call.op != "call_function" or call.target is not INVOKE_SUBGRAPH:
        return None
    attribute = call.args[0]
    if not isinstance(attribute, torch.fx.Node) or attribute.op != "get_attr":
        return None
    subgraph = getattr(gm, attribute.target, None)
    return subgraph if isinstance(subgraph, torch.fx.GraphModule) else None
