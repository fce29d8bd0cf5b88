"""Schedule collectives for overlap: prefetch all-gathers, issue reduce-scatters early, wait late.

After partitioning, every collective sits right before its wait, which sits right before the
first use: the rank computes nothing while the data moves. This pass re-orders a forward or
backward graph (the compute keeps its order) so that

- the all-gather of bucket ``j`` is issued just before the first use of bucket ``j - prefetch``,
  i.e. while the ``prefetch`` buckets before it compute, and its wait sits just before its own
  first use;
- a reduce-scatter is issued as soon as its input (the bucket's gradients) is complete, and its
  wait goes just before the reduce-scatter ``REDUCE_SCATTERS_IN_FLIGHT`` later is issued (the last
  ones' at the end), everything that reads the result as late as possible (before the output);
- with a ``memory_budget`` the prefetch depth of a bucket is lowered until the gathered bytes
  alive at once (each gathered buffer from its issue to its last reader, each piece copied out
  of it until the piece's last reader) stay within the budget.

``plan_schedule`` builds a networkx dependency graph of the nodes, reads the compute order and
the collectives from it into a ``ScheduleProblem`` and asks a **policy** how deep to prefetch
each all-gather; it returns a ``SchedulePlan`` (data: per collective where it is issued and
waited, its depth and bytes; the same on every rank because it reads only the graph).
``schedule_pass`` turns the plan into priorities and re-orders the graph with a list scheduler
(``graph_order.topological_order``), which never breaks a data dependency.

A policy is any callable ``policy(problem: ScheduleProblem) -> Sequence[int]``: the prefetch depth
of each of ``problem.gathers`` (in order of first use; depth ``d`` issues gather ``j`` just before
the first use of gather ``j - d``, so ``0 <= d <= j``). ``greedy_prefetch`` (the default) takes
the deepest depth up to ``problem.prefetch`` that fits ``problem.memory_budget``;
``zcompile.tune.policies.CostGuidedPrefetch`` picks per bucket the least depth whose compute hides
the transfer. Reduce-scatters are placed by the pass itself (issued early, waited late). A policy
must decide from the problem alone (and constants agreed across ranks): every rank must plan the
same schedule (passes/README.md, invariant 1).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import networkx as nx
import torch

from zcompile.passes.collectives import COLLECTIVE_OPS, WAIT, collective_nodes
from zcompile.passes.graph_order import apply_order, topological_order
from zcompile.passes.liveness import dependency_graph, node_bytes, peak_bytes, storages
from zcompile.passes.op_sets import PREP_OPS

log = logging.getLogger(__name__)

# Reduce-scatters in flight at once. A collective's input lives until its wait (gloo reduces a copy
# of it, NCCL keeps it for the allocator), so waiting every reduce-scatter at the end of the backward
# would hold the model's full gradient in bucket inputs. With one in flight, its wait on the bucket
# issued just before blocks the backward; two hold little more than one and wait no longer than
# waiting all at the end.
REDUCE_SCATTERS_IN_FLIGHT = 2


@dataclass(frozen=True)
class ScheduledCollective:
    name: str
    kind: str
    bytes: int  # gathered output (all-gather) or reduced input (reduce-scatter), per rank
    issue_before: str  # compute node the collective is issued before ("" = graph start/asap)
    wait_before: str  # node its wait is placed before: compute, or a later reduce-scatter ("" = graph end)
    depth: int  # prefetch depth used (all-gathers)


@dataclass
class SchedulePlan:
    graph: str
    prefetch: int
    memory_budget: int | None
    collectives: list[ScheduledCollective] = field(default_factory=list)
    peak_gathered_bytes: int = 0  # predicted, with this schedule
    policy: str = "greedy_prefetch"  # the policy that chose the prefetch depths

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


Interval = tuple[float, float, int]  # (from position, last use position, bytes) of one storage


@dataclass(frozen=True)
class GatherSlot:
    """One all-gather as a policy sees it: its bytes, its first reader and the storages it lives in.

    ``position`` is the first reader's position in the graph's current (compute) order, which the
    schedule keeps; ``pieces`` are the copies made of the gathered buffer (bucket pieces), each
    alive from its copy to its last reader, and ``buffer_last`` the buffer's own last reader.
    """

    name: str
    bytes: int
    first_use: str
    position: int
    buffer_last: float
    pieces: tuple[Interval, ...]


@dataclass(frozen=True)
class ScheduleProblem:
    """What a schedule policy decides on: the graph's all-gathers in order of first use, the node
    order they sit in, and the options that bound prefetching (``prefetch``, ``memory_budget``)."""

    graph: str
    prefetch: int
    memory_budget: int | None
    gathers: tuple[GatherSlot, ...]
    nodes: tuple[torch.fx.Node, ...]  # the graph's nodes in order: ``nodes[slot.position]`` is a first use

    def issue_position(self, j: int, depth: int) -> float:
        """Where gather ``j`` is issued at ``depth``: just before the first use of gather ``j - depth``."""
        return self.gathers[j - depth].position - 0.5

    def intervals(self, depths: Sequence[int]) -> list[Interval]:
        """Storages of the first ``len(depths)`` gathers when prefetched at ``depths``."""
        live: list[Interval] = []
        for j, depth in enumerate(depths):
            slot = self.gathers[j]
            live += list(slot.pieces) + [(self.issue_position(j, depth), slot.buffer_last, slot.bytes)]
        return live

    def peak_bytes(self, depths: Sequence[int]) -> int:
        """Most gathered bytes alive at once when the first ``len(depths)`` gathers use ``depths``."""
        return peak_bytes(self.intervals(depths))


SchedulePolicy = Callable[[ScheduleProblem], Sequence[int]]


def greedy_prefetch(problem: ScheduleProblem) -> list[int]:
    """The default policy: each gather as deep as ``prefetch`` allows, lowered (first gathers first)
    until the gathered bytes alive at once fit ``memory_budget``; depth 0 always fits."""
    depths: list[int] = []
    for j in range(len(problem.gathers)):
        for depth in range(min(problem.prefetch, j), -1, -1):
            if (
                problem.memory_budget is None
                or depth == 0
                or problem.peak_bytes([*depths, depth]) <= problem.memory_budget
            ):
                break
        depths.append(depth)
    return depths


def policy_name(policy: SchedulePolicy) -> str:
    """A policy's ``name`` attribute, else its function or class name (what plans and reports show)."""
    return str(getattr(policy, "name", None) or getattr(policy, "__name__", None) or type(policy).__name__)


