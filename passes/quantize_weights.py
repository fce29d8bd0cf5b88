"""ZeRO++ qwZ: the forward parameter all-gathers move int8 blocks instead of full-precision values.

Each rank quantizes its shard block-wise (symmetric int8, one fp32 scale per block: the
``zcompile::quantize_blockwise`` kernel), packs the scales' bytes behind the int8 values so one
all-gather moves both, and every rank dequantizes the gathered rows back to the parameter dtype.
For bf16/fp16 parameters that halves the bytes of the forward gathers (a quarter for fp32), at
an error of at most half a quantization step (absmax / 254 of its block) per weight.

The backward re-gathers are left in full precision (as ZeRO++ does; with hpZ they stay inside the
node anyway), so the gradients are taken against the weights the optimizer holds.

Sizes need no care from the caller: a shard smaller than ``block`` is one block of the next power
of two; a larger one is zero-padded inside the kernel to whole blocks and the padding is cut off
after dequantization.
"""

from __future__ import annotations

import logging

import torch

import zcompile.kernels.quantize  # noqa: F401  (registers the zcompile:: quantization ops)
from zcompile.passes import metadata
from zcompile.passes.collectives import ALL_GATHER, WAIT, CollectiveNode
from zcompile.passes.inline import graph_fake_mode, inline_call

log = logging.getLogger(__name__)

_zops = torch.ops.zcompile
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def effective_block(shard_elements: int, block: int) -> int:
    """``block``, or the next power of two of a smaller shard (one block, little padding)."""
    return max(2, min(block, 1 << max(0, shard_elements - 1).bit_length()))


def quantized_all_gather(shard: torch.Tensor, group_size: int, group_name: str, block: int) -> torch.Tensor:
    """What ``wait(all_gather(shard))`` returns ([group_size * numel], shard's dtype), sent as int8 blocks."""
    numel = shard.numel()
    q, scales = _zops.quantize_blockwise(shard, 8, block)
    q_len, n_scales = q.numel(), scales.numel()
    packed = torch.cat([q, scales.view(torch.int8)])
    rows = WAIT(ALL_GATHER(packed, group_size, group_name)).view(group_size, q_len + 4 * n_scales)
    q_rows = rows[:, :q_len].contiguous().view(-1)
    scale_rows = rows[:, q_len:].contiguous().view(torch.float32).view(-1)
    full = _zops.dequantize_blockwise(q_rows, scale_rows, group_size * q_len, 8, block, shard.dtype)
    if q_len != numel:  # cut each rank's padding off
        full = full.view(group_size, q_len)[:, :numel].reshape(-1)
    return full


def quantize_weights_pass(gm: torch.fx.GraphModule, group_name: str, block: int) -> torch.fx.GraphModule:
    """Replaces every floating-point all-gather of weights (not the model's own) over ``group_name`` by ``quantized_all_gather``.

    Run on forward graphs only (see the module docstring). Inserted nodes carry the replaced
    gather's zcompile tags (parameters, bucket) and ``quantized="int8"``.
    """
    graph = gm.graph
    fake_mode = graph_fake_mode(gm)
    gathers = [
        c
        for c in map(CollectiveNode.of, graph.find_nodes(op="call_function", target=ALL_GATHER))
        if c.is_zero and c.group_name == group_name and c.dtype in _FLOATS and c.wait is not None
    ]
    for gather in gathers:
        wait, group_size = gather.wait, gather.group_size
        chosen = effective_block(gather.input_val.numel(), block)
        with graph.inserting_before(gather.node):
            full = inline_call(
                graph,
                lambda s: quantized_all_gather(s, group_size, group_name, chosen),
                [gather.input],
                fake_mode,
                tags=dict(metadata.tags(gather.node), quantized="int8"),
            )
        wait.replace_all_uses_with(full)
        graph.erase_node(wait)
        graph.erase_node(gather.node)
    graph.lint()
    gm.recompile()
    log.info("qwZ: %d all-gathers quantized to int8", len(gathers))
    return gm
