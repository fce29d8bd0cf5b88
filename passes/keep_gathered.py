"""Keep gathered (selective unsharding): some stage-3 weights stay gathered from forward to backward.

Stage 3 tags every parameter gather ``MUST_RECOMPUTE``, so the partitioner saves the shard and
backward all-gathers the weight a second time: memory stays at 1/N between forward and backward,
at the price of one more all-gather per parameter. When memory allows, keeping a gathered weight
instead costs its bytes from the forward's gather to the backward's use and saves that re-gather.

``plan_keep_gathered`` reads AOTAutograd's joint graph (forward and backward in one, before the
partition), because only there is it known which gathered weights backward reads at all (a bias's
gradient does not need the bias; those gathers are never repeated, so keeping them saves nothing).
For each parameter whose backward re-gather would happen it counts

- the bytes kept: the gathered buffer (padded, gather dtype), less the hpZ secondary slice that
  keeping makes unnecessary;
- the bytes saved: what the backward all-gather would receive, ``bytes * (g - 1) / g`` over its
  group of ``g`` ranks;

and picks, greedily within ``budget_bytes``, the highest bytes saved per byte kept; equal ratios
(the common case: it only differs by padding) go to the parameters gathered last in forward,
whose backward comes first, so they are held for the shortest time. The plan is data (JSON) and
the same on every rank: it reads only the graph.

``keep_gathered_pass`` lifts the ``MUST_RECOMPUTE`` (and hpZ's ``MUST_SAVE`` on the secondary)
from the forward nodes of the chosen parameters' gathers, and tags a stage-3 gather ``MUST_SAVE``:
under an ``activation_memory_budget`` the partitioner recomputes whatever it may, a gather with no
tag too, which would re-gather the weight in backward and undo the keep. The partitioner then saves the gathered
weight (collectives are never recomputed, nor is an untagged op of zcompile's: a stage-3 gather
reaches the joint graph as one ``zcompile::gather_shards`` node, ``param_gather``) and the backward
graph has no all-gather for it.

With qwZ the kept weight is the forward's int8-dequantized one, so backward uses it for the input
gradients of the kept layers (re-gathered weights are full precision).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field

import torch
from torch.utils.checkpoint import CheckpointPolicy

from zcompile.passes import metadata
from zcompile.passes.collectives import ALL_GATHER, CollectiveNode
from zcompile.passes.liveness import node_bytes
from zcompile.passes.op_sets import PASS_THROUGH
from zcompile.passes.param_gather import GATHER_SHARDS, gather_shards_bytes

_PASS_THROUGH = PASS_THROUGH | {torch.ops.aten.clone.default}  # ops that pass a weight on unchanged

log = logging.getLogger(__name__)

_GATHER_ROLES = {metadata.ROLE_GATHER, metadata.ROLE_HPZ_REGATHER, metadata.ROLE_HPZ_SECONDARY}


@dataclass(frozen=True)
class GatheredParam:
    """A parameter whose gathered weight backward reads (a candidate to keep)."""

    param: str
    bytes_kept: int  # memory held from forward to backward if kept
    bytes_saved: int  # bytes the backward re-gather would receive, per rank
    forward_position: int  # index of its gather in the joint graph (larger: later in forward)
    hpz_secondary_bytes: int = 0  # the hpZ secondary slice keeping makes unnecessary

    @property
    def saved_per_kept(self) -> float:
        return self.bytes_saved / max(1, self.bytes_kept)


@dataclass
class KeepGatheredPlan:
    budget_bytes: int
    kept: list[GatheredParam] = field(default_factory=list)
    regathered: list[GatheredParam] = field(default_factory=list)  # candidates left to re-gather

    @property
    def kept_bytes(self) -> int:
        return sum(p.bytes_kept for p in self.kept)

    @property
    def saved_bytes(self) -> int:
        return sum(p.bytes_saved for p in self.kept)

    @property
    def kept_params(self) -> list[str]:
        return [p.param for p in self.kept]

    def to_json(self) -> str:
        data = asdict(self)
        data.update(kept_bytes=self.kept_bytes, saved_bytes=self.saved_bytes)
        return json.dumps(data, indent=1)


def _backward_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes of a joint graph that depend on a tangent (the incoming gradients): the backward."""
    stack = [n for n in graph.find_nodes(op="placeholder") if str(n.target).startswith("tangents")]
    seen = set(stack)
    while stack:
        for user in stack.pop().users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