def schedule_problem(
    gm: torch.fx.GraphModule, prefetch: int, memory_budget: int | None = None, graph: str = ""
) -> tuple[ScheduleProblem, list[ScheduledCollective]]:
    """The all-gathers of ``gm`` as a ``ScheduleProblem``, and the reduce-scatters already placed."""
    dag = dependency_graph(gm)
    position = nx.get_node_attributes(dag, "position")
    reduce_scatters = []
    gathers = []  # (collective node, first use)
    for collective in collective_nodes(gm):
        waits = collective.waits
        # the model's own collectives stay where it waits on them: their inputs are activations, which
        # inductor may reuse for another kernel's output while an out= all-gather still reads them
        if not collective.is_zero or collective.kind not in ("all_gather", "reduce_scatter") or len(waits) != 1:
            continue
        if collective.kind == "reduce_scatter":
            reduce_scatters.append(collective)
            continue
        uses = sorted(_real_uses(dag, waits[0]), key=position.__getitem__)
        if uses:
            gathers.append((collective.node, uses[0]))
    # each waited just before the one REDUCE_SCATTERS_IN_FLIGHT later is issued ("": at the end)
    later = [c.node.name for c in reduce_scatters[REDUCE_SCATTERS_IN_FLIGHT:]]
    reduces = [
        ScheduledCollective(c.node.name, c.kind, c.bytes, "", wait_before, 0)
        for c, wait_before in zip(reduce_scatters, later + [""] * len(reduce_scatters))
    ]
    gathers.sort(key=lambda g: position[g[1]])
    slots = []
    for node, first_use in gathers:
        first = position[first_use]
        # pieces are copied out right after the wait, which the schedule puts just before the first use
        (_, _, buffer_last, _), *copies = storages(dag, position, node)
        pieces = tuple((max(copy_at, first - 0.5), copy_last, nbytes) for _, copy_at, copy_last, nbytes in copies)
        slots.append(
            GatherSlot(node.name, node_bytes(node), first_use.name, first, max(buffer_last, first - 0.5), pieces)
        )
    problem = ScheduleProblem(graph, prefetch, memory_budget, tuple(slots), tuple(gm.graph.nodes))
    return problem, reduces


