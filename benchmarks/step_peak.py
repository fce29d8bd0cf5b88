"""A step's memory peak from the compiled graphs: the part ``step_report``'s memory parts leave out.

``step_report`` (and ``zcompile.simulate``) give model states, gathered peak, kept weights and saved
activations; the peak of a step also holds backward's transients (activation gradients, the
logits' gradient) and forward's intermediates while they live. This walks each graph in its node
order the way its generated code runs it (every value freed after its last reader, FX's codegen)
and returns the most bytes alive at once, on top of the model states:

- forward: the values it makes, each from its node to its last reader (the saved ones and the
  outputs to the end);
- backward: the saved activations (``passes.liveness.saved_activation_bytes``'s rule) from its start
  to their last reader there, plus the values it makes, the gradients it returns to the end.

A value that aliases another (a view, ``getitem`` of a tuple, an op whose schema returns an alias,
``wait_tensor``) allocates nothing and keeps its base alive. A prototype beside the benchmarks, to
be checked against measured and torch's peaks before it becomes a part of ``zcompile.simulate``.
"""

from __future__ import annotations

import operator

import torch

from zcompile.passes.collectives import WAIT
from zcompile.passes.liveness import (
    gathered_values,
    is_saved_activation,
    node_bytes,
    saved_activation_bytes,
    saved_for_backward,
)


def _aliases(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or not node.all_input_nodes:
        return False
    if node.target is operator.getitem or node.target is WAIT:
        return True
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


def _live_peak(gm: torch.fx.GraphModule, preloaded: dict[torch.fx.Node, int]) -> int:
    """Most bytes alive at once: ``preloaded`` placeholders (node -> bytes) from the start, every
    non-aliasing call's value from its node; each until the last reader of it or of an alias of it."""
    nodes = list(gm.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    root: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in nodes:
        root[node] = root[node.args[0]] if _aliases(node) and node.args[0] in root else node
    last = {node: position[node] for node in nodes}
    output = gm.graph.output_node()
    for node in nodes:
        for reader in node.users:
            base = root[node]
            last[base] = max(last[base], len(nodes) if reader is output else position[reader])
    alloc = dict(preloaded)
    alloc.update({n: node_bytes(n) for n in nodes if n.op == "call_function" and not _aliases(n)})
    events = sorted([(0 if n in preloaded else position[n], b) for n, b in alloc.items()]
                    + [(last[n] + 0.5, -b) for n, b in alloc.items()])
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def step_peak_bytes(graphs: list, states_without_grads: int) -> int:
    """The step's peak: the parameters and optimizer state (``estimate_memory``'s ``params_bytes +
    optimizer_bytes``; the gradients are made by backward and counted in its walk) plus the larger
    of the forward's and the backward's walk."""
    walk = step_transient_peak(graphs)
    return states_without_grads + max(walk["forward"], walk["backward"])


def step_transient_peak(graphs: list) -> dict[str, int]:
    """Per phase, the most bytes the compiled graphs hold at once over the model states (module doc):
    ``forward`` (one graph's walk), ``backward`` (saved activations and backward's values), and the
    sum of every graph's saved activations (alive together from the last forward to the backward)."""
    saved_total = sum(saved_activation_bytes(g.forward, g.backward) for g in graphs)
    forward = max((_live_peak(g.forward, {}) for g in graphs), default=0)
    backward = 0
    for g in graphs:
        if g.backward is None:
            continue
        placeholders = [p for p in g.backward.graph.find_nodes(op="placeholder") if not p.name.startswith("tangents")]
        saved = saved_for_backward(g.forward, g.backward)
        own = saved_activation_bytes(g.forward, g.backward)
        firsts = {}  # a value saved twice is one storage: its first placeholder carries it
        for p, s, counted in zip(placeholders, saved, _activations(g.forward, saved)):
            if counted and s not in firsts:
                firsts[s] = p
        counted = {p: node_bytes(p) for p in firsts.values()}
        # other graphs' saved activations stay alive while this one runs its backward
        backward = max(backward, saved_total - own + _live_peak(g.backward, counted))
    return {"forward": forward, "backward": backward, "saved": saved_total}


def _activations(forward: torch.fx.GraphModule, saved: list[torch.fx.Node]) -> list[bool]:
    """Per saved forward value: counted by ``saved_activation_bytes`` (not an input, not gathered)."""
    gathered = gathered_values(forward)
    return [is_saved_activation(forward, node, gathered) for node in saved]