def _forward_gather_chains(graph: torch.fx.Graph) -> tuple[dict[str, list[torch.fx.Node]], set[torch.fx.Node]]:
    """Per parameter, the forward nodes traced from its gather (in graph order); and the backward nodes."""
    backward = _backward_nodes(graph)
    chains: dict[str, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        entry = metadata.tags(node)
        if node in backward or entry.get(metadata.ROLE) not in _GATHER_ROLES or not entry.get(metadata.PARAM):
            continue
        chains.setdefault(entry[metadata.PARAM], []).append(node)
    return chains, backward


def _read_by_backward(gathered: list[torch.fx.Node], backward: set[torch.fx.Node]) -> bool:
    """Whether a backward node reads the gathered weight, directly or through views and casts (the
    ``t`` of a linear weight is traced from the linear, not from the gather)."""
    stack, seen = list(gathered), set(gathered)
    while stack:
        for user in stack.pop().users:
            if user in backward:
                return True
            if user not in seen and user.op == "call_function" and user.target in _PASS_THROUGH:
                seen.add(user)
                stack.append(user)
    return False


def _gather_size(node: torch.fx.Node) -> tuple[int, int]:
    """(bytes gathered, group size) of an all-gather or of a stage-3 gather traced as one op (``param_gather``)."""
    if node.target is GATHER_SHARDS:
        return gather_shards_bytes(node)
    collective = CollectiveNode.of(node)
    return node_bytes(node), collective.group_size


def plan_keep_gathered(gm: torch.fx.GraphModule, budget_bytes: int) -> KeepGatheredPlan:
    """Which parameters of joint graph ``gm`` to keep gathered for backward within ``budget_bytes``
    (module docstring)."""
    graph = gm.graph
    chains, backward = _forward_gather_chains(graph)
    order = {node: i for i, node in enumerate(graph.nodes)}
    candidates = []
    for param, chain in chains.items():
        recomputed = [n for n in chain if n.meta.get(metadata.RECOMPUTE) == CheckpointPolicy.MUST_RECOMPUTE]
        if not _read_by_backward(recomputed, backward):
            continue  # backward never reads the gathered weight: nothing is re-gathered
        regathers = [n for n in recomputed if n.target in (ALL_GATHER, GATHER_SHARDS)]
        if not regathers:
            continue
        sizes = [_gather_size(n) for n in regathers]
        gathered = sum(nbytes for nbytes, _ in sizes)
        saved = sum(nbytes * (group_size - 1) // group_size for nbytes, group_size in sizes)
        # the secondary slice is the last node traced from hpz_secondary (view, select, clone)
        secondary = (
            [node_bytes(n) for n in chain if metadata.tags(n).get(metadata.ROLE) == metadata.ROLE_HPZ_SECONDARY] or [0]
        )[-1]
        candidates.append(GatheredParam(param, max(0, gathered - secondary), saved, order[regathers[0]], secondary))
    plan = KeepGatheredPlan(budget_bytes)
    left = budget_bytes
    for candidate in sorted(candidates, key=lambda c: (-c.saved_per_kept, -c.forward_position, c.param)):
        if candidate.bytes_saved > 0 and candidate.bytes_kept <= left:
            plan.kept.append(candidate)
            left -= candidate.bytes_kept
        else:
            plan.regathered.append(candidate)
    return plan


def keep_gathered_pass(gm: torch.fx.GraphModule, plan: KeepGatheredPlan) -> torch.fx.GraphModule:
    """Lifts the recompute tags of the kept parameters' forward gathers in a joint graph, and tags each
    kept stage-3 gather (``zcompile::gather_shards``) ``MUST_SAVE``.

    Writes ``node.meta["recompute"]`` only; the partitioner run afterwards does the rest.
    """
    kept = set(plan.kept_params)
    if not kept:
        return gm
    chains, _ = _forward_gather_chains(gm.graph)
    lifted = 0
    for param in kept:
        for node in chains.get(param, []):
            if node.meta.pop(metadata.RECOMPUTE, None) is not None:
                lifted += 1
            if node.target is GATHER_SHARDS:
                # saved whatever the partitioner's budget: an activation_memory_budget recomputes every
                # op it may, the lifted gather with them (a re-gather in backward, the keep undone)
                node.meta[metadata.RECOMPUTE] = CheckpointPolicy.MUST_SAVE
    log.info(
        "keep_gathered: %d parameters (%d bytes) kept gathered for backward, %d re-gathered; %d tags lifted",
        len(plan.kept),
        plan.kept_bytes,
        len(plan.regathered),
        lifted,
    )
    return gm
