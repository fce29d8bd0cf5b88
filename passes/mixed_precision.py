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
    graph.lint()
    gm.recompile()
    log.info("autocast: graph compute runs under autocast(%s, %s)", device_type, dtype)
    return gm
