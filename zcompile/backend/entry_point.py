"""The ``zero`` torch.compile backend: Dynamo graph -> pipeline of passes -> AOTAutograd -> inner compiler.

Data flow for one Dynamo graph:

1. ``ZeroConfig.from_options`` validates the options.
2. The graph is copied (Dynamo reads its own graph again after the backend returns).
3. ``plan_sharding`` lists the parameter inputs; each parameter gets its shard
   (``shard_parameter``: a flat fp32 1/N slice; stage 3 frees the full storage).
4. The ranks compare the collectives the graph will issue (``check_same_collectives``); then the
   ZeRO++ groups are made (collective: only once the ranks agree).
5. ``run_passes(context, "dynamo", gm)``: the pipeline's Dynamo-graph passes (``zcompile.backend.pipeline``).
6. AOTAutograd: the joint-graph passes, the min-cut partition, the forward/backward passes, the
   inner compiler (``zcompile.backend.aot``).
7. The returned callable swaps the parameters Dynamo passes for their shards at every call.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

from zcompile.agreement.abort_note import leave_abort_note, raise_if_aborted
from zcompile.agreement.heartbeat import heartbeat
from zcompile.agreement.initial_values import check_same_initial_values
from zcompile.agreement.rank_check import call_identity, check_same_collectives, issues_collectives
from zcompile.agreement.step_agreement import agree_on_call, take_free_call
from zcompile.backend.aot import codegen_on_demand, compile_with_aot
from zcompile.backend.call_prefetch import CallChain
from zcompile.backend.compile_gc import full_collections_deferred
from zcompile.backend.compiled import CompileContext, CompiledGraphs, record_compiled_graphs
from zcompile.backend.pass_runner import PassRunner
from zcompile.backend.pipeline import run_passes
from zcompile.backend.zeropp import attach_groups, resolve_zeropp
from zcompile.common.dumps import SHARDING_PLAN_FILE, resolve_dump_root
from zcompile.common.dynamo_frame import (
    eager_fallback_cause,
    forward_modules_on_stack,
    modules_of_compiled_frame,
    outer_data_parallel_wrapper,
    restarts_analysis,
)
from zcompile.common.process_group import DataParallelGroup, reduce_scatter_by_all_to_all
from zcompile.config import ZeroConfig
from zcompile.passes.grad_hooks import hooked_params
from zcompile.passes.param_collectives import ShardingPlan, gradient_leaves_parameter, plan_sharding
from zcompile.passes.param_writes import parameter_writes
from zcompile.passes.regions import subgraph_calls
from zcompile.routes import install as install_routes
from zcompile.sharding.buffer_sync import BufferSync, changed_buffer_inputs, note_changed_buffers
from zcompile.sharding.sharded_parameter import ShardedParameterError
from zcompile.sharding.shards import (
    ShardedParam,
    mark_like_siblings,
    mark_refusing_parameter,
    shard_of,
    shard_parameter,
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
    config = ZeroConfig.from_options(options)
    _refuse_outer_data_parallel()
    _refuse_regions_with_inductor(gm, config)
    start = time.perf_counter()
    group = DataParallelGroup.resolve(config.group)
    gm = copy_dynamo_graph(gm)
    plan = plan_sharding(
        gm,
        example_inputs,
        config.stage,
        group.world_size,
        group.name,
        config.param_dtype,
        config.effective_reduce_dtype,
    )
    _check_devices(plan, example_inputs, group)
    _refuse_parameter_writes(gm, plan)
    swap = ShardSwap(plan, group)
    tracing_inputs = swap.swap_for_tracing(list(example_inputs))  # shards the parameters
    shards = [shard_of(example_inputs[p.index]) for p in plan.params]
    with _failure_leaves_refusing_parameters(shards, str(gm.meta.get("dynamo_compile_id", "?"))):
        frame_modules = modules_of_compiled_frame()
        if plan.params:
            attach_state_dict_hooks(frame_modules)  # model.(load_)state_dict see the shards
        runner = PassRunner.for_graph(gm, resolve_dump_root(config.dump), group.rank)
        runner.dump.write_json(SHARDING_PLAN_FILE, json.loads(plan.to_json()))
        zeropp = resolve_zeropp(config, group)
        if config.check_ranks and group.world_size > 1:
            collectives = issues_collectives(plan, zeropp.active)
            if collectives:
                check_same_collectives(
                    plan, gm, group, config.check_timeout_s, zeropp.signature() if zeropp.active else None
                )
            # every rank compiles a training graph (the step needs all of them), so a stage-1 one compares
            # too; a graph compiled under no_grad without collectives may be one rank's evaluation alone
            if collectives or torch.is_grad_enabled():
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
            _device_type(example_inputs),
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
    run = swap.wrap(
        compiled,
        _agreed_call(config, group, plan, gm, zeropp),
        config.check_timeout_s,
        str(gm.meta.get("dynamo_compile_id", "?")),
        graphs.call_chains.get("forward"),
        graphs,
    )
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


class ShardSwap:
    """Replaces, in a call's arguments, each parameter by what the rewritten graph takes instead.

    stage 3: the shard at the parameter's position; stage 2: a detached alias of the replicated
    parameter (its gradient goes to the shard) plus the shards appended; stage 1: nothing, or the
    low-precision replica (``param_dtype``), whose gradient is then the local full gradient.

    The shard is looked up on the parameter passed at each call, not fixed at compile time:
    Dynamo reuses one graph for every instance of a module class (each transformer block), so
    the same graph position sees a different parameter per call. A parameter reaching a graph
    for the first time at run time is sharded then, identically on every rank.
    """

    def __init__(self, plan: ShardingPlan, group: DataParallelGroup):
        self.plan = plan
        self.group = group
        # the parameters whose gradient the graph takes away from them: autograd runs none of their
        # hooks, so those the graph was not built for are refused at every call (check_hooks)
        self._gradient_moved = [p for p in plan.params if gradient_leaves_parameter(plan, p)]
        self._hooked = {p.index for p in hooked_params(plan)}  # each takes its hooks token, appended last

    def sharded(self, param: torch.nn.Parameter, name: str, mark: bool = True) -> ShardedParam:
        existing = shard_of(param)
        if existing is not None and existing.stage == self.plan.stage and existing.group.name == self.group.name:
            existing.follow_replaced_storage()
            return existing
        # new, or sharded for another stage or group: shard_parameter raises with the fix
        install_routes()  # before the first shard: torch's functions must route zcompile parameters
        return shard_parameter(
            param, name, self.plan.stage, self.group, self.plan.reduce_dtype, self.plan.param_dtype, mark=mark
        )

    def swap(self, args: list, counted: bool = True, mark: bool = True) -> list:
        # calls, and calls with gradients, are counted on their parameters' shards (zcompile.agreement.step_agreement)
        training = int(counted and torch.is_grad_enabled())
        appended, tokens = [], []
        _check_requires_grad(self.plan, self.group, args)
        if self._gradient_moved:
            self.check_hooks(args)
        for p in self.plan.params:
            sharded = self.sharded(args[p.index], p.name, mark)
            sharded.training_calls += training
            if p.index in self._hooked:
                tokens.append(sharded.hooks_token)
            if self.plan.stage == 1:
                if sharded.replica is not None:
                    _follow_requires_grad(sharded.replica, p.requires_grad)
                    args[p.index] = sharded.replica  # its gradient is stage 1's full gradient
                continue
            if self.plan.stage == 3:
                _follow_requires_grad(sharded.shard, p.requires_grad)
                args[p.index] = sharded.shard
            else:
                _follow_requires_grad(sharded.grad_target, p.requires_grad)
                args[p.index] = sharded.replicated_alias
                appended.append(sharded.grad_target)
        return args + appended + tokens if appended or tokens else args

    def check_hooks(self, args: list) -> None:
        """Raises ``ValueError`` for a hook this graph cannot run: a post-accumulate-grad hook on a
        parameter whose gradient never accumulates on it, or a gradient hook registered after the
        graph was compiled without a place for it (Dynamo does not guard hooks: no recompile). Read
        with torch-function subclasses disabled, as ``passes.param_collectives.tensor_hooks`` reads them."""
        message = None
        with DisableTorchFunctionSubclass():  # one context for all: 150 parameters read in about 20 us
            for p in self._gradient_moved:
                param = args[p.index]
                if param._post_accumulate_grad_hooks:
                    message = _post_accumulate_message(p, self.plan)
                elif not p.grad_hooks and param._backward_hooks:
                    message = _late_hook_message(p)
                if message is not None:
                    break
        if message is not None:
            leave_abort_note(self.group, message)
            raise ValueError(message)

    def first_call_since_agreed_step(self, args: tuple) -> bool:
        """Whether this call is the first compiled call with collectives since the ranks agreed on a
        step, all its parameters members of that step: the ranks then left that agreement together and
        this is where each goes next, so the call needs no agreement of its own (the common case: the
        forward right after ``optimizer.step()``; one store exchange per step instead of two). Takes the
        step's one such call either way (``take_free_call``): the calls after it are not where every
        rank goes next (blocks compiled one by one are one graph called per layer: a rank that skipped
        a layer calls the next one, whose collectives pair with another call's)."""
        return take_free_call([shard_of(args[p.index]) for p in self.plan.params])

    def swap_for_tracing(self, example_inputs: list) -> list:
        """``swap`` with the new inputs as static-shape fake tensors of Dynamo's fake mode.

        AOTAutograd would otherwise give tensors it has no Dynamo source for symbolic sizes,
        and guards on those symbols cannot be expressed by Dynamo.
        """
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        originals = {id(a) for a in example_inputs}
        args = self.swap(list(example_inputs), counted=False, mark=False)
        if fake_mode is None:
            return args
        return [a if id(a) in originals else fake_mode.from_tensor(a, static_shapes=True) for a in args]

    def wrap(
        self,
        compiled: Callable,
        agreed_call: str | None = None,
        timeout_s: float = 60.0,
        graph_id: str = "?",
        chain: CallChain | None = None,
        graphs: CompiledGraphs | None = None,
    ) -> Callable:
        """The compiled graph taking the shards; ``agreed_call``: what every rank must be calling
        before it runs (``zcompile.agreement.step_agreement.agree_on_call``), None for no agreement. ``chain``:
        the forward's cross-call prefetch (``zcompile.backend.call_prefetch``), whose plan the agreement
        compares too: a rank that takes a prefetched gather while another gathers its own, or issues
        one the other does not, would pair its collectives with others. ``graphs``: counts its training
        calls (``CompiledGraphs.note_training_call``)."""
        if not self.plan.params:
            return compiled

        beat = heartbeat()  # a rank stuck in this graph's collectives is not busy with work of its own
        what = f"compiled graph {graph_id}"

        def run_swapped(args: list):
            if graphs is not None and torch.is_grad_enabled():
                graphs.note_training_call()
            try:
                if beat is None:
                    return compiled(*args)
                with beat.blocked(what):
                    return compiled(*args)
            except Exception as error:  # a collective failed: maybe another rank left, saying why
                raise_if_aborted(self.group, error)
                raise

        if agreed_call is None:
            return lambda *args: run_swapped(self.swap(list(args)))
        if chain is not None:
            chain.agreed = True  # its calls take and issue prefetches only as agreed

        def run_agreed(*args):
            free = self.first_call_since_agreed_step(args)
            swapped = self.swap(list(args))
            if not free:
                plan = "" if chain is None else chain.plan(chain.inputs_of_call(swapped)).describe()
                agree_on_call(self.group, agreed_call + plan, timeout_s)
            return run_swapped(swapped)

        return run_agreed


class StaleGraphError(RuntimeError):
    """A compiled graph was called with a parameter whose ``requires_grad`` changed since it was traced."""


def _check_requires_grad(plan: ShardingPlan, group: DataParallelGroup, args: list) -> None:
    """Raises ``StaleGraphError`` if a parameter's ``requires_grad`` is not the one the graph was traced
    with, leaving the message for the other ranks (one rank alone may have switched the flag: they
    would read "connection closed" in their collectives). Read with torch-function subclasses
    disabled: through a stage-3 parameter's ``__torch_function__`` each read costs 4 us, 0.56 ms a
    call at 150 parameters; 25 us this way."""
    with DisableTorchFunctionSubclass():
        stale = next((p for p in plan.params if args[p.index].requires_grad != p.requires_grad), None)
    if stale is not None:
        message = _stale_message(stale, not stale.requires_grad)
        leave_abort_note(group, message)
        raise StaleGraphError(message)


def _stale_message(param, requires_grad: bool) -> str:
    return (
        f"zcompile: parameter {param.name!r} has requires_grad={requires_grad}, but the graph Dynamo chose "
        f"for this call was traced with requires_grad={param.requires_grad} and was not recompiled "
        f"(torch {torch.__version__.split('+')[0]}'s Dynamo does not guard a parameter's requires_grad; "
        "torch 2.13's does). Running it would leave the parameter's training as it was, silently. After "
        "freezing or unfreezing parameters, call torch.compiler.reset() (the next call recompiles, "
        "keeping the shards and the optimizer's state), or use torch 2.13 or newer. Where blocks compiled one "
        "by one share a graph but not their frozen weights (the first layers frozen), compile the whole "
        "model instead."
    )


def _post_accumulate_message(param, plan: ShardingPlan) -> str:
    where = (
        f"ZeRO stage {plan.stage}"
        if plan.stage != 1
        else f"stage 1 with param_dtype={plan.param_dtype} (the graphs take a low-precision replica)"
    )
    return (
        f"zcompile: parameter {param.name!r} has a post-accumulate-grad hook "
        f"(register_post_accumulate_grad_hook). At {where} its gradient never accumulates in the parameter's "
        ".grad: the compiled backward reduce-scatters it onto this rank's shard, so the hook would never run. "
        "Use param.register_hook(fn) instead (zcompile runs it on the local gradient before the reduction, as "
        "DDP does), or stage 1 without param_dtype, or run the hook's work after optimizer.step()"
    )


def _late_hook_message(param) -> str:
    return (
        f"zcompile: parameter {param.name!r} got a gradient hook (register_hook) after the graph that uses it "
        "was compiled without one. The graph routes the gradient to a shard, and Dynamo does not recompile "
        "for a new hook, so the hook would never run. Register gradient hooks before the first compiled "
        "call, or call torch.compiler.reset() after registering them (the next call recompiles, keeping the "
        "shards and the optimizer's state). Where blocks compiled one by one share a graph, give every "
        "block the hooks"
    )


def _follow_requires_grad(leaf: torch.Tensor, requires_grad: bool) -> None:
    """The tensor that takes a parameter's gradient in its place (the shard, stage 2's grad target, a
    low-precision replica) requires grad exactly when the parameter did as this graph was traced.

    Freezing or unfreezing a parameter between steps (``p.requires_grad_(False)``) makes Dynamo
    recompile, since its guards check ``requires_grad``; but the graphs take the stand-in, and one
    left as it was when first sharded kept a frozen parameter training (or an unfrozen one frozen),
    with no error. Set here at every call, not only when tracing: a graph compiled earlier, for the
    other setting, runs again when the parameter is switched back. A plain tensor's flag: no cost."""
    if leaf.requires_grad != requires_grad:
        leaf.requires_grad_(requires_grad)


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
    """A graph whose call leads to collectives (``rank_check.issues_collectives``: stage 3's gathers in
    forward, a stage-2 training graph's reduce-scatters in its backward) has the ranks agree on each
    call first (``zcompile.agreement.step_agreement``); stage 1 agrees at the step. Stage 2 too: a rank that ran
    a layer of another size than the others (LayerDrop drawn per rank over transformers' BART encoder
    and decoder) paired its backward's reduce-scatters with theirs of other sizes, and gloo aborted the
    process; agreeing in forward, the ranks meet different calls there and raise. Named by its
    collectives and mode, not its compile id: a rank's lone recompile for its own shapes makes the same
    call (``rank_check.call_identity``)."""
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


def _refuse_parameter_writes(gm: torch.fx.GraphModule, plan: ShardingPlan) -> None:
    """A forward that writes a parameter in place would write one rank's copy of it, not the shards
    (``passes/param_writes.py``): refused on every rank (each compiles the same graph), before any
    parameter is sharded."""
    writes = parameter_writes(gm, {p.index: p.name for p in plan.params})
    if writes:
        listed = "; ".join(f"{name!r}: {what}" for name, what in writes[:4]) + (" ..." if len(writes) > 4 else "")
        raise ValueError(
            f"zcompile: the compiled forward writes parameters in place ({listed}). ZeRO keeps each weight's "
            "value on its shards (each rank 1/N of it) and the graphs read a copy, so the write would reach only this "
            "rank's copy and the weights would silently differ from one process's. Take the write out of the forward "
            "(nn.Embedding(max_norm=None)); where the constraint matters, apply it after optimizer.step(), on every "
            "rank, inside `with zcompile.gathered(model): ...`, which writes the change back to the shards (for an "
            "embedding: torch.embedding_renorm_(emb.weight, ids, max_norm, 2.0) under torch.no_grad())"
        )


@contextlib.contextmanager
def _failure_leaves_refusing_parameters(shards: list, graph: str):
    """Once ``shards`` are cut (stage 3's full storage freed), a failure of the rest of the compile (a
    rank check, a pass, AOTAutograd, the inner compiler) leaves them marked: eager use of one (Dynamo's
    fallback, a print of the model in an except clause) is a ``ShardedParameterError``, not torch
    reading freed memory (a parameter's repr segfaulted). Not on Dynamo's request to trace again: its
    replay must see the parameters' classes as this trace did (else a SpeculationLogDivergence)."""
    try:
        yield
    except Exception as error:
        if not restarts_analysis(error):
            for sharded in shards:
                mark_refusing_parameter(sharded)
        _refuse_eager_fallback(error, graph, shards)
        raise


def _refuse_eager_fallback(error: BaseException, graph: str, shards: list) -> None:
    """A compile that failed where Dynamo then runs the graph's frame eagerly (its fallback, with a
    warning to report the backend): with parameters whose full storage this compile freed (stage 3, or
    a low-precision replica), eager code cannot run them, and the fallback stopped at the first with
    torch's "setStorage ... out of bounds for storage of size 0" (or at best, where one was marked, a
    ShardedParameterError blaming a graph break); that is an error now, naming the op and the setting
    that compiles it. Where the parameters keep their full values the fallback runs, slower (no
    overlap in that frame), and the log says why and how to compile the op."""
    cause = eager_fallback_cause(error)
    if cause is None:
        return
    what, fix = cause
    freed = [sharded for sharded in shards if sharded is not None and sharded.frees_full]
    if freed:
        names = ", ".join(repr(s.name) for s in freed[:3]) + (f" and {len(freed) - 3} more" if len(freed) > 3 else "")
        raise ShardedParameterError(
            f"zcompile: graph {graph} did not compile: {what}. Dynamo would run its code eagerly instead, where its "
            f"parameters ({names}) have no full value: they are sharded ({freed[0].freed_reason}) and exist in full "
            f"only inside compiled graphs. {fix}; or train with stage 1 or 2 in fp32, where eager code may use the "
            "weights."
        ) from error
    log.warning(
        "zcompile: graph %s did not compile: %s; Dynamo runs its code eagerly instead (slower). %s.",
        graph,
        what,
        fix,
    )


def _refuse_outer_data_parallel() -> None:
    """A zero-compiled model inside DDP (accelerate's ``prepare(model)`` does it) would have its
    gradients reduced twice, or, where they live on shards, DDP waiting for gradients that never
    come to param.grad; stage 3 parameters are freed between calls and DDP's broadcasts read them."""
    wrapper = outer_data_parallel_wrapper()
    if wrapper is not None:
        raise ValueError(
            f"zcompile: the compiled model runs inside {wrapper}, which reduces the gradients that zcompile "
            "reduces itself. Do not wrap a zero-compiled model: with accelerate, prepare everything but the model "
            "(the data loaders, the optimizer, the LR scheduler); with Hugging Face Trainer use "
            "zcompile.integrations.hf.ZeroTrainer"
        )


def _refuse_regions_with_inductor(gm: torch.fx.GraphModule, config: ZeroConfig) -> None:
    """Blocks traced once (``mark_repeated_blocks``) compiled by inductor trained wrong from the
    second step at stages 2 and 3 (measured on 2 ranks: loss 5.5638 against 5.5471), while the
    eager inner compiler trains them exactly. Torch's: a plain ``torch.compile(backend="inductor")``
    of the same marked model, no zcompile, trains wrong the same way (torch 2.13, CPU). Refused."""
    if config.compiler == "inductor" and subgraph_calls(gm):
        raise ValueError(
            "zcompile: compiler='inductor' with blocks marked by zcompile.mark_repeated_blocks (or "
            "torch.compiler.nested_compile_region) is not supported: inductor trains such blocks wrong (torch 2.13; "
            "plain torch.compile(backend='inductor') of a marked model does too). "
            "Use compiler='eager' with regional compilation, or compile the model without marking its blocks"
        )


def _check_devices(plan: ShardingPlan, example_inputs: list, group: DataParallelGroup) -> None:
    devices = {str(example_inputs[p.index].device) for p in plan.params}
    if len(devices) > 1:
        where = {p.name: str(example_inputs[p.index].device) for p in plan.params}
        raise ValueError(
            f"zcompile: parameters are on different devices {sorted(devices)} ({where}); "
            "move the whole model to one device (model.to(device)) before the first forward"
        )
    if group.process_group is not None and devices:
        device = torch.device(devices.pop())
        backend = torch.distributed.get_backend(group.process_group)
        if device.type == "cpu" and backend == "nccl":
            raise ValueError(
                "zcompile: parameters are on the CPU but the process group uses NCCL; use gloo for CPU training or move the model to the GPU"
            )


def _device_type(example_inputs: list) -> str:
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            return value.device.type
    return "cpu"
