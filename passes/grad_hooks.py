"""Gradient hooks of parameters whose gradient the compiled graphs take away from them.

``param.register_hook(fn)`` runs ``fn`` on the parameter's local gradient when autograd
accumulates it into the parameter (DDP: before its all-reduce), and the gradient becomes what
``fn`` returns: masking rows of an embedding that must not train, clamping gradients, logging them
(``wandb.watch``). At stages 2 and 3, and at stage 1 with a low-precision replica, the graphs
reduce-scatter the gradient onto a shard (or hand it to the replica), so it never reaches the
parameter and autograd never runs its hooks: the mask masked nothing, with no error.

``route_grad_hooks_pass`` (Dynamo graph, after ``insert_param_collectives``) puts, for each such
parameter that has hooks, an identity between its full value (the gather, the replicated use, the
replica) and its users, whose backward calls ``zcompile::param_grad_hooks`` on the local gradient
before it is reduced: the hooks see and change what DDP's see. The op is opaque to AOTAutograd and
inductor (the hooks are Python, run when the backward runs, never while tracing). It finds the
hooks on the parameter of the call, not of the compile (one graph serves every block instance of a
class, each with its own parameters), through a token: a one-element tensor per parameter that
knows it (``new_hooks_token``), a graph input appended per hooked parameter, which the backend
passes at each call. Not the shard itself: AOTAutograd hands the backward a new tensor object for an
input that aliases another (stage 2's shard is a view of the replicated parameter's storage).
"""

from __future__ import annotations

import logging
import weakref

import torch

from zcompile.passes import metadata
from zcompile.passes.graph_ops import gather_param, replicated_param
from zcompile.passes.param_collectives import ParamInput, ShardingPlan, gradient_leaves_parameter, tensor_hooks

log = logging.getLogger(__name__)

# on a hooks token: a weak reference to the parameter whose hooks it stands for
OWNER_ATTR = "_zcompile_hooks_owner"


def new_hooks_token(param: torch.nn.Parameter) -> torch.Tensor:
    """A tensor of its own (never aliased, so AOTAutograd keeps the object) that leads back to
    ``param``, whose hooks ``param_grad_hooks`` runs."""
    token = torch.zeros(1, device=param.device)
    setattr(token, OWNER_ATTR, weakref.ref(param))
    return token


@torch.library.custom_op("zcompile::param_grad_hooks", mutates_args=())
def param_grad_hooks(grad: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """``grad`` (a parameter's local gradient) through the hooks of the parameter ``token`` leads to,
    checked as autograd checks a hook's result."""
    owner = getattr(token, OWNER_ATTR, None)
    param = owner() if owner is not None else None
    hooks = tensor_hooks(param) if param is not None else []
    if not hooks:
        return grad.clone()  # an op's output never aliases its input
    # in the parameter's dtype, as autograd gives it (with param_dtype the graphs' gradient is narrower)
    result = grad.to(param.dtype)
    for hook in hooks:
        returned = hook(result)
        if returned is None:
            continue
        if not isinstance(returned, torch.Tensor) or returned.shape != result.shape or returned.dtype != result.dtype:
            got = (
                f"{returned.dtype} {tuple(returned.shape)}"
                if isinstance(returned, torch.Tensor)
                else type(returned).__name__
            )
            raise RuntimeError(
                f"zcompile: gradient hook {getattr(hook, '__name__', hook)!r} returned {got} for a gradient of "
                f"{result.dtype} {tuple(result.shape)}; a hook must return a tensor of the gradient's shape and "
                "dtype, or None"
            )
        result = returned
    return result.to(grad.dtype) if result is not grad else result.clone()


@param_grad_hooks.register_fake
def _(grad: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(grad)


class _ThroughGradHooks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, full, token):
        ctx.save_for_backward(token)
        return full.view_as(full)

    @staticmethod
    def backward(ctx, grad):
        (token,) = ctx.saved_tensors
        return torch.ops.zcompile.param_grad_hooks(grad, token), None


def through_grad_hooks(full: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """``full`` unchanged; its gradient goes through the hooks of the parameter ``token`` leads to."""
    return _ThroughGradHooks.apply(full, token)


def hooked_params(plan: ShardingPlan) -> list[ParamInput]:
    """The parameters whose graph takes a hooks token, in the order of the tokens it takes (after
    every other input): those with gradient hooks whose gradient the graph takes away from them."""
    return [p for p in plan.params if p.grad_hooks and gradient_leaves_parameter(plan, p)]


def route_grad_hooks_pass(gm: torch.fx.GraphModule, plan: ShardingPlan) -> torch.fx.GraphModule:
    """Appends a token input per parameter of ``hooked_params`` and inserts ``through_grad_hooks``
    after its full value (module docstring). The identity takes the tags of the node it follows (a
    stage-3 gather's ``MUST_RECOMPUTE``: the partitioner re-gathers the weight rather than saving
    the identity's view of it; keep_gathered sees it in the gather's chain)."""
    hooked = hooked_params(plan)
    if not hooked:
        return gm
    graph = gm.graph
    placeholders = graph.find_nodes(op="placeholder")
    full_values = _full_values(graph, {p.name for p in hooked})
    last_placeholder = placeholders[-1]
    tokens = []
    for param in hooked:
        with graph.inserting_after(last_placeholder):
            last_placeholder = graph.placeholder(f"{placeholders[param.index].name}_hooks_token")
        last_placeholder._dynamo_source = None  # a new input: AOTAutograd must not look for a Dynamo source
        tokens.append(last_placeholder)
    for param, token in zip(hooked, tokens):
        # stage 1 (a replica): the placeholder takes the replica, the value whose gradient the hooks see
        full = placeholders[param.index] if plan.stage == 1 else full_values.get(param.name)
        if full is None or not full.users:
            continue  # the graph does not use it
        users = list(full.users)
        with graph.inserting_after(full if full.op != "placeholder" else last_placeholder):
            through = graph.call_function(through_grad_hooks, (full, token))
        if metadata.RECOMPUTE in full.meta:
            through.meta[metadata.RECOMPUTE] = full.meta[metadata.RECOMPUTE]
        metadata.tag(through, **(metadata.tags(full) or {metadata.PARAM: param.name}))
        for user in users:
            user.replace_input_with(full, through)
    graph.lint()
    gm.recompile()
    log.info(
        "route_grad_hooks: the gradient hooks of %d parameters run on their local gradients (%s)",
        len(hooked),
        ", ".join(p.name for p in hooked),
    )
    return gm


def _full_values(graph: torch.fx.Graph, names: set[str]) -> dict[str, torch.fx.Node]:
    """By parameter name: the node ``insert_param_collectives`` made for its full value."""
    found = {}
    for target in (gather_param, replicated_param):
        for node in graph.find_nodes(op="call_function", target=target):
            name = metadata.tags(node).get(metadata.PARAM)
            if name in names:
                found[name] = node
    return found
