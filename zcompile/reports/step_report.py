"""The communication and memory report of a compiled training step.

``step_report(model, optimizer)`` reads what the backend compiled for ``model`` (the graphs are
recorded on its parameters, see ``zcompile.backend.compiled``) and what the optimizer's last step
issued, and returns a ``StepReport``: every collective of one step (kind, bytes, dtype, where,
which parameters), totals against ZeRO's formula for the stage, the model-state bytes measured on
this rank against the formula, the peak of gathered-parameter bytes the graphs hold at once, and
the schedule: for each collective, how many compute ops run between its issue and its wait (0
means fully exposed), and the gradient norm before clipping when the optimizer clipped
(``optimizer.last_grad_norm``). ``print()`` draws it (rich tables when installed); ``to_json(path)`` writes it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from zcompile.backend.compiled import CompiledGraphs, compiled_graphs_of
from zcompile.common.comm_volume import step_collectives, summarize
from zcompile.common.process_group import on_gloo
from zcompile.config import MEMORY_PLAN_ATTR
from zcompile.passes import metadata
from zcompile.passes.collectives import COLLECTIVE_OPS, WAIT, collective_nodes
from zcompile.passes.dtensor_params import local_tensor
from zcompile.passes.liveness import gathered_peak_parts, saved_activation_bytes
from zcompile.sharding.memory import model_state_bytes, zero_formula_bytes

log = logging.getLogger(__name__)


@dataclass
class OverlapRecord:
    """A collective in a graph and the compute ops scheduled between its issue and its wait."""

    graph: str
    where: str
    kind: str
    params: list[str]
    overlapped_ops: int
    # a graph's first all-gather that cross-call prefetch issued during the call before (blocks
    # compiled one by one): nothing runs before it in its own graph, the previous layer ran beside it
    issued_by_call_before: bool = False


@dataclass
class StepReport:
    stage: int
    world_size: int
    num_params: int
    collectives: list[dict]
    totals: dict[str, int]
    formula_elements: int
    memory: dict[str, int]
    schedule: list[OverlapRecord] = field(default_factory=list)
    grad_norm: float | None = None  # the optimizer's pre-clip gradient norm of the step (None: not clipped)
    optimizer_counted: bool = True  # False: step_report got no optimizer, so the measured states lack its own
    skipped_steps: int = 0  # steps the optimizer skipped so far because a gradient was not finite (skip_nonfinite)
    # the graphs' reduce-scatters run as all-to-all + sum (gloo; the option reduce_scatter): counted as
    # reduce-scatters here, shown as all-to-alls by the profiler and zcompile.timeline
    reduce_scatter_as_all_to_all: bool = False
    # hybrid sharding: process group name -> "shard" or "replicate" (the collectives' groups), and the replicas
    group_roles: dict[str, str] = field(default_factory=dict)
    group_sizes: dict[str, int] = field(
        default_factory=dict
    )  # those groups' sizes (a traced all-reduce's is not in its node)
    replicas: int = 1
    # a tensor-parallel model: the tp degree; Ψ and the formula are then the elements of this rank's pieces,
    # ``totals`` ZeRO's collectives, and the model's own over the tp group (activations) apart
    tensor_parallel: int = 1
    tensor_parallel_elements: int = 0
    # memory_limit_mb: the plan's line (its choice, predicted peak by parts, step) and its predicted peak;
    # on CUDA the allocator's measured peak of this process (torch.cuda.max_memory_allocated) beside it
    memory_plan: str = ""
    planned_peak_bytes: int = 0
    measured_peak_bytes: int | None = None

    def to_dict(self) -> dict:
        data = asdict(self)
        data["schedule"] = [asdict(s) for s in self.schedule]
        return data

    def to_json(self, path: str | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            with open(path, "w") as handle:
                handle.write(text)
        return text

    def collective_rows(self) -> list[tuple[str, str, int, int, int]]:
        """(where, kind, count, elements, bytes) per kind of collective, in step order."""
        rows: dict[tuple[str, str], list[int]] = {}
        for c in self.collectives:
            role = self.group_roles.get(c["group"])
            size = c["group_size"] or self.group_sizes.get(c["group"], 0)
            kind = f"{c['kind']} [{role} {size}]" if role else c["kind"]  # hybrid, tensor parallel: which group
            entry = rows.setdefault((c["where"], kind), [0, 0, 0])
            entry[0] += 1
            entry[1] += c["elements"]
            entry[2] += c["bytes"]
        return [(where, kind, *values) for (where, kind), values in rows.items()]

    def title(self) -> str:
        if self.tensor_parallel > 1:
            everyone = self.world_size * self.tensor_parallel * self.replicas
            dp = f"{self.replicas} replicas x shard {self.world_size}" if self.replicas > 1 else f"dp {self.world_size}"
            ranks = f"{everyone} ranks as {dp} x tp {self.tensor_parallel}"
            return f"ZeRO stage {self.stage}, {ranks}, Ψ = {self.num_params:,} parameters in this rank's pieces"
        ranks = (
            f"{self.world_size * self.replicas} ranks as {self.replicas} shard groups of {self.world_size}"
            if self.replicas > 1
            else f"{self.world_size} rank(s)"
        )
        return f"ZeRO stage {self.stage}, {ranks}, Ψ = {self.num_params:,} parameters"

    def summary_lines(self) -> list[str]:
        psi = max(self.num_params, 1)
        total = self.totals.get("total", 0)
        mem = self.memory
        exposed = sum(1 for s in self.schedule if s.overlapped_ops == 0 and not s.issued_by_call_before)
        ahead = sum(1 for s in self.schedule if s.issued_by_call_before)
        return (
            [
                f"total {total:,} elements = {total / psi:.2f} Ψ per rank per step "
                f"(ZeRO formula {self.formula_elements / psi:.0f} Ψ)"
                + (
                    f"; the model's tensor-parallel collectives {self.tensor_parallel_elements:,} elements more"
                    if self.tensor_parallel_elements
                    else ""
                ),
                f"model states {mem['model_states_bytes'] / 2**20:.2f} MiB/rank measured"
                + (
                    ""
                    if self.optimizer_counted
                    else " (parameters and gradients only: step_report(model, optimizer) "
                    "counts the optimizer's states too)"
                )
                + ", "
                f"{mem['formula_bytes'] / 2**20:.2f} MiB by the formula; peak gathered parameters "
                f"{mem['peak_gathered_bytes'] / 2**20:.2f} MiB"
                + (
                    f" (of which {mem['kept_gathered_bytes'] / 2**20:.2f} MiB kept for backward)"
                    if mem.get("kept_gathered_bytes")
                    else ""
                )
                + (
                    f" (of which {mem['call_prefetch_bytes'] / 2**20:.2f} MiB the next call's first gather, prefetched)"
                    if mem.get("call_prefetch_bytes")
                    else ""
                )
                + (
                    f", +{mem['gather_staging_bytes'] / 2**20:.2f} MiB at most of gloo's copies of the gathers in flight"
                    if mem.get("gather_staging_bytes")
                    else ""
                )
                + f"; saved activations {mem.get('saved_activation_bytes', 0) / 2**20:.2f} MiB"
                + (
                    f"; the optimizer's bucket buffers {mem['optimizer_buffers_bytes'] / 2**20:.2f} MiB at most "
                    "(its bucket_mb)"
                    if mem.get("optimizer_buffers_bytes")
                    else ""
                ),
                f"schedule: {len(self.schedule)} collectives in graphs, {exposed} with no compute between issue "
                "and wait (exposed)"
                + (
                    f", {ahead} issued by the call before (cross-call prefetch: exposed only in a run's first call)"
                    if ahead
                    else ""
                ),
            ]
            + (
                [
                    "reduce-scatters run as an all-to-all and a sum on this backend (option reduce_scatter); the "
                    "profiler and the timeline show them as all_to_all"
                ]
                if self.reduce_scatter_as_all_to_all
                else []
            )
            + ([f"gradient norm {self.grad_norm:.6g} (before clipping)"] if self.grad_norm is not None else [])
            + ([f"memory plan: {self.memory_plan.removeprefix('zcompile.plan: ')}"] if self.memory_plan else [])
            + (
                [
                    f"peak memory: {self.measured_peak_bytes / 2**20:.2f} MiB measured (this process's allocator), "
                    f"{self.planned_peak_bytes / 2**20:.2f} MiB planned"
                ]
                if self.memory_plan and self.measured_peak_bytes is not None
                else []
            )
            + (
                [f"{self.skipped_steps} step(s) skipped: gradients not finite (skip_nonfinite)"]
                if self.skipped_steps
                else []
            )
        )

    def render(self) -> str:
        """The report as plain text (what ``print`` shows without rich)."""
        psi = max(self.num_params, 1)
        lines = [self.title()]
        for where, kind, count, elements, nbytes in self.collective_rows():
            lines.append(
                f"  {where:<9} {kind:<15} {count:>5} x {elements:>12,} elements {nbytes / 2**20:9.2f} MiB"
                f" {elements / psi:5.2f} Ψ"
            )
        lines += [f"  {line}" for line in self.summary_lines()]
        return "\n".join(lines)

    def print(self) -> None:
        """Prints the report to stdout (rich tables when installed): a user-facing call, not logging."""
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            print(self.render())
            return
        psi = max(self.num_params, 1)
        table = Table(title=self.title())
        for column in ("where", "kind", "count", "elements", "MiB", "Ψ"):
            table.add_column(column, justify="left" if column in ("where", "kind") else "right")
        for where, kind, count, elements, nbytes in self.collective_rows():
            table.add_row(where, kind, str(count), f"{elements:,}", f"{nbytes / 2**20:.2f}", f"{elements / psi:.2f}")
        console = Console()
        console.print(table)
        for line in self.summary_lines():
            console.print(line)


def step_report(
    model: torch.nn.Module, optimizer: Any = None, graphs: list[CompiledGraphs] | None = None
) -> StepReport:
    """The report of one step of ``model`` (call after at least one ``optimizer.step()``)."""
    graphs = compiled_graphs_of(model) if graphs is None else graphs
    if not graphs:
        raise ValueError(
            "zcompile.step_report: no graphs compiled by the zero backend were found on this model; "
            "run a step of torch.compile(model, backend='zero') first"
        )
    plan = graphs[0].plan
    schedule: list[OverlapRecord] = []
    for compiled in graphs:
        graph_id = compiled.graph_id
        for where in ("forward", "backward"):
            records = collective_overlaps(getattr(compiled, where), graph_id, where)
            chain = compiled.call_chains.get(where)
            if records and chain is not None and chain.taken:  # its first collective is the gather split off
                records[0].issued_by_call_before = True
            schedule += records
    # gloo gathers into a flat buffer of its own and copies out: each gather in flight holds its
    # output twice (NCCL writes in place); a part of its own, so peak_gathered_bytes stays the
    # schedule's on every backend
    staged = graphs[0].context is not None and on_gloo(graphs[0].context.group) and plan.world_size > 1
    peak_gathered, gather_staging = gathered_peak_parts([gm for g in graphs for gm in (g.forward, g.backward)], staged)
    # cross-call prefetch (zcompile.backend.call_prefetch): while a call runs, the next call's first gather is held
    held_ahead = max(
        [chain.split.gathered_bytes for g in graphs for chain in g.call_chains.values() if chain.taken or chain.dropped]
        or [0]
    )
    if staged:  # that gather is in flight the whole call: gloo holds its flat copy of it too
        gather_staging += held_ahead
    records = step_collectives(graphs, optimizer)  # each graph as often as it ran in the last step
    group = graphs[0].context.group if graphs[0].context is not None else None
    tp_group = group.tensor_parallel.name if group is not None and group.tensor_parallel is not None else None
    unique = list(dict.fromkeys(model.parameters()))
    elements = [local_tensor(p).numel() for p in unique]  # a tensor-parallel weight: this rank's piece
    num_params = sum(elements)
    padded = sum(-(-n // plan.world_size) * plan.world_size for n in elements)
    formula = 0 if plan.world_size == 1 else (3 if plan.stage == 3 else 2) * padded
    at_step = getattr(optimizer, "last_step_state_bytes", None)
    measured = (at_step or model_state_bytes(model, optimizer)).total
    return StepReport(
        stage=plan.stage,
        world_size=plan.world_size,
        num_params=num_params,
        collectives=[r.to_json() for r in records],
        totals=summarize([r for r in records if r.group != tp_group]),
        tensor_parallel_elements=sum(r.elements for r in records if r.group == tp_group),
        formula_elements=formula,
        memory={
            "model_states_bytes": measured,
            "formula_bytes": zero_formula_bytes(num_params, plan.world_size, plan.stage, plan.param_dtype),
            "peak_gathered_bytes": peak_gathered + held_ahead,
            "call_prefetch_bytes": held_ahead,  # of peak_gathered_bytes
            "gather_staging_bytes": gather_staging,
            "hpz_secondary_bytes": _hpz_secondary_bytes(graphs, unique)
            - sum(p.hpz_secondary_bytes for g in graphs if g.keep_gathered for p in g.keep_gathered.kept),
            "kept_gathered_bytes": sum(g.keep_gathered.kept_bytes for g in graphs if g.keep_gathered),
            "saved_activation_bytes": sum(
                saved_activation_bytes(g.forward, g.backward) * g.calls_per_forward_run for g in graphs
            ),
            # stages 1 and 2: the step's reduce-scatter and all-gather buckets (optim.buckets.BufferLedger)
            "optimizer_buffers_bytes": getattr(optimizer, "last_step_buffer_peak_bytes", 0),
        },
        schedule=schedule,
        grad_norm=getattr(optimizer, "last_grad_norm", None),
        optimizer_counted=optimizer is not None,
        skipped_steps=getattr(optimizer, "skipped_steps", 0),
        reduce_scatter_as_all_to_all=any(
            g.context is not None and g.context.reduce_scatter_by_all_to_all for g in graphs
        ),
        group_roles=_group_roles(graphs),
        group_sizes=_group_sizes(graphs),
        replicas=graphs[0].context.group.replicas if graphs[0].context is not None else 1,
        tensor_parallel=_tensor_parallel_size(graphs),
        **_memory_plan(model, graphs),
    )


def _memory_plan(model: torch.nn.Module, graphs: list[CompiledGraphs]) -> dict[str, Any]:
    """The plan ``memory_limit_mb`` made (``tune.memory_limit``), and on CUDA the measured peak beside it."""
    plan = model.__dict__.get(MEMORY_PLAN_ATTR)
    if plan is None:
        return {}
    device = graphs[0].context.device_type if graphs[0].context is not None else "cpu"
    measured = torch.cuda.max_memory_allocated() if device == "cuda" and torch.cuda.is_available() else None
    return {
        "memory_plan": plan.summary(),
        "planned_peak_bytes": plan.chosen.peak_bytes,
        "measured_peak_bytes": measured,
    }


def _group_roles(graphs: list[CompiledGraphs]) -> dict[str, str]:
    """The groups' names, for the collectives' rows: hybrid sharding's shard and replicate groups, a
    tensor-parallel model's dp and tp groups (the tp collectives are the model's own, traced)."""
    group = graphs[0].context.group if graphs[0].context is not None else None
    if group is not None and group.tensor_parallel is not None:
        if group.replicate is not None:
            return {group.name: "shard", group.replicate.name: "replicate", group.tensor_parallel.name: "tp"}
        return {group.name: "dp", group.tensor_parallel.name: "tp"}
    if group is None or group.replicate is None:
        return {}
    return {group.name: "shard", group.replicate.name: "replicate"}


def _group_sizes(graphs: list[CompiledGraphs]) -> dict[str, int]:
    group = graphs[0].context.group if graphs[0].context is not None else None
    groups = [] if group is None else [group, group.replicate, group.tensor_parallel]
    return {g.name: g.world_size for g in groups if g is not None}


def _tensor_parallel_size(graphs: list[CompiledGraphs]) -> int:
    group = graphs[0].context.group if graphs[0].context is not None else None
    return group.tensor_parallel.world_size if group is not None and group.tensor_parallel is not None else 1


def _hpz_secondary_bytes(graphs: list[CompiledGraphs], params: list[torch.Tensor]) -> int:
    """hpZ: bytes of the secondary partitions held from forward to backward (padded numel / K each)."""
    hpz = next((g for g in graphs if g.context is not None and g.context.zeropp.hpz_size), None)
    if hpz is None:
        return 0
    world, size, gather_dtype = hpz.plan.world_size, hpz.context.zeropp.hpz_size, hpz.plan.param_dtype
    return sum(-(-p.numel() // world) * world // size * (gather_dtype or p.dtype).itemsize for p in params)


def collective_overlaps(gm: torch.fx.GraphModule | None, graph_id: str, where: str) -> list[OverlapRecord]:
    """For each collective: compute ops between it and its wait, in graph order."""
    if gm is None:
        return []
    nodes = list(gm.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    out = []
    for collective in collective_nodes(gm):
        start = order[collective.node]
        end = min((order[w] for w in collective.waits), default=start)
        between = [
            n
            for n in nodes[start + 1 : end]
            if n.op == "call_function" and n.target not in COLLECTIVE_OPS and n.target is not WAIT
        ]
        out.append(OverlapRecord(graph_id, where, collective.kind, metadata.params_of(collective.node), len(between)))
    return out
