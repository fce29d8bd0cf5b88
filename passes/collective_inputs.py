"""A collective whose input is a graph input reads it through ``aten.detach``: gloo's worker threads
never see a tensor that requires grad.

A compiled graph's inputs are the caller's tensors as they are: a stage-3 shard is a leaf that
requires grad, in the forward and as a saved input of the backward. Gloo runs each collective on a
worker thread of its own, where grad mode is on, and its all-gather begins with a view of its input
(``flattenDenseTensors``). Of a leaf that requires grad that view is an autograd view, made on the
worker thread while the main thread runs the graph on (and the engine accumulates into the same
leaf's ``.grad``); with two gathers in flight (prefetch) the process's heap was corrupted about once
in ten 2-rank runs of ``tests/test_schedule.py``'s specs (``malloc(): unaligned tcache chunk
detected`` on a gloo worker thread inside that view, or a general protection fault in
``pt_gloo_runloop``; once in CI). Detached, the input is a plain alias of the same storage: no copy,
no autograd state for another thread to touch.

Intermediate values need nothing: the graph runs with grad mode off, so none of them requires grad.
Last in the pipeline, after every pass that places or rewrites collectives. Inductor erases a
``detach`` (it passes the input buffer itself on); under it the front end detaches the same inputs
when it calls the compiled graph, at the positions ``detached_input_positions`` reads off the graph.
"""

from __future__ import annotations

import logging

import torch

from zcompile.passes.collectives import CollectiveNode

log = logging.getLogger(__name__)
aten = torch.ops.aten


def detach_collective_inputs_pass(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Each collective reading a placeholder reads ``aten.detach(placeholder)`` instead (one detach
    per placeholder, shared by its collectives)."""
    graph = gm.graph
    detached: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in list(graph.nodes):
        collective = CollectiveNode.of(node)
        if collective is None or collective.input.op != "placeholder":
            continue
        source = collective.input
        if source not in detached:
            with graph.inserting_before(node):
                alias = graph.call_function(aten.detach.default, (source,))
            if "val" in source.meta:
                alias.meta["val"] = source.meta["val"]
            detached[source] = alias
        node.replace_input_with(source, detached[source])
    if detached:
        log.debug("detached %d graph inputs read by collectives", len(detached))
        graph.lint()
        gm.recompile()
    return gm


def detached_input_positions(gm: torch.fx.GraphModule) -> list[int]:
    """The positions, among ``gm``'s placeholders, of the inputs ``detach_collective_inputs_pass``
    detached for a collective (for a compiler that erases the ``detach``)."""
    positions = []
    for position, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        if any(user.target is aten.detach.default and any(CollectiveNode.of(u) for u in user.users)
               for user in node.users):
            positions.append(position)
    return positions
