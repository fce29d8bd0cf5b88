"""AOTAutograd around the pipeline's joint and post-partition passes, then the inner compiler (eager or inductor)."""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Callable

import torch
from functorch.compile import min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from zcompile.agreement.abort_note import raise_if_aborted
from zcompile.agreement.fixes import STEP_FIX
from zcompile.agreement.heartbeat import heartbeat
from zcompile.agreement.rank_check import (
    check_same_on_all_ranks,
    models_own_note,
    sequence_difference,
    sequence_signature,
)
from zcompile.backend.call_prefetch import CallChain, prefetching_call
from zcompile.backend.compile_gc import full_collections_deferred
from zcompile.backend.compiled import CompiledGraphs
from zcompile.backend.pipeline import JOINT, PIPELINE, run_passes
from zcompile.backend.regional import schema_once_per_subgraph
from zcompile.common.comm_volume import graph_collectives
from zcompile.common.dumps import collectives_file
from zcompile.common.process_group import gathers_into_buffers
from zcompile.config import activation_budget_bytes
from zcompile.passes.all_gather_lowering import all_gathers_into_buffers, gather_inputs_into_out_buffers
from zcompile.passes.call_prologue import (
    CallSplit,
    dynamo_index,
    issued_example,
    shard_placeholder_names,
    split_first_gather,
)
from zcompile.passes.liveness import saved_activation_bytes
from zcompile.passes.random_draws import recomputed_random_draws
from zcompile.passes.reduce_scatter_lowering import exchanged_rows_released
from zcompile.passes.regions import subgraph_calls

log = logging.getLogger(__name__)


