"""What the backend refuses before it compiles, each with the fix: a model wrapped in DDP, marked
blocks with inductor, parameters on mixed devices, tensor-parallel (DTensor) parameters without a
``("dp", "tp")`` mesh or on another one, a forward that writes a weight in place, and a frame Dynamo
gave up on after the parameters were sharded."""

from __future__ import annotations

import contextlib
import logging

import torch

from zcompile.agreement.abort_note import leave_abort_note
from zcompile.common.dynamo_frame import (
    eager_fallback_cause,
    outer_data_parallel_wrapper,
    restarts_analysis,
)
from zcompile.common.process_group import DataParallelGroup
from zcompile.config import ZeroConfig
from zcompile.passes.param_collectives import ShardingPlan
from zcompile.passes.param_writes import parameter_writes
from zcompile.passes.regions import subgraph_calls
from zcompile.sharding.sharded_parameter import ShardedParameterError
from zcompile.sharding.shards import (
    mark_refusing_parameter,
)

log = logging.getLogger(__name__)


def refuse_tensor_parallel_parameters(
    plan: ShardingPlan, example_inputs: list, group: DataParallelGroup, pieces: list, mesh
) -> None:
    """Parameters that are DTensors (tensor parallelism: ``parallelize_module``, a transformers
    ``tp_plan``) are sharded as their local pieces only with option ``mesh`` ``("dp", "tp")``: without
    it a DTensor's piece taken for the whole weight would train wrong, and pieces on another mesh than
    ``mesh["tp"]`` would be reduced over the wrong ranks. Refused on every rank (an abort note for the
    ranks whose model has no such parameter), before any parameter is sharded."""
    from torch.distributed.tensor import DTensor

    names = {p.index: p.name for p in plan.params}
    if pieces:
        tp_ranks = mesh["tp"].mesh.flatten().tolist()
        stray = [names.get(s.index, f"input {s.index}") for s in pieces if s.mesh.mesh.flatten().tolist() != tp_ranks]
        if not stray:
            return
        message = (
            f"zcompile: parameters {_listed(stray)} are DTensors on another mesh than option 'mesh''s 'tp' dim "
            f"(ranks {tp_ranks}); their gradients would be reduced over the wrong ranks. Parallelize the model "
            "on mesh['tp'] of the mesh you pass to zcompile"
        )
    else:
        found = [p.name for p in plan.params if isinstance(example_inputs[p.index], DTensor)]
        if not found:
            return
        message = (
            f"zcompile: parameters {_listed(found)} are DTensors (tensor parallelism: parallelize_module or a "
            "tp_plan), but option 'mesh' is not a ('dp', 'tp') mesh, so zcompile cannot tell over which ranks to "
            "shard their pieces. Build init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')), parallelize "
            "the model on mesh['tp'] and pass options={'mesh': mesh} (docs/tensor-parallel.md); or compile the "
            "model without tensor parallelism, or train it with torch's fully_shard"
        )
    leave_abort_note(group, message)
    raise ValueError(message)


def _listed(names: list[str]) -> str:
    return ", ".join(repr(name) for name in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def refuse_parameter_writes(gm: torch.fx.GraphModule, plan: ShardingPlan) -> None:
    """A forward that writes a parameter in place would write one rank's copy of it, not the shards
    (``passes/param_writes.py``): refused on every rank (each compiles the same graph), before any
    parameter is sharded."""
    writes = parameter_writes(gm, {p.index: p.name for p in plan.params})
    if writes:
        listed = "; ".join(f"{name!r}: {what}" for name, what in writes[:4]) + (" ..." if len(writes) > 4 else "")
        raise ValueError(
            f"zcompile: the compiled forward writes parameters in place ({listed}); the graphs read a copy of each "
            "weight, whose value lives on the shards, so the write would silently not reach them. Take it out of the "
            "forward (nn.Embedding(max_norm=None)) and apply it after optimizer.step() on every rank, inside `with "
            "zcompile.gathered(model): ...` (an embedding: torch.embedding_renorm_(emb.weight, ids, max_norm, 2.0))"
        )


@contextlib.contextmanager
def failure_leaves_refusing_parameters(shards: list, graph: str):
    """Once ``shards`` are cut (stage 3's full storage freed), a failure of the rest of the compile (a
    rank check, a pass, AOTAutograd, the inner compiler) leaves them marked: eager use of one (Dynamo's
    fallback, a print of the model in an except clause) is a ``ShardedParameterError``, not torch
    reading freed memory (a parameter's repr can segfault). Not on Dynamo's request to trace again: its
    replay must see the parameters' classes as this trace did (else a SpeculationLogDivergence)."""
    try:
        yield
    except Exception as error:
        if not restarts_analysis(error):
            for sharded in shards:
                mark_refusing_parameter(sharded)
        refuse_eager_fallback(error, graph, shards)
        raise


def refuse_eager_fallback(error: BaseException, graph: str, shards: list) -> None:
    """A compile that failed where Dynamo then runs the graph's frame eagerly (its fallback, with a
    warning to report the backend): with parameters whose full storage this compile freed (stage 3, or
    a low-precision replica), eager code cannot run them: the fallback would stop at the first with
    torch's "setStorage ... out of bounds for storage of size 0" (or, where one is marked, a
    ShardedParameterError blaming a graph break), so this raises instead, naming the op and the
    setting that compiles it. Where the parameters keep their full values the fallback runs, slower (no
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


def refuse_outer_data_parallel() -> None:
    """A zero-compiled model inside DDP (accelerate's ``prepare(model)`` does it) would have its
    gradients reduced twice, or, where they live on shards, DDP waiting for gradients that never
    come to param.grad; stage 3 parameters are freed between calls and DDP's broadcasts read them."""
    wrapper = outer_data_parallel_wrapper()
    if wrapper is not None:
        raise ValueError(
            f"zcompile: the compiled model runs inside {wrapper}, which would reduce the gradients zcompile "
            "reduces itself. Do not wrap a zero-compiled model: with accelerate, prepare everything but the model "
            "(data loaders, optimizer, LR scheduler); with Hugging Face Trainer use "
            "zcompile.integrations.hf.ZeroTrainer"
        )


def refuse_regions_with_inductor(gm: torch.fx.GraphModule, config: ZeroConfig) -> None:
    """Blocks traced once (``mark_repeated_blocks``) and compiled by inductor train wrong from the
    second step at stages 2 and 3, while the eager inner compiler trains them exactly. The fault is
    torch's: a plain ``torch.compile(backend="inductor")`` of the same marked model, without zcompile,
    trains wrong the same way (torch 2.13). Refused."""
    if config.compiler == "inductor" and subgraph_calls(gm):
        raise ValueError(
            "zcompile: compiler='inductor' with blocks marked by zcompile.mark_repeated_blocks (or "
            "torch.compiler.nested_compile_region) is not supported: inductor trains such blocks wrong (torch 2.13, "
            "with or without zcompile). Use compiler='eager' with regional compilation, or compile the model "
            "without marking its blocks"
        )


def check_devices(plan: ShardingPlan, example_inputs: list, group: DataParallelGroup) -> None:
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


def device_type(example_inputs: list) -> str:
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            return value.device.type
    return "cpu"
