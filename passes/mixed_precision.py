"""Mixed precision: run a Dynamo graph's compute under autocast to ``param_dtype``.

Parameters reach the compute in ``param_dtype`` through their collectives (stage 3 casts the shard
before the all-gather, which halves its bytes; stage 2 casts the replicated parameter). The
activations, however, keep the dtype the model was traced with: Dynamo traced the model with its
fp32 parameters, so any dtype the model's Python code read (``input_dtype = x.dtype`` in an RMSNorm,
``.float()`` then ``.to(input_dtype)``) is baked into the graph as fp32. Casting activations by hand
would break those graphs; autocast does not. It casts the inputs of the ops that need one dtype
(matmuls, convolutions, attention) to ``param_dtype`` and runs every op in the dtype
``torch.autocast`` would choose in eager for that device (on CUDA norms, softmax and losses stay
fp32; CPU autocast's policy runs softmax in ``param_dtype``). AOTAutograd traces through
the autocast region, so the forward and backward graphs carry the casts and no autocast state is
left at run time.
"""

from __future__ import annotations

import logging

import torch

from zcompile.passes import metadata

log = logging.getLogger(__name__)


def _cast_before(
    graph: torch.fx.Graph, anchor: torch.fx.Node, node: torch.fx.Node, dtype: torch.dtype
) -> torch.fx.Node:
    """``node.to(dtype)`` inserted before ``anchor``, with the traced value the next passes read (a cast
    to ``node``'s own dtype is ``node`` itself at run time: no copy)."""
    with graph.inserting_before(anchor):
        cast = graph.call_method("to", (node, dtype))
    value = node.meta.get("example_value")
    if isinstance(value, torch.Tensor):
        cast.meta["example_value"] = value.to(dtype)
    return cast


def autocast_pass(gm: torch.fx.GraphModule, dtype: torch.dtype | None, device_type: str) -> torch.fx.GraphModule:
    """Wraps every compute node of ``gm`` in ``torch.autocast(device_type, dtype)``.

    Inserts ``_enter_autocast`` after the last placeholder and ``_exit_autocast`` before the
    output, the same nodes Dynamo emits for a ``with torch.autocast(...)`` block in user code (an
    autocast block already in the graph nests inside ours and wins, as in eager). No-op when
    ``dtype`` is None.
    """
    if dtype is None:
        return gm
    graph = gm.graph
    placeholders = graph.find_nodes(op="placeholder")
    output = graph.find_nodes(op="output")[0]
    anchor = placeholders[-1] if placeholders else None
    if anchor is None:
        with graph.inserting_before(next(iter(graph.nodes))):
            enter = graph.call_function(torch.amp.autocast_mode._enter_autocast, (device_type, dtype, True, None))
    else:
        with graph.inserting_after(anchor):
            enter = graph.call_function(torch.amp.autocast_mode._enter_autocast, (device_type, dtype, True, None))
    with graph.inserting_before(output):
        leave = graph.call_function(torch.amp.autocast_mode._exit_autocast, (enter,))
    metadata.tag(enter, role=metadata.ROLE_AUTOCAST)
    metadata.tag(leave, role=metadata.ROLE_AUTOCAST)
    restored = _outputs_in_traced_dtypes(graph, output)
    graph.lint()
    gm.recompile()
    log.info(
        "autocast: graph compute runs under autocast(%s, %s); %d outputs cast back to their traced dtype",
        device_type,
        dtype,
        restored,
    )
    return gm


def _outputs_in_traced_dtypes(graph: torch.fx.Graph, output: torch.fx.Node) -> int:
    """Each floating-point output the graph computes, cast after the autocast region to the dtype
    Dynamo traced it in (its ``example_value``'s). Dynamo traces the code after the graph (a graph
    break's next frame, eager code reading ``.dtype``) with that dtype; autocast's ``param_dtype``
    output would break it: with bf16 parameters, a convolution after a graph break fails in Dynamo's
    own trace ("Input type (c10::BFloat16) and bias type (float) should be the same"), the activation
    carried across being bf16 where the frame's weights are traced fp32. A cast to the same dtype is
    the tensor itself (no copy); graph inputs returned as they are stay untouched."""
    returned = output.args[0]
    if not isinstance(returned, (tuple, list)):
        return 0
    casts: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in returned:
        value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
        if (
            node in casts
            or node.op == "placeholder"
            or not isinstance(value, torch.Tensor)
            or not value.is_floating_point()
        ):
            continue
        casts[node] = _cast_before(graph, output, node, value.dtype)
    if casts:
        output.args = (type(returned)(casts.get(node, node) for node in returned), *output.args[1:])
    return len(casts)


# torch's norms with affine parameters, and where those are: (position, keyword) of weight and bias
_NORM_PARAMS = {
    torch.nn.functional.layer_norm: ((2, "weight"), (3, "bias")),
    torch.nn.functional.group_norm: ((2, "weight"), (3, "bias")),
    torch.nn.functional.batch_norm: ((3, "weight"), (4, "bias")),
}


