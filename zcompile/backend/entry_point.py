"""The ``zero`` torch.compile backend: Dynamo graph -> pipeline of passes -> AOTAutograd -> inner compiler.

Data flow for one Dynamo graph:

1. ``ZeroConfig.from_options`` validates the options (``compiler="auto"`` made concrete for the graph).
2. The graph is copied (Dynamo reads its own graph again after the backend returns).
3. ``plan_sharding`` lists the parameter inputs. The ranks compare the collectives the graph will
   issue (``check_same_collectives``); where every rank compiles it, the parameters sharded first here
   take rank 0's values (``sync_module_states``); then each parameter gets its shard
   (``shard_parameter``: a flat fp32 1/N slice; stage 3 frees the full storage).
4. The ranks compare the values the shards were cut from; then the ZeRO++ groups are made
   (collective: only once the ranks agree).
5. ``run_passes(context, "dynamo", gm)``: the pipeline's Dynamo-graph passes (``zcompile.backend.pipeline``).
6. AOTAutograd: the joint-graph passes, the min-cut partition, the forward/backward passes, the
   inner compiler (``zcompile.backend.aot``).
7. The returned callable swaps the parameters Dynamo passes for their shards at every call.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from zcompile.agreement.initial_values import check_same_initial_values, value_digest
from zcompile.agreement.rank_check import call_identity, check_same_collectives, issues_collectives
from zcompile.backend.aot import codegen_on_demand, compile_with_aot
from zcompile.backend.compile_gc import full_collections_deferred
from zcompile.backend.compiled import CompileContext, CompiledGraphs, record_compiled_graphs
from zcompile.backend.pass_runner import PassRunner
from zcompile.backend.pipeline import run_passes
from zcompile.backend.refusals import (
    check_devices,
    device_type,
    failure_leaves_refusing_parameters,
    refuse_outer_data_parallel,
    refuse_parameter_writes,
    refuse_regions_with_inductor,
    refuse_tensor_parallel_parameters,
)
from zcompile.backend.shard_swap import ShardSwap
from zcompile.backend.tensor_parallel import link_dtensor_shards, static_fake_pieces, take_local_pieces
from zcompile.backend.zeropp import attach_groups, resolve_zeropp
from zcompile.common.dumps import SHARDING_PLAN_FILE, resolve_dump_root
from zcompile.common.dynamo_frame import (
    forward_modules_on_stack,
    modules_of_compiled_frame,
)
from zcompile.common.process_group import (
    DataParallelGroup,
    reduce_scatter_by_all_to_all,
    warn_if_restarts_share_the_agent_store,
)
from zcompile.config import ZeroConfig
from zcompile.eager.sync import take_first_ranks_values
from zcompile.passes.dtensor_params import local_piece_inputs
from zcompile.passes.param_collectives import ShardingPlan, plan_sharding
from zcompile.passes.regions import subgraph_calls
from zcompile.sharding.buffer_sync import BufferSync, changed_buffer_inputs, note_changed_buffers
from zcompile.sharding.hybrid import data_parallel_group
from zcompile.sharding.shards import (
    mark_like_siblings,
    mark_refusing_parameter,
    shard_of,
)
from zcompile.sharding.state_dict_hooks import attach_state_dict_hooks

log = logging.getLogger(__name__)


@full_collections_deferred()  # compile_gc: a compile's full collections wait for its end
def zero_backend(
    gm: torch.fx.GraphModule, example_inputs: list, options: Any = None, mode: str | None = None
) -> Callable:
    """Compiles one Dynamo graph for ZeRO data parallelism (see the module docstring)."""
    if mode is not None:
        raise ValueError(f"zcompile: torch.compile(mode={mode!r}) is not supported; pass options instead")
    config = ZeroConfig.from_options(options).for_graph(device_type(example_inputs), bool(subgraph_calls(gm)))
    if config.memory_limit_mb is not None:
        raise ValueError(
            "zcompile: option 'memory_limit_mb' is planned by the registered backend, before this one compiles: "
            'use torch.compile(model, backend="zero", options=...) (or zcompile.entry.zero), not '
            "zcompile.backend.zero_backend itself"
        )
    refuse_outer_data_parallel()
    refuse_regions_with_inductor(gm, config)
    warn_if_restarts_share_the_agent_store()
    start = time.perf_counter()
    group = data_parallel_group(
        config, device_type(example_inputs)
    )  # with hybrid sharding, the shard group (and its replicate group)
    gm = copy_dynamo_graph(gm)
    dtensor_inputs, example_inputs = example_inputs, list(example_inputs)
    pieces = local_piece_inputs(gm, example_inputs) if group.tensor_parallel is not None else []
    plan = plan_sharding(
        gm,
        example_inputs,
        config.stage,
        group.world_size,
        group.name,
        config.param_dtype,
        config.effective_reduce_dtype,
    )
    check_devices(plan, example_inputs, group)
    refuse_tensor_parallel_parameters(plan, example_inputs, group, pieces, config.mesh)
    refuse_parameter_writes(gm, plan)
    swap = ShardSwap(plan, group)
    zeropp = resolve_zeropp(config, group)
    collectives = group.world_size > 1 and issues_collectives(plan, zeropp.active)
    # every rank compiles a training graph (the step needs all of them), so a stage-1 one compares too;
    # a graph compiled under no_grad without collectives may be one rank's evaluation alone
    every_rank_compiles = group.world_size > 1 and (collectives or torch.is_grad_enabled())
    if config.check_ranks and collectives:
        check_same_collectives(
            plan,
            gm,
            group,
            config.check_timeout_s,
            zeropp.signature() if zeropp.active else None,
            {"sync_module_states": config.sync_module_states, "memory_limit_mb": config.memory_plan},
        )
    if config.sync_module_states and every_rank_compiles:
        take_first_ranks_values_of_new_parameters(plan, example_inputs, group, config.check_timeout_s)
    tracing_inputs = static_fake_pieces(swap.swap_for_tracing(list(example_inputs)), pieces)  # shards the parameters
    link_dtensor_shards(dtensor_inputs, pieces)  # before the state-dict hooks look for shards
    shards = [shard_of(example_inputs[p.index]) for p in plan.params]
    with failure_leaves_refusing_parameters(shards, str(gm.meta.get("dynamo_compile_id", "?"))):
        frame_modules = modules_of_compiled_frame()
        if plan.params:
            attach_state_dict_hooks(frame_modules)  # model.(load_)state_dict see the shards
        runner = PassRunner.for_graph(gm, resolve_dump_root(config.dump), group.rank)
        runner.dump.write_json(SHARDING_PLAN_FILE, json.loads(plan.to_json()))
        if config.check_ranks and every_rank_compiles:
            check_same_initial_values(
                shards, group, config.check_timeout_s, f"graph {gm.meta.get('dynamo_compile_id', '?')}"
            )
        zeropp = attach_groups(zeropp, group)  # makes process groups: only once the ranks agree
        context = CompileContext(
            config,
            group,
            plan,
            zeropp,
            runner,
            device_type(example_inputs),
            group.world_size > 1 and reduce_scatter_by_all_to_all(config.reduce_scatter, group),
        )
        gm = run_passes(context, "dynamo", gm)
        graphs = CompiledGraphs(dynamo=gm, context=context)
        compiled = compile_with_aot(gm, tracing_inputs, graphs)
    # once the compile succeeded: Dynamo may restart the frame's analysis from inside it (dynamic=True),
    # and the retried compile is the one that runs (shard_parameter's mark)
    record_compiled_graphs(_recorded_on(plan, example_inputs, frame_modules), graphs)  # for step_report
    for sharded in shards:  # Dynamo builds its guards after we return: they see the final class, no recompile
        mark_refusing_parameter(sharded)
    mark_like_siblings(shards, frame_modules, forward_modules_on_stack()[-1:])
    log.info(
        "zcompile: compiled a graph with %d parameters (stage %d, world %d, %s) in %.2fs",
        len(plan.params),
        config.stage,
        group.world_size,
        config.compiler,
        time.perf_counter() - start,
    )
    if config.on_compile is not None:
        config.on_compile(graphs)
    tensor_parallel_agreement = pieces and config.check_ranks
    run = swap.wrap(
        compiled,
        call_identity(plan, gm, None) if tensor_parallel_agreement else _agreed_call(config, group, plan, gm, zeropp),
        config.check_timeout_s,
        str(gm.meta.get("dynamo_compile_id", "?")),
        graphs.call_chains.get("forward"),
        graphs,
        # a tensor-parallel model's graphs run its tp collectives at every stage: a rank calling a graph its tp
        # peers do not (an evaluation on some ranks) would pair them with another call's, silently
        DataParallelGroup.resolve(None) if tensor_parallel_agreement else None,
    )
    if pieces:
        run = take_local_pieces(run, pieces)
    changed = changed_buffer_inputs(plan.buffers, graphs.mutated_inputs)
    if config.broadcast_buffers and changed and group.world_size > 1:
        if plan.params:
            run = note_changed_buffers(run, BufferSync(changed, group), [p.index for p in plan.params])
        else:  # nothing for the optimizer's step to find them by
            log.warning(
                "zcompile: a graph without parameters changes module buffers (%s); they stay per rank",
                ", ".join(name for _, name in changed),
            )
    return run


def take_first_ranks_values_of_new_parameters(plan, example_inputs: list, group: DataParallelGroup, timeout_s: float):
    """The parameters this compile shards first, and the graph's buffers with them, take rank 0's values
    (``sync_module_states``), as DDP's wrap does: the shards are then cut from the same weights on every
    rank. So do stage-1/2 parameters an earlier compile sharded without the ranks (an evaluation under
    ``no_grad`` before the first training step, each rank compiling it alone) whose values were not
    compared yet: they are still whole on every rank, and their shards are cut again from rank 0's.
    Parameters compared already, and recompiles, move nothing."""
    taken, resharded = [], []
    for p in plan.params:
        param = example_inputs[p.index]
        sharded = shard_of(param)
        if sharded is None:
            taken.append(param)
        elif sharded.stage in (1, 2) and sharded.initial_digest is not None:
            taken.append(param)
            resharded.append(sharded)
    if not taken:
        return
    buffers = [example_inputs[index] for index, _ in plan.buffers]
    with torch.no_grad():
        took = take_first_ranks_values(
            taken + buffers,
            group,
            timeout_s,
            "sync-compile",
            "zcompile: taking rank 0's weights at the first compile (sync_module_states)",
            "Every rank compiles the same model: give every rank the same model and inputs.",
        )
        if not took:  # equal on every rank already (the same seed): nothing moved
            return
        for sharded in resharded:
            sharded.write_shard_from_full()
            sharded.initial_digest = value_digest(sharded.param.detach())
    log.info(
        "zcompile: %d parameters and %d buffers took rank 0's values before they were sharded%s, as DDP's wrap "
        "does (sync_module_states=False to require equal weights instead)",
        len(taken),
        len(buffers),
        f" ({len(resharded)} sharded by an earlier compile on each rank alone, cut again)" if resharded else "",
    )


def copy_dynamo_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of Dynamo's graph we may rewrite, keeping the metadata AOTAutograd reads from it."""
    graph = copy.deepcopy(gm.graph)
    new_gm = codegen_on_demand(gm, graph)  # the Dynamo-graph passes change it before anything runs it
    new_gm.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        new_gm._param_name_to_source = gm._param_name_to_source
    for old, new in zip(gm.graph.find_nodes(op="placeholder"), graph.find_nodes(op="placeholder")):
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    return new_gm


