"""Schedule collectives for overlap: prefetch all-gathers, issue reduce-scatters early, wait late.

After partitioning, every collective sits right before its wait, which sits right before the
first use: the rank computes nothing while the data moves. This pass re-orders a forward or
backward graph (the compute keeps its order) so that

- the all-gather of bucket ``j`` is issued just before the first use of bucket ``j - prefetch``,
  i.e. while the ``prefetch`` buckets before it compute, and its wait sits just before its own
  first use;
- a reduce-scatter is issued as soon as its input (the bucket's gradients) is complete, and its
  wait, with everything that reads the result, goes as late as possible (before the output);
- with a ``memory_budget`` the prefetch depth of a bucket is lowered until the gathered bytes
  alive at once (each gathered buffer from its issue to its last reader, each piece copied out
  of it until the piece's last reader) stay within the budget.

``plan_schedule`` builds a networkx dependency graph of the nodes, reads the compute order and
the collectives from it and returns a ``SchedulePlan`` (data: per collective where it is issued
and waited, its depth and bytes; the same on every rank because it reads only the graph).
``schedule_pass`` turns the plan into priorities and re-orders the graph with a list scheduler
(``graph_order.topological_order``), which never breaks a data dependency.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field

import networkx as nx
import torch

from zcompile.passes.collectives import COLLECTIVE_OPS, WAIT, collective_nodes
from zcompile.passes.graph_order import apply_order, topological_order
from zcompile.passes.liveness import dependency_graph, node_bytes, peak_bytes, storages
from zcompile.passes.op_sets import PREP_OPS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScheduledCollective:
    name: str
    kind: str
    bytes: int  # gathered output (all-gather) or reduced input (reduce-scatter), per rank
    issue_before: str  # compute node the collective is issued before ("" = graph start/asap)
    wait_before: str  # compute node its wait is placed before ("" = graph end)
    depth: int  # prefetch depth used (all-gathers)


@dataclass
class SchedulePlan:
    graph: str
    prefetch: int
    memory_budget: int | None
    collectives: list[ScheduledCollective] = field(default_factory=list)
    peak_gathered_bytes: int = 0  # predicted, with this schedule

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def _is_compute(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target not in PREP_OPS and node.target not in COLLECTIVE_OPS


def _real_uses(dag: nx.DiGraph, wait: torch.fx.Node) -> list[torch.fx.Node]:
    """Compute nodes (and the output) that read the collective's result, through prep ops."""
    uses, stack, seen = [], [wait], {wait}
    while stack:
        node = stack.pop()
        for user in dag.successors(node):
            if user in seen:
                continue
            seen.add(user)
            if _is_compute(user) or user.op == "output":
                uses.append(user)
            else:
                stack.append(user)
    return uses


def plan_schedule(gm: torch.fx.GraphModule, prefetch: int, memory_budget: int | None = None,
                  graph: str = "") -> SchedulePlan:
    """Where each collective of ``gm`` is issued and waited (see the module docstring)."""
    dag = dependency_graph(gm)
    position = nx.get_node_attributes(dag, "position")
    plan = SchedulePlan(graph, prefetch, memory_budget)
    gathers = []  # (collective, first use position, first use node)
    for collective in collective_nodes(gm):
        waits = collective.waits
        if collective.kind not in ("all_gather", "reduce_scatter") or len(waits) != 1:
            continue
        node = collective.node
        uses = sorted(_real_uses(dag, waits[0]), key=position.__getitem__)
        if collective.kind == "reduce_scatter":
            plan.collectives.append(ScheduledCollective(node.name, collective.kind, collective.bytes, "",
                                                        uses[0].name if uses and uses[0].op != "output" else "", 0))
            continue
        if not uses:
            continue
        gathers.append((node, position[uses[0]], uses[0]))
    gathers.sort(key=lambda g: g[1])
    live: list[tuple[float, float, int]] = []  # (from position, last use position, bytes) per storage
    for j, (node, first, first_use) in enumerate(gathers):
        nbytes = node_bytes(node)
        # pieces are copied out right after the wait, which the schedule puts just before the first use
        (_, _, buffer_last, _), *copies = storages(dag, position, node)
        pieces = [(max(copy_at, first - 0.5), copy_last, nbytes) for _, copy_at, copy_last, nbytes in copies]
        buffer_last = max(buffer_last, first - 0.5)
        for depth in range(min(prefetch, j), -1, -1):
            issue = gathers[j - depth][1] - 0.5 if depth else first - 0.5
            peak = peak_bytes(live + pieces + [(issue, buffer_last, nbytes)])
            if memory_budget is None or peak <= memory_budget or depth == 0:
                break
        issue_node = gathers[j - depth][2]
        live += pieces + [(issue, buffer_last, nbytes)]
        plan.collectives.append(ScheduledCollective(node.name, "all_gather", nbytes, issue_node.name,
                                                    first_use.name, depth))
    plan.peak_gathered_bytes = peak_bytes(live)
    if memory_budget is not None and plan.peak_gathered_bytes > memory_budget:
        log.warning("schedule (%s): gathered parameters need %d bytes at peak even without prefetch, over the "
                    "budget of %d; raise memory_budget_mb or lower bucket_mb", graph, plan.peak_gathered_bytes,
                    memory_budget)
    return plan


def schedule_pass(gm: torch.fx.GraphModule, plan: SchedulePlan) -> torch.fx.GraphModule:
    """Re-orders ``gm`` as ``plan`` says; compute nodes keep their relative order.

    Reads ``meta["val"]`` (bytes) only through the plan; writes no metadata.
    """
    if not plan.collectives:
        return gm
    nodes = list(gm.graph.nodes)
    by_name = {node.name: node for node in nodes}
    position = {node: float(i) for i, node in enumerate(nodes)}
    priority = dict(position)
    late = math.inf
    for entry in plan.collectives:
        collective = by_name[entry.name]
        wait = next(u for u in collective.users if u.target is WAIT)
        if entry.kind == "all_gather":
            priority[collective] = position[by_name[entry.issue_before]] - 0.5
            priority[wait] = position[by_name[entry.wait_before]] - 0.25
        else:
            # issue as soon as the input is ready; the wait and what reads it as late as possible
            priority[collective] = -late
            for node in _descendants(wait):
                if node.op != "output":
                    priority[node] = late
    # inputs of a collective (its flat buffer, casts) go with it, not where they were created
    for node in reversed(nodes):
        for source in node.all_input_nodes:
            if not _is_compute(source) or source.target in COLLECTIVE_OPS:
                priority[source] = min(priority[source], priority[node]) if priority[source] != late else priority[source]
    apply_order(gm, topological_order(gm, priority))
    log.info("schedule (%s): %d collectives placed, prefetch %d, predicted peak gathered %d bytes",
             plan.graph, len(plan.collectives), plan.prefetch, plan.peak_gathered_bytes)
    return gm


def _descendants(node: torch.fx.Node) -> list[torch.fx.Node]:
    out, stack, seen = [], [node], {node}
    while stack:
        current = stack.pop()
        out.append(current)
        for user in current.users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return out