def norm_params_in_fp32_pass(gm: torch.fx.GraphModule, device_type: str) -> torch.fx.GraphModule:
    """Casts the weight and bias of every layer, group and batch norm of ``gm`` to fp32, on a CPU.

    With ``param_dtype`` the weights reach the graph in that dtype, and CPU autocast runs norms in
    the dtypes it is given (CUDA's casts norms to fp32 itself). torch's CPU norms take an fp32
    weight with a bf16 input, but not a bf16 weight with an fp32 input ("mixed dtype (CPU): expect
    parameter to have scalar type of Float"): a LayerNorm on an fp32 graph input (features, or the
    hidden state of a block compiled on its own, its embedding run eagerly) fails at every stage,
    and a BatchNorm fails even on a bf16 input (its fp32 running statistics). In fp32 the weights
    fit every input, as on CUDA; the cast's backward hands their gradient back in ``param_dtype``.
    A no-op elsewhere than on a CPU.
    """
    if device_type != "cpu":
        return gm
    graph = gm.graph
    cast = 0
    for node in list(graph.nodes):
        places = _NORM_PARAMS.get(node.target) if node.op == "call_function" else None
        for position, keyword in places or ():
            arg = node.args[position] if len(node.args) > position else node.kwargs.get(keyword)
            if not isinstance(arg, torch.fx.Node):
                continue
            upcast = _cast_before(graph, node, arg, torch.float32)
            if len(node.args) > position:
                node.update_arg(position, upcast)
            else:
                node.update_kwarg(keyword, upcast)
            cast += 1
    if cast:
        graph.lint()
        gm.recompile()
        log.info("norm_params_in_fp32: %d norm weights and biases cast to fp32 (CPU)", cast)
    return gm


# namespaces whose ops autocast knows (or that zcompile itself adds and types): every other op is a user's
# or a library's custom op
_AUTOCAST_KNOWN_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "c10d_functional", "zcompile"})


def _is_custom_op(target) -> bool:
    # str: "aten.mm.default" for an overload, "transformers.grouped_mm_fallback" for a packet
    return (
        isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
        and str(target).split(".", 1)[0] not in _AUTOCAST_KNOWN_NAMESPACES
    )


def _traced_dtype(node: torch.fx.Node, param_dtypes: dict[str, torch.dtype]) -> torch.dtype | None:
    """The dtype Dynamo traced ``node`` in: its ``example_value``'s, or for a parameter's gather or
    replica (inserted by zcompile, without one) the parameter's own."""
    value = node.meta.get("example_value")
    if isinstance(value, torch.Tensor):
        return value.dtype if value.is_floating_point() else None
    entry = metadata.tags(node)
    if entry.get(metadata.ROLE) in (metadata.ROLE_GATHER, metadata.ROLE_REPLICATED):
        return param_dtypes.get(entry.get(metadata.PARAM))
    return None


def custom_ops_in_traced_dtypes_pass(gm: torch.fx.GraphModule, plan) -> torch.fx.GraphModule:
    """Casts every floating-point tensor a custom op (``torch.library``, outside aten) takes to the
    dtype Dynamo traced it in (its ``example_value``'s), with ``param_dtype``.

    Autocast does not know custom ops: it casts neither their inputs nor their outputs. In eager
    ``torch.autocast`` with fp32 weights such an op gets fp32 weights and fp32 activations; here the
    weights reach the graph in ``param_dtype`` and the activations stay fp32, so an op that multiplies
    them fails (transformers' MoE ``_grouped_mm`` CPU fallback, Mixtral, Qwen2-MoE: "expected m1 and
    m2 to have the same dtype, but got: float != c10::BFloat16"). In the traced dtypes the op computes
    as eager autocast would have it; the casts' backward hands the weights' gradients back in
    ``param_dtype``. A cast to the same dtype is the tensor itself.
    """
    graph = gm.graph
    param_dtypes = {p.name: p.dtype for p in plan.params}
    cast = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not _is_custom_op(node.target):
            continue
        casts: dict[torch.fx.Node, torch.fx.Node] = {}

        def traced(arg):
            nonlocal cast
            dtype = _traced_dtype(arg, param_dtypes) if isinstance(arg, torch.fx.Node) else None
            if dtype is None:
                return arg
            if arg not in casts:
                casts[arg] = _cast_before(graph, node, arg, dtype)
                cast += 1
            return casts[arg]

        node.args = torch.fx.node.map_arg(node.args, traced)
        node.kwargs = torch.fx.node.map_arg(node.kwargs, traced)
    if cast:
        graph.lint()
        gm.recompile()
        log.info("custom_ops_in_traced_dtypes: %d custom-op inputs cast to their traced dtype", cast)
    return gm
