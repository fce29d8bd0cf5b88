"""Plan and insert the per-parameter collectives of ZeRO stages 2 and 3 into a Dynamo graph.

``plan_sharding`` finds which graph inputs are model parameters (pure data, printable);
``insert_param_collectives_pass`` rewrites the graph so that each parameter is reached through
its shard:

- stage 3: the parameter input is replaced by its flat shard and a ``gather_param`` node
  (all-gather forward, reduce-scatter backward) is inserted just before the first use. The node is
  tagged ``MUST_RECOMPUTE`` so that AOTAutograd's partitioner saves the shard, not the gathered
  weight, and backward gathers it again: memory stays at 1/N between forward and backward.
- stage 2: the replicated parameter stays an input; the shard is appended as a new input and a
  ``replicated_param`` node routes the gradient, reduce-scattered, onto the shard.
- stage 1: nothing to rewrite (full gradients, reduced by the optimizer at the step).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict, dataclass, field

import torch
from torch._C import DisableTorchFunctionSubclass
from torch.utils.checkpoint import CheckpointPolicy

from zcompile.passes import metadata
from zcompile.passes.graph_ops import gather_param, replicated_param

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParamInput:
    """A graph input that is a model parameter."""

    index: int  # position among the graph's placeholders
    name: str
    shape: tuple[int, ...]
    requires_grad: bool
    dtype: torch.dtype = torch.float32  # the parameter's own dtype, as Dynamo traced it
    grad_hooks: bool = False  # it has hooks of register_hook (passes/grad_hooks.py)


@dataclass
class ShardingPlan:
    stage: int
    world_size: int
    group_name: str | None
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    params: list[ParamInput] = field(default_factory=list)
    # the registered module buffers among the inputs (Dynamo source ``..._buffers['name']``): (index, name)
    buffers: list[tuple[int, str]] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, default=str)


def param_name_from_source(source, fallback: str) -> str:
    """``L['self']._modules['h']._modules['0']._parameters['weight']`` -> ``h.0.weight``."""
    if source is None:
        return fallback
    parts = re.findall(r"_(?:modules|parameters|buffers)\['([^']+)'\]", source.name)
    return ".".join(parts) if parts else source.name


def plan_sharding(
    gm: torch.fx.GraphModule, example_inputs, stage: int, world_size: int, group_name, param_dtype, reduce_dtype
) -> ShardingPlan:
    """Lists the parameter inputs of ``gm`` (those whose example value is an ``nn.Parameter``) and its
    registered module buffers (by Dynamo's source: an attribute tensor or a user input is not one)."""
    plan = ShardingPlan(stage, world_size, group_name, param_dtype, reduce_dtype)
    placeholders = gm.graph.find_nodes(op="placeholder")
    for index, (node, example) in enumerate(zip(placeholders, example_inputs)):
        source = getattr(node, "_dynamo_source", None)
        if isinstance(example, torch.nn.Parameter):
            name = param_name_from_source(source, node.name)
            plan.params.append(
                ParamInput(
                    index, name, tuple(example.shape), example.requires_grad, example.dtype, bool(tensor_hooks(example))
                )
            )
        elif isinstance(example, torch.Tensor) and source is not None and _BUFFER_SOURCE.search(source.name):
            plan.buffers.append((index, param_name_from_source(source, node.name)))
    return plan


_BUFFER_SOURCE = re.compile(r"\._buffers\['[^']+'\]$")


def replica_dtype(
    stage: int, param_dtype: torch.dtype | None, dtype: torch.dtype, requires_grad: bool
) -> torch.dtype | None:
    """The dtype of a stage-1/2 parameter's low-precision replica, None for no replica: only trained
    parameters (a frozen one has no master weight to keep apart) wider than ``param_dtype``."""
    if stage not in (1, 2) or param_dtype is None or not requires_grad:
        return None
    return param_dtype if param_dtype.itemsize < dtype.itemsize else None


def gradient_leaves_parameter(plan: ShardingPlan, param: ParamInput) -> bool:
    """Whether the graph routes ``param``'s gradient away from the parameter, so that autograd never
    accumulates it there (nor runs the parameter's hooks): stages 2 and 3 (onto the shard), stage 1
    with a low-precision replica (onto the replica). Stage 1 in the parameter's dtype leaves it."""
    return plan.stage != 1 or replica_dtype(1, plan.param_dtype, param.dtype, param.requires_grad) is not None


def tensor_hooks(param: torch.Tensor) -> list:
    """The hooks ``param.register_hook`` added, in registration order (read past a stage-3
    parameter's ``__torch_function__``, which refuses use of freed storage)."""
    with DisableTorchFunctionSubclass():
        hooks = param._backward_hooks
    return list(hooks.values()) if hooks else []


def insert_param_collectives_pass(gm: torch.fx.GraphModule, plan: ShardingPlan) -> torch.fx.GraphModule:
    """Routes every planned parameter through its shard (see the module docstring).

    Reads the plan only; writes ``node.meta["custom"]["zcompile"]`` (role, param) on the inserted
    nodes and ``node.meta["recompute"]`` on stage-3 gathers. Placeholder order is kept for stage 3
    (the shard takes the parameter's position); stage 2 appends the shards after all inputs, in
    plan order. Returns ``gm`` unchanged at stage 1.
    """
    if plan.stage == 1 or not plan.params:
        return gm
    graph = gm.graph
    placeholders = graph.find_nodes(op="placeholder")
    order = {node: i for i, node in enumerate(graph.nodes)}
    last_placeholder = placeholders[-1]
    for param in plan.params:
        old = placeholders[param.index]
        users = sorted(old.users, key=order.__getitem__)
        if plan.stage == 3:
            with graph.inserting_before(old):
                shard = graph.placeholder(f"{old.name}_shard")
        else:
            with graph.inserting_after(last_placeholder):
                shard = graph.placeholder(f"{old.name}_shard")
            last_placeholder = shard
        shard._dynamo_source = None  # a new input: AOTAutograd must not look for a Dynamo source
        if not users:
            continue
        with graph.inserting_before(users[0]):
            if plan.stage == 3:
                use = graph.call_function(
                    gather_param,
                    (
                        shard,
                        _numel(param.shape),
                        param.shape,
                        plan.world_size,
                        plan.group_name,
                        plan.param_dtype or param.dtype,
                        plan.reduce_dtype,
                    ),
                )
                use.meta[metadata.RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE
                metadata.tag(use, role=metadata.ROLE_GATHER, param=param.name)
            else:
                use = graph.call_function(
                    replicated_param,
                    (
                        shard,
                        old,
                        _numel(param.shape),
                        plan.world_size,
                        plan.group_name,
                        plan.param_dtype,
                        plan.reduce_dtype,
                    ),
                )
                metadata.tag(use, role=metadata.ROLE_REPLICATED, param=param.name)
        for user in users:
            user.replace_input_with(old, use)
    if plan.stage == 3:
        for param in plan.params:
            graph.erase_node(placeholders[param.index])
    graph.lint()
    gm.recompile()
    log.info("insert_param_collectives: stage %d, %d parameters routed through shards", plan.stage, len(plan.params))
    return gm


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
