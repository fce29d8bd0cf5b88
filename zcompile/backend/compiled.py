"""What one compile of the zero backend works with and makes: its context and its graphs.

- ``CompileContext``: the per-compile state every pipeline step reads (the options, the group, the
  sharding plan, the ZeRO++ settings, the pass runner with its dump) and the plans the passes made.
- ``CompiledGraphs``: the graphs one Dynamo graph became (Dynamo graph after its passes, then
  AOTAutograd's forward, backward and inference graphs as they compile), with their context. This
  is what ``on_compile`` receives and what ``step_report`` and the cost model read.
- The compile log: each ``CompiledGraphs`` is recorded on the parameters it trains (like their
  shards), so a report finds every graph of a model without a module-level registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from zcompile.backend.call_prefetch import CallChain, RunPhase
from zcompile.backend.pass_runner import PassRecord, PassRunner
from zcompile.backend.zeropp import ZeroPPSettings
from zcompile.common.process_group import DataParallelGroup
from zcompile.config import ZeroConfig
from zcompile.passes.keep_gathered import KeepGatheredPlan
from zcompile.passes.param_collectives import ShardingPlan

COMPILE_LOG_ATTR = "_zcompile_compiled_graphs"


@dataclass
class CompileContext:
    """Per-compile state of one Dynamo graph, passed explicitly to every step of the pipeline."""

    config: ZeroConfig
    group: DataParallelGroup
    sharding: ShardingPlan
    zeropp: ZeroPPSettings
    runner: PassRunner
    device_type: str = "cpu"
    # the graphs' reduce-scatters run as all-to-all + sum (process_group.reduce_scatter_by_all_to_all,
    # more than one rank), resolved once: the pipeline's lowering row and step_report read it
    reduce_scatter_by_all_to_all: bool = False
    plans: dict[str, Any] = field(default_factory=dict)  # plan file name (``buckets.forward``) -> plan

    @property
    def graph_id(self) -> str:
        return self.runner.graph_id


@dataclass
class CompiledGraphs:
    """The graphs one Dynamo graph became, filled in as AOTAutograd compiles them.

    ``backward`` is compiled lazily by AOTAutograd and may stay ``None`` until the first backward.
    ``context`` is ``None`` only for graphs built by hand (tests, cost-model experiments).
    """

    dynamo: torch.fx.GraphModule | None
    context: CompileContext | None = None
    forward: torch.fx.GraphModule | None = None
    backward: torch.fx.GraphModule | None = None
    inference: torch.fx.GraphModule | None = None
    # the inputs (positions in the Dynamo graph's call) whose data the compiled graph changes in place
    mutated_inputs: tuple[int, ...] = ()
    # cross-call prefetch (zcompile.backend.call_prefetch): the chain of each graph kind that has one, and the
    # phase its forward and backward share
    call_chains: dict[str, CallChain] = field(default_factory=dict)
    run_phase: RunPhase = field(default_factory=RunPhase)
    # how often the graph runs: several times a step where blocks are compiled one by one (once per
    # layer) or gradients accumulate (once per micro-batch); what a step's collectives and the saved
    # activations alive at once multiply by (step_report, comm_volume.step_collectives)
    calls_since_step: int = 0  # training calls since the last optimizer step
    calls_last_step: int = 0  # and between the two before
    forward_run_calls: int = 0  # training calls since its backward last ran
    last_forward_run: int = 0  # calls of its last run of forwards: their saved activations alive together

    def note_training_call(self) -> None:
        self.calls_since_step += 1
        self.forward_run_calls += 1

    def note_backward_call(self) -> None:
        if self.forward_run_calls:
            self.last_forward_run, self.forward_run_calls = self.forward_run_calls, 0

    def note_step(self) -> None:
        self.calls_last_step, self.calls_since_step = self.calls_since_step, 0

    @property
    def calls_per_step(self) -> int:
        """Training calls in the last step (1 before any step)."""
        return max(1, self.calls_last_step)

    @property
    def calls_per_forward_run(self) -> int:
        """Calls whose saved activations were alive at once in the last run of forwards (1 before any)."""
        return max(1, self.last_forward_run)

    @property
    def plan(self) -> ShardingPlan | None:
        """Which graph inputs are parameters, and the stage and group they are sharded for."""
        return None if self.context is None else self.context.sharding

    @property
    def graph_id(self) -> str:
        return "?" if self.context is None else self.context.graph_id

    @property
    def passes(self) -> list[PassRecord]:
        return [] if self.context is None else self.context.runner.records

    @property
    def keep_gathered(self) -> KeepGatheredPlan | None:
        """The stage-3 weights kept from forward to backward (the joint graph's plan), if planned."""
        return None if self.context is None else self.context.plans.get("keep_gathered")


def record_compiled_graphs(params: list[torch.nn.Parameter], graphs: CompiledGraphs) -> None:
    """Appends ``graphs`` to the compile log shared by ``params`` (created, or merged, on demand)."""
    logs = []
    for param in params:
        existing = getattr(param, COMPILE_LOG_ATTR, None)
        if existing is not None and all(existing is not other for other in logs):
            logs.append(existing)
    shared = logs[0] if logs else []
    for other in logs[1:]:
        shared.extend(g for g in other if all(g is not mine for mine in shared))
    if all(graphs is not mine for mine in shared):
        shared.append(graphs)
    for param in params:
        setattr(param, COMPILE_LOG_ATTR, shared)


def compiled_graphs_of(model: torch.nn.Module) -> list[CompiledGraphs]:
    """Every ``CompiledGraphs`` the backend recorded on ``model``'s parameters, in compile order."""
    return compiled_graphs_of_params(model.parameters())


def compiled_graphs_of_params(params) -> list[CompiledGraphs]:
    """Every ``CompiledGraphs`` the backend recorded on ``params``, in compile order."""
    # parameters share their log: each log read once (the optimizer's step asks, every step)
    logs = {id(log): log for param in params if (log := getattr(param, COMPILE_LOG_ATTR, None)) is not None}
    found: list[CompiledGraphs] = []
    for log in logs.values():
        found += [graphs for graphs in log if all(graphs is not seen for seen in found)]
    return found
