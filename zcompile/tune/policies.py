"""Schedule policies beyond the built-in greedy prefetch, and the names the tuner knows them by.

A policy chooses each all-gather's prefetch depth (``passes/schedule.py``, ``ScheduleProblem``).
``greedy_prefetch`` (the default) prefetches every bucket ``prefetch`` deep whether or not the
compute in between needs it: a deep prefetch holds more gathered buffers and queues transfers
behind each other; a shallow one exposes a large bucket behind a short layer.
``CostGuidedPrefetch`` asks the cost model instead: per bucket, the least depth (up to
``prefetch``) at which the compute between issue and first use covers the transfer, given the
transfers already queued on the communication stream. Both stay within ``memory_budget_mb``.

The tuner (``zcompile.tune``) accepts the names of ``POLICY_NAMES`` as candidates of
``schedule_policy`` and builds the cost-guided policy from the costs it measured and agreed
across ranks, so the policy plans the same schedule on every rank.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from zcompile.passes.collectives import COLLECTIVE_OPS, WAIT
from zcompile.passes.schedule import SchedulePolicy, ScheduleProblem
from zcompile.predict.cost_model import CollectiveCosts, ComputeCosts, node_seconds

GREEDY = "greedy"
COST_GUIDED = "cost_guided"
POLICY_NAMES = (GREEDY, COST_GUIDED)
# the fix of every refusal of a schedule_policy name the tuner does not know
POLICY_FIX = f"give one of {list(POLICY_NAMES)} or a callable policy(problem) -> depths"


@dataclass(frozen=True)
class CostGuidedPrefetch:
    """Per bucket, the least prefetch depth (up to the ``prefetch`` option) that hides its all-gather.

    Walks the gathers in order of first use on the cost model's clocks: compute time from the
    nodes' roofline (``cost_model.node_seconds``), one communication stream on which a transfer
    starts when issued and the earlier ones are done, ``overlap_slowdown`` times slower than alone
    since compute runs beside it. For gather ``j`` it tries depths 0, 1, ...:
    the first whose transfer ends by the first use wins; if none does, the deepest that fits
    ``memory_budget`` (it exposes the least). Costs must be the same on every rank (the tuner's
    are agreed; ``measure_collective_costs`` / ``measure_compute_costs`` agree them).
    """

    collective_costs: CollectiveCosts
    compute_costs: ComputeCosts
    name: str = COST_GUIDED

    def __call__(self, problem: ScheduleProblem) -> list[int]:
        clock = self._compute_clock(problem)
        transfer = self.collective_costs.cost("all_gather")
        depths: list[int] = []
        comm_free = 0.0
        for j, slot in enumerate(problem.gathers):
            needed_at = clock[slot.position]
            seconds = transfer.seconds(slot.bytes) * self.collective_costs.overlap_slowdown  # it runs under compute
            chosen = 0
            for depth in range(0, min(problem.prefetch, j) + 1):
                if (
                    depth
                    and problem.memory_budget is not None
                    and problem.peak_bytes([*depths, depth]) > problem.memory_budget
                ):
                    break
                chosen = depth
                issued_at = clock[problem.gathers[j - depth].position]
                if max(issued_at, comm_free) + seconds <= needed_at:
                    break
            issued_at = clock[problem.gathers[j - chosen].position]
            comm_free = max(issued_at, comm_free) + seconds
            depths.append(chosen)
        return depths

    def _compute_clock(self, problem: ScheduleProblem) -> list[float]:
        """Predicted compute time at the start of each node (collectives and waits cost nothing here)."""
        costs = [
            0.0 if node.target in COLLECTIVE_OPS or node.target is WAIT else node_seconds(node, self.compute_costs)
            for node in problem.nodes
        ]
        return list(itertools.accumulate(costs, initial=0.0))


def policy_from_name(
    name: str, collective_costs: CollectiveCosts, compute_costs: ComputeCosts
) -> SchedulePolicy | None:
    """The policy a tuner candidate (or a saved result) names; ``None`` is the built-in greedy prefetch."""
    if name == GREEDY:
        return None
    if name == COST_GUIDED:
        return CostGuidedPrefetch(collective_costs, compute_costs)
    raise ValueError(f"zcompile.tune: schedule_policy {name!r} is not a built-in policy; {POLICY_FIX}")