def _recorded_on(
    plan: ShardingPlan, example_inputs: list, frame_modules: list[torch.nn.Module]
) -> list[torch.nn.Parameter]:
    """The parameters ``step_report`` finds this graph through: its own, or for a graph without any
    (a loss function compiled after a graph break) those of the modules of its frame, else of the
    outermost module whose forward calls it, so that its saved activations are in the report."""
    if plan.params:
        return [example_inputs[p.index] for p in plan.params]
    modules = frame_modules or forward_modules_on_stack()[-1:]
    return [param for module in modules for param in module.parameters()]


def _agreed_call(
    config: ZeroConfig, group: DataParallelGroup, plan: ShardingPlan, gm: torch.fx.GraphModule, zeropp
) -> str | None:
    """A graph whose call leads to collectives (``agreement.rank_check.issues_collectives``: stage 3's gathers in
    forward, a stage-2 training graph's reduce-scatters in its backward) has the ranks agree on each
    call first (``zcompile.agreement.step_agreement``); stage 1 agrees at the step. Stage 2 too: a rank that
    runs a layer the others skip (LayerDrop drawn per rank) would pair its backward's reduce-scatters
    with theirs of other sizes, which gloo aborts the process on; agreeing in forward, the ranks meet
    different calls there and raise. Named by its
    collectives and mode, not its compile id: a rank's lone recompile for its own shapes makes the same
    call (``agreement.rank_check.call_identity``)."""
    if not agrees_on_each_call(config, group.world_size, plan, zeropp.active):
        return None
    return call_identity(plan, gm, zeropp.signature() if zeropp.active else None)


def agrees_on_each_call(
    config: ZeroConfig, world_size: int, plan: ShardingPlan, zeropp_active: bool, grad_enabled: bool | None = None
) -> bool:
    """Whether the ranks agree before each call of a graph compiled with ``plan`` (``_agreed_call``):
    one store exchange a call, but the first after a step (``zcompile.simulate`` counts them)."""
    # a graph without parameters (a piece of the forward between graph breaks) moves none
    return (
        config.check_ranks
        and world_size > 1
        and bool(plan.params)
        and plan.stage != 1
        and issues_collectives(plan, zeropp_active, grad_enabled)
    )
