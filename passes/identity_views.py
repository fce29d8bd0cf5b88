"""Remove views that change nothing: a ``view`` to the shape its input already has (or an ``alias``).

Stages 2 and 3 route every parameter through an ``autograd.Function`` (``graph_ops``). Stage 2's
forward returns the replicated weight as ``full.view_as(full)`` (a custom function may not hand
an input back as itself), and at stage 3 a 1-D weight's gathered piece is viewed to the shape it
has. AOTAutograd keeps each as an ``aten.view`` node, in forward and, recomputed from the saved
input, again in backward: one per parameter in each graph at stage 2. Each is one more node for
the eager inner compiler to dispatch at every call, and one more for inductor to lower at compile
time. AOTAutograd leaves a few in any graph too (a bias's gradient summed, then viewed to the shape it has).

The view is the input itself (same sizes, so the same strides and offset: an alias), so its
readers read the input instead; a view that is a graph output is kept for that use, because
AOTAutograd's runtime decided how to hand back outputs that alias inputs from the graph as
traced. Only static shapes are compared (a symbolic size would add a guard here).
"""

from __future__ import annotations

import logging

import torch

from zcompile.passes.op_sets import SHAPE_VIEWS

log = logging.getLogger(__name__)


def _static_shape(node) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or not all(isinstance(size, int) for size in val.shape):
        return None
    return tuple(val.shape)


def is_identity_view(node: torch.fx.Node) -> bool:
    """Whether ``node`` re-labels its input to the static shape it already has."""
    if node.op != "call_function" or node.target not in SHAPE_VIEWS:
        return False
    shape = _static_shape(node)
    return shape is not None and shape == _static_shape(node.args[0])


def drop_identity_views_pass(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Points every reader of an identity view (``is_identity_view``) but the graph's output at the
    view's input, and erases the views left unread. Reads ``meta["val"]`` of the views and their
    inputs; returns ``gm`` unchanged when there is none."""
    graph = gm.graph
    dropped = 0
    for node in list(graph.nodes):
        if not is_identity_view(node):
            continue
        source = node.args[0]
        node.replace_all_uses_with(source, delete_user_cb=lambda user: user.op != "output")
        if not node.users:
            graph.erase_node(node)
            dropped += 1
    if dropped:
        graph.lint()
        gm.recompile()
        log.debug("identity views: %d dropped", dropped)
    return gm