def plan_schedule(
    gm: torch.fx.GraphModule,
    prefetch: int,
    memory_budget: int | None = None,
    graph: str = "",
    policy: SchedulePolicy | None = None,
) -> SchedulePlan:
    """Where each collective of ``gm`` is issued and waited, the depths chosen by ``policy``
    (``greedy_prefetch`` when None; see the module docstring)."""
    policy = greedy_prefetch if policy is None else policy
    problem, reduces = schedule_problem(gm, prefetch, memory_budget, graph)
    depths = _checked_depths(policy, problem)
    plan = SchedulePlan(graph, prefetch, memory_budget, list(reduces), policy=policy_name(policy))
    for j, (slot, depth) in enumerate(zip(problem.gathers, depths)):
        issue_before = problem.gathers[j - depth].first_use
        plan.collectives.append(
            ScheduledCollective(slot.name, "all_gather", slot.bytes, issue_before, slot.first_use, depth)
        )
    plan.peak_gathered_bytes = problem.peak_bytes(depths)
    if memory_budget is not None and plan.peak_gathered_bytes > memory_budget:
        log.warning(
            "zcompile: the %s graph's schedule holds %d bytes of gathered parameters at peak with policy %s, "
            "over the budget of %d; raise memory_budget_mb or lower bucket_mb",
            graph,
            plan.peak_gathered_bytes,
            plan.policy,
            memory_budget,
        )
    return plan


def _checked_depths(policy: SchedulePolicy, problem: ScheduleProblem) -> list[int]:
    """The policy's depths, refused with the rule when they are not one int ``0 <= d <= j`` per gather."""
    depths = list(policy(problem))
    name = policy_name(policy)
    if len(depths) != len(problem.gathers):
        raise ValueError(
            f"schedule_policy {name!r} returned {len(depths)} depths for the {len(problem.gathers)} "
            f"all-gathers of graph {problem.graph!r}; return one prefetch depth per problem.gathers"
        )
    for j, depth in enumerate(depths):
        if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= j:
            raise ValueError(
                f"schedule_policy {name!r}: depth {depth!r} for all-gather {j} "
                f"({problem.gathers[j].name}) of graph {problem.graph!r}; a depth is an int "
                f"0 <= depth <= {j} (gather j is issued before the first use of gather j - depth)"
            )
    return depths


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
                priority[source] = (
                    min(priority[source], priority[node]) if priority[source] != late else priority[source]
                )
    apply_order(gm, topological_order(gm, priority))
    _wait_reduces_in_turn(gm, plan)
    log.info(
        "schedule (%s): %d collectives placed, prefetch %d, predicted peak gathered %d bytes",
        plan.graph,
        len(plan.collectives),
        plan.prefetch,
        plan.peak_gathered_bytes,
    )
    return gm


def _wait_reduces_in_turn(gm: torch.fx.GraphModule, plan: SchedulePlan) -> None:
    """Moves each reduce-scatter's wait to just before the reduce-scatter its plan entry names (its
    ``wait_before``), once the list scheduler has issued them all as early as it could and put the
    waits last; a wait that would then come before its own collective or after a reader stays."""
    nodes = list(gm.graph.nodes)
    by_name = {node.name: node for node in nodes}
    position = {node: i for i, node in enumerate(nodes)}
    for entry in plan.collectives:
        if entry.kind != "reduce_scatter" or not entry.wait_before:
            continue
        collective, target = by_name[entry.name], by_name[entry.wait_before]
        wait = next(u for u in collective.users if u.target is WAIT)
        if position[collective] < position[target] < position[wait] and all(
            position[user] > position[target] for user in wait.users
        ):
            target.prepend(wait)


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
