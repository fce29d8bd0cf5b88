"""Random draws (dropout, ``rand_like``, ``bernoulli``) are saved for backward, never drawn again.

A random op that the backward recomputes draws new numbers: the backward of a dropout then masks
with another mask than the forward did, and every gradient through it is wrong, with no error.
torch's min-cut partitioner bans recomputing random ops by default, but its memory-budget
partitioner (``activation_memory_budget`` below 1) may place them in the backward, and at a
budget of 0 it recomputes everything. ``MUST_SAVE`` is the one tag every partitioner path honours
(``zcompile.backend.aot.activation_budget`` passes 0 as the least positive budget, where it does too).

A random draw is an op with torch's ``nondeterministic_seeded`` tag, or a call of a subgraph (a
block marked by ``mark_repeated_blocks``) whose graph holds one: the partitioner would recompute the
whole call. Random ops under ``torch.utils.checkpoint`` keep their tag: the partitioner replays
those from the forward's RNG state (``run_with_rng_state``), exact as they are.
"""

from __future__ import annotations

import logging

import torch
from torch.utils.checkpoint import CheckpointPolicy

from zcompile.passes.metadata import RECOMPUTE

log = logging.getLogger(__name__)


def _subgraphs(node: torch.fx.Node) -> list[torch.fx.GraphModule]:
    """The graph modules a higher-order op call runs (an ``invoke_subgraph``'s block), read from its
    ``get_attr`` arguments."""
    owner = node.graph.owning_module
    found = []
    for arg in node.args:
        if isinstance(arg, torch.fx.Node) and arg.op == "get_attr" and owner is not None:
            module = getattr(owner, arg.target, None)
            if isinstance(module, torch.fx.GraphModule):
                found.append(module)
    return found


def _seeded_op(node: torch.fx.Node) -> bool:
    """Whether ``node`` is an op that draws from the RNG: torch's ``nondeterministic_seeded`` tag, less
    an attention op called with ``dropout_p`` 0 (SDPA's CPU and flash kernels carry the tag for the
    dropout they can do; without it they draw nothing)."""
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    schema = getattr(node.target, "_schema", None)
    for position, argument in enumerate(schema.arguments if schema is not None else ()):
        if argument.name == "dropout_p":
            given = node.args[position] if position < len(node.args) else node.kwargs.get("dropout_p")
            value = argument.default_value if given is None else given
            return not (isinstance(value, (int, float)) and value == 0)
    return True


def draws_random_numbers(node: torch.fx.Node) -> bool:
    """Whether running ``node`` draws from the RNG: a seeded-nondeterministic op, or a subgraph call
    holding one."""
    if node.op != "call_function":
        return False
    if _seeded_op(node):
        return True
    return any(draws_random_numbers(inner) for graph in _subgraphs(node) for inner in graph.graph.nodes)


def save_random_draws_pass(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Tags every random draw of the joint graph ``MUST_SAVE`` (``RECOMPUTE`` metadata), unless it
    already carries a recompute tag (``torch.utils.checkpoint``'s, replayed exactly): the partitioner
    then saves what the backward needs of it (a dropout's mask; the bool mask, not the uniform draw,
    when inductor decomposed it) at every activation budget. A block's subgraph is partitioned by its
    own call of the partitioner, which runs this pass on its joint graph too."""
    tagged = 0
    for node in gm.graph.nodes:
        if node.meta.get(RECOMPUTE) is None and draws_random_numbers(node):
            node.meta[RECOMPUTE] = CheckpointPolicy.MUST_SAVE
            tagged += 1
    if tagged:
        log.info("save_random_draws: %d random draws saved for backward, never recomputed", tagged)
    return gm


def _random_draw_names(gm: torch.fx.GraphModule) -> set[str]:
    names = set()
    for node in gm.graph.nodes:
        if _seeded_op(node):
            names.add(node.name)
        for graph in _subgraphs(node):
            names |= _random_draw_names(graph)
    return names


def recomputed_random_draws(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule) -> list[str]:
    """The random ops (node names, subgraphs' included) that ``backward`` runs again after
    ``forward`` ran them: the partition keeps the joint graph's node names on both sides, so a name
    in both is one op drawn twice. A random op of the backward's own (a custom backward's noise) has
    no namesake in the forward and is not one."""
    return sorted(_random_draw_names(forward) & _random_draw_names(backward))
