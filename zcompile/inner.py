"""AOTAutograd with zcompile's post-partition passes, then the inner compiler (eager or inductor)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from zcompile.comm import graph_collectives
from zcompile.passes.bucketing import bucket_collectives_pass, plan_buckets
from zcompile.passes.cleanup import remove_unused_gathers_pass
from zcompile.passes.hpz import hpz_forward_shortcut_pass
from zcompile.passes.keep_gathered import KeepGatheredPlan, keep_gathered_pass, plan_keep_gathered
from zcompile.passes.quantize_grads import quantize_grads_pass
from zcompile.passes.quantize_weights import quantize_weights_pass
from zcompile.passes.schedule import plan_schedule, schedule_pass
from zcompile.pipeline import PassRecord, PassRunner
from zcompile.rank_check import check_same_on_all_ranks, sequence_signature

log = logging.getLogger(__name__)


@dataclass
class CompiledGraphs:
    """The graphs one Dynamo graph became, filled in as AOTAutograd compiles them.

    ``backward`` is compiled lazily by AOTAutograd and may stay ``None`` until the first backward.
    """

    dynamo: torch.fx.GraphModule
    plan: Any
    forward: torch.fx.GraphModule | None = None
    backward: torch.fx.GraphModule | None = None
    inference: torch.fx.GraphModule | None = None
    runner: PassRunner | None = None  # the passes applied so far, and the dump folder
    config: Any = None  # the ZeroConfig it was compiled with
    group: Any = None  # the DataParallelGroup
    zeropp: Any = None  # the ZeroPPSettings (ZeRO++ techniques that run, and their groups)
    keep_gathered: KeepGatheredPlan | None = None  # stage-3 weights kept from forward to backward

    @property
    def passes(self) -> list[PassRecord]:
        return [] if self.runner is None else self.runner.records


def _post_partition(graph_module: torch.fx.GraphModule, kind: str, graphs: CompiledGraphs) -> torch.fx.GraphModule:
    runner, config = graphs.runner, graphs.config
    graph_module = runner.run("remove_unused_gathers", remove_unused_gathers_pass, graph_module, kind)
    zeropp = graphs.zeropp
    if zeropp is not None and zeropp.hpz_size > 1 and kind != "backward":
        graph_module = runner.run("hpz_forward_shortcut", hpz_forward_shortcut_pass, graph_module, kind,
                                  zeropp.hpz_group_name)
    bucket_bytes = int(config.bucket_mb * 2**20) if config is not None else 0
    if bucket_bytes:
        plan = plan_buckets(graph_module, bucket_bytes, kind)
        runner.write_json(f"buckets.{kind}.json", json.loads(plan.to_json()))
        graph_module = runner.run("bucket_collectives", bucket_collectives_pass, graph_module, kind, plan)
    if zeropp is not None and zeropp.quantize_weights and kind != "backward":
        graph_module = runner.run("quantize_weights", quantize_weights_pass, graph_module, kind,
                                  graphs.group.name, zeropp.block)
    if zeropp is not None and zeropp.quantize_grads and kind == "backward":
        graph_module = runner.run("quantize_grads", quantize_grads_pass, graph_module, kind, graphs.group.name,
                                  graphs.group.world_size, zeropp.node_size, zeropp.intra_group_name,
                                  zeropp.inter_group_name, zeropp.block)
    if config is not None and config.overlap:
        budget = None if config.memory_budget_mb is None else int(config.memory_budget_mb * 2**20)
        schedule = plan_schedule(graph_module, config.prefetch, budget, kind)
        runner.write_json(f"schedule.{kind}.json", json.loads(schedule.to_json()))
        graph_module = runner.run("schedule", schedule_pass, graph_module, kind, schedule)
    setattr(graphs, kind, graph_module)
    if config is not None and config.check_ranks and graphs.group is not None:
        # the schedule decided the issue order; every rank must have decided the same
        check_same_on_all_ranks(sequence_signature(graph_module), graphs.group, config.check_timeout_s,
                                f"the {kind} graph of Dynamo graph {runner.graph_id}")
    runner.write_json(f"collectives.{kind}.json", [c.to_json() for c in graph_collectives(graph_module, kind)])
    return graph_module


def _keep_gathered_joint(joint: torch.fx.GraphModule, graphs: CompiledGraphs) -> None:
    """Plans and applies keep-gathered on AOTAutograd's joint graph, before the partition."""
    config = graphs.config
    if config is None or not config.keep_gathered_mb:  # (ZeroConfig allows it at stage 3 only)
        return
    plan = plan_keep_gathered(joint.graph, int(config.keep_gathered_mb * 2**20))
    graphs.keep_gathered = plan
    graphs.runner.write_json("keep_gathered.json", json.loads(plan.to_json()))
    graphs.runner.run("keep_gathered", keep_gathered_pass, joint, "joint", plan)


class _KeepGatheredJointPass(CustomGraphPass):
    """``_keep_gathered_joint`` as inductor's joint-graph hook (``joint_custom_pre_pass``)."""

    def __init__(self, graphs: CompiledGraphs):
        self.graphs = graphs

    def __call__(self, graph: torch.fx.Graph) -> None:
        _keep_gathered_joint(graph.owning_module, self.graphs)

    def uuid(self):
        return get_hash_for_files((keep_gathered_pass.__code__.co_filename,), str(self.graphs.config.keep_gathered_mb))


def compile_with_aot(
    gm: torch.fx.GraphModule, example_inputs: list, compiler: str, graphs: CompiledGraphs
) -> Callable:
    """Runs AOTAutograd on the rewritten Dynamo graph and compiles forward and backward.

    The min-cut partitioner is used with both inner compilers because it honours the
    ``MUST_RECOMPUTE`` tags of stage-3 gathers (the backward re-gathers instead of saving);
    keep-gathered lifts some of those tags on the joint graph just before it partitions.
    """
    if compiler == "eager":

        def partition(joint, joint_inputs, **kwargs):
            _keep_gathered_joint(joint, graphs)
            return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

        def make_compiler(kind: str):
            def compile_eager(graph_module, inputs):
                return make_boxed_func(_post_partition(graph_module, kind, graphs).forward)

            return compile_eager

        backend = aot_autograd(
            fw_compiler=make_compiler("forward"),
            bw_compiler=make_compiler("backward"),
            inference_compiler=make_compiler("inference"),
            partition_fn=partition,
            keep_inference_input_mutations=True,
        )
        return backend(gm, example_inputs)

    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(graph_module, inputs, **kwargs):
        kind = "backward" if kwargs.get("is_backward") else "inference" if kwargs.get("is_inference") else "forward"
        return compile_fx_inner(_post_partition(graph_module, kind, graphs), inputs, **kwargs)

    patches = {"joint_custom_pre_pass": _KeepGatheredJointPass(graphs)} if graphs.config.keep_gathered_mb else None
    return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)