def codegen_on_demand(graph_module: torch.fx.GraphModule, graph: torch.fx.Graph | None = None) -> torch.fx.GraphModule:
    """``graph_module`` (the same graph and attributes) as a module that writes its Python code when
    it is first called or its code is read, not at every ``recompile()``.

    Each pass ends with ``gm.recompile()`` so that a pass is a ``gm -> gm`` function whose result
    runs; FX then generates and ``exec``s the whole graph's code at every pass, a cost that grows with
    the graph. The pipeline's graphs are never run (they are read: reports, dumps, the walks;
    ``boxed_graph_function`` runs a copy), so that code would be thrown away. torch's
    ``_LazyGraphModule`` (private; what inductor's passes and AOTAutograd's forward graphs use)
    defers it; only this module reads it. Reading ``.code`` or
    calling the module still generates the current code, so nothing sees a stale graph.

    With ``graph``: a new module of ``graph_module``'s attributes running ``graph``, as
    ``torch.fx.GraphModule(graph_module, graph)`` makes, with its code deferred the same way."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    if graph is not None:
        return _LazyGraphModule(graph_module, graph)
    lazy = _LazyGraphModule.from_graphmodule(graph_module)
    if lazy is not graph_module:
        lazy.meta.update(graph_module.meta)  # FX does not carry meta over (dynamo_compile_id, ...)
    return lazy


def _code_written(graph_module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``graph_module`` with its code generated now if ``codegen_on_demand`` deferred it."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    _LazyGraphModule.force_recompile(graph_module)
    return graph_module


def _post_partition(
    graph_module: torch.fx.GraphModule, kind: str, graphs: CompiledGraphs
) -> tuple[torch.fx.GraphModule, Callable[[], None] | None]:
    """The pipeline's passes for a partitioned graph, its collectives dumped, and the rank check of
    its issue order: run here for a forward, returned for a backward to run at its first call.

    Why not a backward's at its compile: AOTAutograd compiles a backward with the forward when the
    forward saves a symbolic size for it, and lazily, at its first call, otherwise; and which sizes
    are symbolic can differ between ranks (Dynamo's automatic dynamic shapes: each rank's slice of a
    global batch starts at another storage offset, ``x[rank * b:(rank + 1) * b]``). Checked at
    compile, one rank's backward check could meet another rank's next check of a forward (a GAN's
    discriminator, two graphs): a false ``RankDivergenceError``. Every rank calls the backward at
    the same point of the step, whenever it was compiled."""
    context = graphs.context
    if kind == "backward" and graphs.forward is not None:
        _refuse_recomputed_random_draws(graphs.forward, graph_module, context.config.activation_memory_budget)
    graph_module = run_passes(context, kind, codegen_on_demand(graph_module))
    setattr(graphs, kind, graph_module)
    context.runner.dump.write_json(collectives_file(kind), [c.to_json() for c in graph_collectives(graph_module, kind)])
    check = _issue_order_check(graph_module, kind, graphs)
    if check is not None and kind != "backward":
        check()
        check = None
    return graph_module, check


def _refuse_recomputed_random_draws(
    forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, budget: float | str | None
) -> None:
    """Raises where the partition left the backward drawing again random numbers the forward drew
    (``passes/random_draws.py`` tags them to be saved; this holds whatever the partitioner did):
    the same on every rank, which compile the same graph."""
    redrawn = recomputed_random_draws(forward, backward)
    if redrawn:
        raise RuntimeError(
            f"zcompile: the backward would draw new random numbers for {', '.join(redrawn)}, which the forward "
            f"drew (a dropout recomputed with a fresh mask), so the gradients through them would be wrong. "
            f"torch's partitioner placed them there (activation_memory_budget={budget!r}, or torch's own config). "
            "Leave the budget unset, put the random ops under torch.utils.checkpoint, or turn the dropout off"
        )


def _issue_order_check(
    graph_module: torch.fx.GraphModule, kind: str, graphs: CompiledGraphs
) -> Callable[[], None] | None:
    """The check that every rank issues ``graph_module``'s collectives in the same order (the schedule
    decided it: every rank must have decided the same); None when it has none (nothing to deadlock
    on: a graph one rank compiles alone, an evaluation, is fine) or checks are off."""
    context = graphs.context
    signature = sequence_signature(graph_module) if context.config.check_ranks else []
    if not signature:
        return None
    what = f"the {kind} graph of Dynamo graph {context.graph_id}{models_own_note(signature)}"
    # a backward's runs at its first call (_post_partition): a rank that does not come skipped that call
    at_call_fix = STEP_FIX if kind == "backward" else None
    return lambda: check_same_on_all_ranks(
        signature, context.group, context.config.check_timeout_s, what, sequence_difference, at_call_fix=at_call_fix
    )


def _joint_rows(graphs: CompiledGraphs) -> list:
    return [row for row in PIPELINE if set(row.graphs) & set(JOINT) and row.enabled(graphs.context)]


class _JointPasses(CustomGraphPass):
    """The pipeline's joint-graph passes as inductor's joint-graph hook (``joint_custom_pre_pass``)."""

    def __init__(self, graphs: CompiledGraphs):
        self.graphs = graphs

    def __call__(self, graph: torch.fx.Graph) -> None:
        run_passes(self.graphs.context, "joint", graph.owning_module)

    def uuid(self):
        # what the joint passes do depends on the pipeline's code and their options: both in the cache key
        options = [(row.name, row.options(self.graphs.context, "joint")) for row in _joint_rows(self.graphs)]
        return get_hash_for_files((run_passes.__code__.co_filename,), repr(options))


def boxed_graph_function(
    graph_module: torch.fx.GraphModule,
    rewrite: Callable[[torch.fx.GraphModule], torch.fx.GraphModule] | None = None,
) -> Callable[[list], object]:
    """``graph_module`` run in AOTAutograd's boxed calling convention, freeing each input after its last
    reader: the generated code takes the argument list, unpacks it into locals and clears it, and FX's
    code sets each local to None after its last reader. ``make_boxed_func(graph_module.forward)``
    instead keeps the list, so every saved activation and tangent a backward receives would live until
    the backward returned (AOTAutograd hands its list over and clears its own references to them).

    The graph runs from a copy with boxed code: ``graph_module`` itself, which reports, dumps and
    ``on_compile`` read, keeps its ordinary ``forward(self, *inputs)``; ``rewrite`` (how this backend
    runs the graph: ``executed_form``) applies to the copy only."""
    # torch.fx.graph._BoxedCodeGen is private: the codegen torch's own aot_eager (boxed_nop) and
    # regional_inductor use for exactly this (read in torch 2.13); inductor's generated code clears its
    # argument list the same way. Only here does zcompile read it.
    from torch.fx.graph import _BoxedCodeGen

    graph = copy.deepcopy(graph_module.graph)  # nodes copied, their meta shallow: cheap
    graph.set_codegen(_BoxedCodeGen())
    # shares graph_module's attributes (block subgraphs); its code written once, after the rewrite
    runnable = codegen_on_demand(graph_module, graph)
    if rewrite is not None:
        runnable = rewrite(runnable)
    forward = _code_written(runnable).forward  # the generated forward itself: no lazy hop per call

    def run(args: list):
        return forward(args)

    run._boxed_call = True  # AOTAutograd passes its own list (steal_args), which the graph clears
    return run


def executed_form(graphs: CompiledGraphs) -> Callable[[torch.fx.GraphModule], torch.fx.GraphModule] | None:
    """What changes between a graph the pipeline made (which reports, dumps and the memory walks read)
    and the graph that runs, or None where nothing does: gloo's all-gathers into graph-allocated
    buffers (``passes/all_gather_lowering.py``); under the eager compiler, the buffers of the
    reduce-scatters run as all-to-all freed where the graph stops reading them
    (``passes/reduce_scatter_lowering.py``: as the memory walk counts them, whatever gloo's worker does)."""
    context = graphs.context
    rewrites = [all_gathers_into_buffers] if gathers_into_buffers(context.group) else []
    if context.reduce_scatter_by_all_to_all and context.config.compiler == "eager":
        rewrites.append(exchanged_rows_released)
    if not rewrites:
        return None

    def rewrite(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        for each in rewrites:
            gm = each(gm)
        return gm

    return rewrite


def _runnable(graph_module: torch.fx.GraphModule, kind: str, graphs: CompiledGraphs) -> Callable[[list], object]:
    """The boxed function that runs ``graph_module`` (``boxed_graph_function``), through a
    ``CallChain`` where the graph's first all-gather can be issued by the call before
    (``cross_call_split``)."""
    rewrite = executed_form(graphs)
    split = cross_call_split(graph_module, kind, graphs)
    if split is None:
        return boxed_graph_function(graph_module, rewrite)
    return prefetching_call(boxed_graph_function(split.body), _call_chain(graph_module, kind, graphs, split))


def _call_chain(graph_module: torch.fx.GraphModule, kind: str, graphs: CompiledGraphs, split: CallSplit) -> CallChain:
    """The ``CallChain`` that runs ``split`` of ``graph_module`` (this compile's ``kind`` graph),
    recorded where the backend's wrapper and the reports find it."""
    chain = CallChain(kind, split, graphs.run_phase)
    if kind == "forward":  # its placeholders are the Dynamo graph's inputs, in order
        names = shard_placeholder_names(p.index for p in graphs.context.sharding.params)
        chain.shard_positions = {
            dynamo_index(node.name): at
            for at, node in enumerate(graph_module.graph.find_nodes(op="placeholder"))
            if node.name in names
        }
    graphs.call_chains[kind] = chain
    return chain


def cross_call_split(graph_module: torch.fx.GraphModule, kind: str, graphs: CompiledGraphs) -> CallSplit | None:
    """``graph_module`` as it runs (``executed_form``) split at its first all-gather for cross-call
    prefetch (``zcompile.backend.call_prefetch``), or None where that does not apply: not a stage-3 training
    graph on more than one rank, turned off (``prefetch_calls=False``, or the overlap schedule or
    prefetch: ``overlap=False``, ``prefetch=0``), a first collective that is not a gather of shards alone, or a
    ``memory_budget_mb`` that the schedule's gathered peak plus the prefetched gather would exceed."""
    context = graphs.context
    config = context.config
    if (
        kind not in ("forward", "backward")
        or context.sharding.stage != 3
        or context.group.world_size == 1
        or not (config.prefetch_calls and config.overlap and config.prefetch >= 1)
    ):
        return None
    rewrite = executed_form(graphs)
    executed = (
        graph_module if rewrite is None else rewrite(codegen_on_demand(graph_module, copy.deepcopy(graph_module.graph)))
    )
    split = split_first_gather(executed, shard_placeholder_names(p.index for p in context.sharding.params))
    if split is None or config.memory_budget_mb is None:
        return split
    peak = getattr(context.plans.get(f"schedule.{kind}"), "peak_gathered_bytes", None)
    if peak is None or peak + split.gathered_bytes > config.memory_budget_mb * 2**20:
        log.info(
            "zcompile: the %s graph's first gather is not prefetched by the call before: with it, the "
            "gathered peak would pass memory_budget_mb",
            kind,
        )
        return None
    return split


def _inductor_form(executed: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``executed`` (the graph as it runs: ``executed_form``) as inductor must get it: each all-gather
    into a buffer reads an input the graph computes from a row of that buffer, which inductor would
    otherwise hand to another kernel while the gather still reads it (``passes/all_gather_lowering.py``)."""
    return gather_inputs_into_out_buffers(executed)


def _inductor_prefetching_call(
    graph_module: torch.fx.GraphModule, inputs: list, kind: str, graphs: CompiledGraphs, kwargs: dict
):
    """Cross-call prefetch under inductor: the body of ``cross_call_split`` compiled by inductor (the
    issued gather its last input) and run through a ``CallChain``, its prologue run as an fx graph
    (a pack and a collective: nothing for inductor to fuse). None where the split does not apply, or
    where inductor's output has no callable to wrap (``current_callable``, torch-internal, read here
    only as in ``_inductor_quoting_abort_notes``), or that inductor cannot compile (a warning): the graph
    is then compiled whole."""
    from torch._inductor.compile_fx import compile_fx_inner

    split = cross_call_split(graph_module, kind, graphs)
    if split is None:
        return None
    try:
        compiled = compile_fx_inner(_inductor_form(split.body), [*inputs, issued_example(split)], **kwargs)
    except Exception as error:  # the same on every rank (a compile is): each compiles the graph whole
        log.warning(
            "zcompile: inductor could not compile the %s graph split for cross-call prefetch (%s: %s); "
            "compiled whole, each call gathering its own first bucket",
            kind,
            type(error).__name__,
            error,
        )
        return None
    run = getattr(compiled, "current_callable", None)
    if not callable(run):
        log.info(
            "zcompile: inductor's %s graph has no callable to run through cross-call prefetch; compiled whole", kind
        )
        return None
    compiled.current_callable = prefetching_call(run, _call_chain(graph_module, kind, graphs, split))
    return compiled


def _quoting_abort_notes(
    run: Callable[[list], object], graphs: CompiledGraphs, first_call_check: Callable[[], None] | None = None
) -> Callable[[list], object]:
    """A compiled backward whose failed collective says why the other rank left, when it did so
    on purpose (its abort note, ``abort_note.raise_if_aborted``), rather than gloo's "connection
    closed by peer": autograd runs the backward, outside the forward's wrapper that does the same.
    ``first_call_check`` (the rank check of its issue order, ``_post_partition``) runs before its
    first call's collectives. Boxed like ``run``: it hands the argument list on and keeps no input of
    its own, so the graph frees each after its last reader."""
    group = graphs.context.group
    beat = heartbeat()  # a rank stuck in the backward's collectives is not busy with work of its own
    what = "a compiled backward"
    pending = [first_call_check] if first_call_check is not None else []

    def backward(args: list):
        graphs.note_backward_call()
        if pending:  # the first call; a check that raised runs again at the next one
            pending[0]()
            pending.clear()
        try:
            if beat is None:
                return run(args)
            with beat.blocked(what):
                return run(args)
        except Exception as error:
            raise_if_aborted(group, error)
            raise

    backward._boxed_call = True
    return backward


def _inductor_quoting_abort_notes(
    output_code, graphs: CompiledGraphs, first_call_check: Callable[[], None] | None = None
):
    """inductor's compiled backward made to quote abort notes and run ``first_call_check`` at its
    first call, as the eager one does: the callable its ``CompiledFxGraph`` runs
    (``current_callable``, torch-internal, read here only) wrapped. Where torch has none (another
    output type), it stays as it is and the check runs now: the backward then fails with gloo's
    "connection closed" alone, and the rank that left still says why."""
    run = getattr(output_code, "current_callable", None)
    if callable(run):
        output_code.current_callable = _quoting_abort_notes(run, graphs, first_call_check)
    elif first_call_check is not None:
        first_call_check()
    return output_code


def compile_with_aot(gm: torch.fx.GraphModule, example_inputs: list, graphs: CompiledGraphs) -> Callable:
    """Runs AOTAutograd on the rewritten Dynamo graph and compiles forward and backward.

    The min-cut partitioner is used with both inner compilers because it honours the
    ``MUST_RECOMPUTE`` tags of stage-3 gathers (the backward re-gathers instead of saving);
    the joint-graph passes (keep-gathered) lift some of those tags just before it partitions.
    """
    if graphs.context.config.compiler == "eager":

        def partition(joint, joint_inputs, **kwargs):
            joint = codegen_on_demand(joint)  # the partitioner reads its graph; nothing runs its code
            run_passes(graphs.context, "joint", joint)
            budget = activation_budget_fraction(
                graphs.context.config.activation_memory_budget, joint, joint_inputs, kwargs
            )
            with activation_budget(budget, graphs.context.config.tensor_parallel):
                return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

        def make_compiler(kind: str):
            @full_collections_deferred()  # a backward compiles at its first call, outside the backend
            def compile_eager(graph_module, inputs):
                if kind != "backward":
                    graphs.mutated_inputs = mutated_input_indices()
                # boxed for every graph, as torch's aot_eager does: AOTAutograd calls the forward with
                # a list of its own (a copy of the inputs, or the runtime wrapper's list it no longer
                # reads: it keeps what the epilogue needs aside, since inductor clears it too)
                graph_module, check = _post_partition(graph_module, kind, graphs)
                run = _runnable(graph_module, kind, graphs)
                return _quoting_abort_notes(run, graphs, check) if kind == "backward" else run

            return compile_eager

        backend = aot_autograd(
            fw_compiler=make_compiler("forward"),
            bw_compiler=make_compiler("backward"),
            inference_compiler=make_compiler("inference"),
            partition_fn=partition,
            keep_inference_input_mutations=True,
        )
        # block subgraphs (mark_repeated_blocks): torch re-traces a block per call without it
        with schema_once_per_subgraph() if subgraph_calls(gm) else contextlib.nullcontext():
            return backend(gm, example_inputs)

    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    @full_collections_deferred()  # a backward compiles at its first call, outside the backend
    def inner_compile(graph_module, inputs, **kwargs):
        kind = "backward" if kwargs.get("is_backward") else "inference" if kwargs.get("is_inference") else "forward"
        if kind != "backward":
            graphs.mutated_inputs = mutated_input_indices()
        graph_module, check = _post_partition(graph_module, kind, graphs)
        compiled = _inductor_prefetching_call(graph_module, inputs, kind, graphs, kwargs)
        if compiled is None:
            rewrite = executed_form(graphs)
            if rewrite is not None:  # on a copy: graph_module stays what reports and walks read
                graph_module = _inductor_form(
                    rewrite(codegen_on_demand(graph_module, copy.deepcopy(graph_module.graph)))
                )
            compiled = compile_fx_inner(graph_module, inputs, **kwargs)
        return _inductor_quoting_abort_notes(compiled, graphs, check) if kind == "backward" else compiled

    patches = {"joint_custom_pre_pass": _JointPasses(graphs)} if _joint_rows(graphs) else None
    budget = graphs.context.config.activation_memory_budget
    with activation_budget(budget, graphs.context.config.tensor_parallel), without_autograd_cache():
        return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)


def without_autograd_cache():
    """AOTAutograd's cache off for the compile inside: a hit there hands back the compiled forward and
    backward without calling ``inner_compile``, so none of what zcompile does there happened (its
    passes, the graphs reports read, the issue-order check, the inputs a graph mutates, the
    backward's abort notes). A graph zcompile leaves without an op of its own (stage 1 in the
    parameters' dtype) would be cacheable, and a run served from the cache would leave BatchNorm's
    running statistics unsynchronised across the ranks, silently. Inductor's
    own cache of each graph, keyed on the graph after zcompile's passes, still serves the inner
    compiles. ``torch._functorch.config`` is torch-internal, read here only."""
    return torch._functorch.config.patch(enable_autograd_cache=False)


def mutated_input_indices() -> tuple[int, ...]:
    """The inputs whose data the graph AOTAutograd is compiling changes in place (BatchNorm's running
    statistics): its ``ViewAndMutationMeta`` for the trace in progress, torch-internal, read here only.
    AOTAutograd's inputs are the Dynamo graph's in order (the shards stage 2 appends come last)."""
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    if meta is None:
        return ()
    return tuple(index for index, info in enumerate(meta.input_info) if info.mutates_data)


# torch's partitioner at a budget of exactly 0 saves the graph's inputs alone and skips every
# MUST_SAVE tag (random draws', hpZ's secondary slices); the least positive budget recomputes all
# else as 0 does and honours them
_LEAST_BUDGET = 1e-9


def activation_budget(fraction: float | None, tensor_parallel: bool = False):
    """AOTAutograd's memory-budget partitioner for the partitions made inside (its config, read by
    ``min_cut_rematerialization_partition``: 1 saves what the default min-cut saves, 0 recomputes
    everything but what is tagged ``MUST_SAVE``); ``None`` changes nothing.

    ``tensor_parallel``: the graphs of a tensor-parallel model take DTensor's ``DeviceMesh`` as an
    opaque object input, whose size the budget partitioner refuses to guess (a RuntimeError naming a
    ``FakeScriptObject``); a mesh holds no tensor, so it is sized zero there."""
    if fraction is None:
        return contextlib.nullcontext()
    patches = {"activation_memory_budget": float(fraction) or _LEAST_BUDGET}
    if tensor_parallel and hasattr(torch._functorch.config, "unsafe_treat_script_objects_as_zero_size"):
        patches["unsafe_treat_script_objects_as_zero_size"] = True
    return torch._functorch.config.patch(**patches)


def activation_budget_fraction(
    budget: float | str | None, joint: torch.fx.GraphModule, joint_inputs, kwargs: dict
) -> float | None:
    """The option as a fraction: a MiB budget is divided by what a trial partition (of a copy, with
    the default budget) saves, capped at 1."""
    if not isinstance(budget, str):
        return budget
    with warnings.catch_warnings():  # deepcopy of the graph's pytree specs warns of a torch-internal deprecation
        warnings.simplefilter("ignore", FutureWarning)
        # the graph copied (its nodes' meta shallow: the fake values are shared), the module's
        # attributes shared: a deepcopy of the module also copied its tensor constants (a
        # transformers model's: "set the storage of a tensor on device meta")
        trial = torch.fx.GraphModule(joint, copy.deepcopy(joint.graph))
    forward, backward = min_cut_rematerialization_partition(trial, joint_inputs, **kwargs)
    saved = saved_activation_bytes(forward, backward)
    fraction = 1.0 if saved == 0 else min(1.0, activation_budget_bytes(budget) / saved)
    log.info(
        "zcompile: activation_memory_budget %s of %.2f MiB saved by default: fraction %.3f",
        budget,
        saved / 2**20,
        fraction,
    )
    return fraction
