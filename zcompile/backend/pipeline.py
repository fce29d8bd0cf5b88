"""The pass pipeline of the zero backend, as one ordered table.

Each row names a pass of ``zcompile.passes``, the graphs it runs on, when it is enabled (read from
the ``CompileContext``: options, group, ZeRO++ settings) and its keyword options. A row with a
``planner`` plans first (plain data, dumped as ``{plan}.{graph}.json`` and kept in
``context.plans``), then the pass applies the plan. ``run_passes(context, graph, gm)`` applies, in
table order, the enabled rows for that graph through the context's ``PassRunner`` (timing, dumps,
``PassError``; the runner lints every result).

The graphs, in the order a compile meets them:

- ``dynamo``: Dynamo's graph, before AOTAutograd (parameters routed through shards, autocast, hpZ);
- ``joint``: AOTAutograd's joint forward+backward graph, just before the min-cut partition;
- ``forward`` / ``inference`` / ``backward``: the partitioned graphs, before the inner compiler.

Order constraints are written in the table as ``after``: a row names the rows that must come
before it when both are enabled, and ``check_table`` (run by the tests) verifies the order.

Adding a pass: a module in ``passes/`` with the pass function (and its planner, if it plans), one
row here, and its option in ``zcompile/config.py`` when it has one (``passes/README.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zcompile.backend.compiled import CompileContext
from zcompile.common.dumps import plan_file
from zcompile.passes.bucketing import bucket_collectives_pass, plan_buckets
from zcompile.passes.cleanup import remove_unused_gathers_pass
from zcompile.passes.grad_hooks import hooked_params, route_grad_hooks_pass
from zcompile.passes.grad_reduction import expand_grad_reductions_pass
from zcompile.passes.hpz import hpz_forward_shortcut_pass, hpz_pass
from zcompile.passes.identity_views import drop_identity_views_pass
from zcompile.passes.keep_gathered import keep_gathered_pass, plan_keep_gathered
from zcompile.passes.loss_backward import fuse_cross_entropy_backward_pass
from zcompile.passes.mixed_precision import autocast_pass, custom_ops_in_traced_dtypes_pass, norm_params_in_fp32_pass
from zcompile.passes.param_collectives import insert_param_collectives_pass
from zcompile.passes.param_gather import expand_param_gathers_pass
from zcompile.passes.quantize_grads import quantize_grads_pass
from zcompile.passes.quantize_weights import quantize_weights_pass
from zcompile.passes.random_draws import save_random_draws_pass
from zcompile.passes.reduce_scatter_lowering import reduce_scatter_as_all_to_all_pass
from zcompile.passes.regions import regather_through_regions_pass
from zcompile.passes.replica_reduction import all_reduce_across_replicas_pass
from zcompile.passes.schedule import plan_schedule, schedule_pass
from zcompile.passes.summed_all_reduces import merge_summed_all_reduces_pass

DYNAMO = ("dynamo",)
JOINT = ("joint",)
FORWARD = ("forward", "inference")
BACKWARD = ("backward",)
PARTITIONED = FORWARD + BACKWARD
MIB = 2**20

Options = Callable[[CompileContext, str], dict[str, Any]]


def _always(context: CompileContext) -> bool:
    return True


def _no_options(context: CompileContext, graph: str) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class PassRow:
    """One pass of the pipeline: what it is, where it runs, when, and with which options."""

    name: str
    graphs: tuple[str, ...]
    apply: Callable[..., torch.fx.GraphModule]  # apply(gm, **options), or apply(gm, plan) with a planner
    enabled: Callable[[CompileContext], bool] = _always
    options: Options = _no_options  # keyword options of the pass, or of its planner
    planner: Callable[..., Any] | None = None  # planner(gm, **options) -> a plan with to_json()
    plan_name: str = ""  # dump file stem of the plan
    after: tuple[str, ...] = ()  # rows that must run before this one (on the same or an earlier graph)


PIPELINE: tuple[PassRow, ...] = (
    PassRow(
        "insert_param_collectives",
        DYNAMO,
        insert_param_collectives_pass,
        enabled=lambda c: c.sharding.stage > 1 and bool(c.sharding.params),
        options=lambda c, g: {"plan": c.sharding},
    ),
    PassRow(
        "route_grad_hooks",
        DYNAMO,
        route_grad_hooks_pass,
        enabled=lambda c: bool(hooked_params(c.sharding)),
        options=lambda c, g: {"plan": c.sharding},
        after=("insert_param_collectives",),
    ),
    # the norms' weights as the graph receives them (stage 3: gathered in param_dtype)
    PassRow(
        "norm_params_in_fp32",
        DYNAMO,
        norm_params_in_fp32_pass,
        enabled=lambda c: c.config.param_dtype is not None and c.device_type == "cpu",
        options=lambda c, g: {"device_type": c.device_type},
        after=("insert_param_collectives",),
    ),
    # the weights as the graph receives them (in param_dtype), where autocast does not reach
    PassRow(
        "custom_ops_in_traced_dtypes",
        DYNAMO,
        custom_ops_in_traced_dtypes_pass,
        enabled=lambda c: c.config.param_dtype is not None,
        options=lambda c, g: {"plan": c.sharding},
        after=("insert_param_collectives",),
    ),
    PassRow(
        "autocast",
        DYNAMO,
        autocast_pass,
        enabled=lambda c: c.config.param_dtype is not None,
        options=lambda c, g: {"dtype": c.config.param_dtype, "device_type": c.device_type},
    ),
    PassRow(
        "hpz",
        DYNAMO,
        hpz_pass,
        enabled=lambda c: c.zeropp.hpz_size > 0,
        options=lambda c, g: {
            "hpz_size": c.zeropp.hpz_size,
            "hpz_rank": c.zeropp.hpz_rank,
            "hpz_group_name": c.zeropp.hpz_group_name,
        },
        after=("insert_param_collectives",),
    ),
    # always: any budget torch's partitioner is given (zcompile's option or torch's own config) may
    # otherwise recompute a dropout in the backward with a fresh mask
    PassRow("save_random_draws", JOINT, save_random_draws_pass),
    # before keep_gathered: it then sees the blocks' weights read by the backward and may keep them
    PassRow(
        "regather_through_regions",
        JOINT,
        regather_through_regions_pass,
        enabled=lambda c: c.sharding.stage == 3 and bool(c.sharding.params),
        after=("insert_param_collectives", "hpz"),
    ),
    PassRow(
        "keep_gathered",
        JOINT,
        keep_gathered_pass,
        enabled=lambda c: c.config.keep_gathered_mb > 0,  # ZeroConfig allows it at stage 3 only
        planner=plan_keep_gathered,
        plan_name="keep_gathered",
        options=lambda c, g: {"budget_bytes": int(c.config.keep_gathered_mb * MIB)},
        after=("insert_param_collectives", "hpz", "regather_through_regions"),
    ),
    # the gradient reductions traced as one op each, written out before any pass reads a backward
    PassRow("expand_grad_reductions", BACKWARD, expand_grad_reductions_pass),
    # the stage-3 gathers, likewise one op each through the trace and the partition (forward and recomputed)
    PassRow(
        "expand_param_gathers",
        PARTITIONED,
        expand_param_gathers_pass,
        enabled=lambda c: c.sharding.stage == 3 and bool(c.sharding.params),
    ),
    PassRow("remove_unused_gathers", PARTITIONED, remove_unused_gathers_pass, after=("expand_param_gathers",)),
    # a view of each parameter to its own shape at stages 2 and 3 (graph_ops' autograd functions)
    PassRow("drop_identity_views", PARTITIONED, drop_identity_views_pass),
    # tensor parallelism's input-gradient all-reduces that autograd only adds up: one of their sum
    PassRow(
        "merge_summed_all_reduces",
        BACKWARD,
        merge_summed_all_reduces_pass,
        enabled=lambda c: c.config.tensor_parallel,
    ),
    # compute, not communication: independent of every other row; first, so the schedule's memory
    # budget and the walks see the one buffer
    PassRow(
        "fuse_cross_entropy_backward",
        BACKWARD,
        fuse_cross_entropy_backward_pass,
        enabled=lambda c: c.config.fuse_loss_backward,
    ),
    PassRow(
        "hpz_forward_shortcut",
        FORWARD,
        hpz_forward_shortcut_pass,
        enabled=lambda c: c.zeropp.hpz_size > 1,
        options=lambda c, g: {"hpz_group_name": c.zeropp.hpz_group_name},
        after=("hpz", "remove_unused_gathers"),
    ),
    PassRow(
        "bucket_collectives",
        PARTITIONED,
        bucket_collectives_pass,
        enabled=lambda c: c.config.bucket_mb > 0,
        planner=plan_buckets,
        plan_name="buckets",
        options=lambda c, g: {"bucket_bytes": int(c.config.bucket_mb * MIB), "graph": g},
        after=("expand_grad_reductions", "expand_param_gathers", "remove_unused_gathers", "hpz_forward_shortcut"),
    ),
    # qwZ and qgZ quantize whole (bucketed) collectives: after bucketing, before the schedule moves them
    PassRow(
        "quantize_weights",
        FORWARD,
        quantize_weights_pass,
        enabled=lambda c: c.zeropp.quantize_weights,
        options=lambda c, g: {"group_name": c.group.name, "block": c.zeropp.block},
        after=("bucket_collectives",),
    ),
    PassRow(
        "quantize_grads",
        BACKWARD,
        quantize_grads_pass,
        enabled=lambda c: c.zeropp.quantize_grads,
        options=lambda c, g: {
            "group_name": c.group.name,
            "world": c.group.world_size,
            "node_size": c.zeropp.node_size,
            "intra_name": c.zeropp.intra_group_name,
            "inter_name": c.zeropp.inter_group_name,
            "block": c.zeropp.block,
        },
        after=("bucket_collectives",),
    ),
    PassRow(
        "schedule",
        PARTITIONED,
        schedule_pass,
        enabled=lambda c: c.config.overlap,
        planner=plan_schedule,
        plan_name="schedule",
        options=lambda c, g: {
            "prefetch": c.config.prefetch,
            "graph": g,
            "policy": c.config.schedule_policy,
            "memory_budget": (None if c.config.memory_budget_mb is None else int(c.config.memory_budget_mb * MIB)),
        },
        after=("bucket_collectives", "quantize_weights", "quantize_grads"),
    ),
    # hybrid sharding: each reduced shard on to the other shard groups, once the schedule placed its wait
    PassRow(
        "all_reduce_across_replicas",
        BACKWARD,
        all_reduce_across_replicas_pass,
        enabled=lambda c: c.group.replicate is not None,
        options=lambda c, g: {"replicas": c.group.replicas, "group_name": c.group.replicate.name},
        after=("bucket_collectives", "schedule"),
    ),
    # how this backend runs what the passes above planned: last, in place, the kind kept
    PassRow(
        "reduce_scatter_as_all_to_all",
        BACKWARD,
        reduce_scatter_as_all_to_all_pass,
        enabled=lambda c: c.reduce_scatter_by_all_to_all,
        after=("bucket_collectives", "quantize_grads", "schedule", "all_reduce_across_replicas"),
    ),
)


def run_passes(
    context: CompileContext, graph: str, gm: torch.fx.GraphModule, table: tuple[PassRow, ...] = PIPELINE
) -> torch.fx.GraphModule:
    """Applies the enabled rows of ``table`` for ``graph`` to ``gm``, in order (module docstring)."""
    runner = context.runner
    for row in table:
        if graph not in row.graphs or not row.enabled(context):
            continue
        options = row.options(context, graph)
        if row.planner is None:
            gm = runner.run(row.name, row.apply, gm, graph, **options)
            continue
        plan = row.planner(gm, **options)
        name = plan_file(row.plan_name, graph)
        context.plans[name.removesuffix(".json")] = plan
        runner.dump.write_text(name, plan.to_json())
        gm = runner.run(row.name, row.apply, gm, graph, plan)
    return gm


def check_table(table: tuple[PassRow, ...] = PIPELINE) -> None:
    """Raises ``ValueError`` when a row's ``after`` names an unknown row or one placed after it."""
    position = {row.name: i for i, row in enumerate(table)}
    if len(position) != len(table):
        raise ValueError("zcompile.pipeline: two rows have the same name")
    for i, row in enumerate(table):
        for before in row.after:
            if before not in position:
                raise ValueError(
                    f"zcompile.pipeline: {row.name!r} must run after {before!r}, which is not in the table"
                )
            if position[before] >= i:
                raise ValueError(
                    f"zcompile.pipeline: {row.name!r} must run after {before!r}, but the table has it later"
                )
