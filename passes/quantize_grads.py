"""ZeRO++ qgZ: each gradient reduce-scatter becomes a hierarchical, int4 all-to-all.

For N ranks as M nodes of K (``zcompile.common.topology``), rank ``r = node * K + local`` must end with
the sum over ranks of row ``r`` of the ``[N, s]`` gradient input. Instead of a reduce-scatter over
all N ranks:

1. reorder the rows as ``[K, M, s]``: chunk ``l`` holds the rows of the ranks with local rank
   ``l`` (one per node), which is what local peer ``l`` reduces and forwards;
2. quantize (int4 blocks, fp32 scales), all-to-all inside the node: each rank receives the K
   chunks addressed to it;
3. dequantize and sum them in fp32, re-quantize to int4 (one kernel: ``dequantize_reduce``);
4. all-to-all across nodes among the ranks of the same local rank: each receives the M partial
   sums of its own row;
5. dequantize and sum in fp32: this rank's shard of the gradient sum.

Only quantized blocks cross the network, and only 1/K of the gradient leaves each rank for other
nodes; reductions are always in fp32. One node (M = 1) stops after step 3; one rank per node
(K = 1) skips steps 1-3. A shard size that is not a whole number of blocks is zero-padded per row
(inside the rewrite), so any size works.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

import zcompile.kernels.quantize  # noqa: F401  (registers the zcompile:: quantization ops)
from zcompile.passes import metadata
from zcompile.passes.collectives import ALL_TO_ALL, REDUCE_SCATTER, WAIT, CollectiveNode
from zcompile.passes.inline import graph_fake_mode, inline_call
from zcompile.passes.quantize_weights import effective_block

log = logging.getLogger(__name__)

_zops = torch.ops.zcompile
BITS = 4


def _exchange(q_rows: torch.Tensor, scale_rows: torch.Tensor, group_name: str):
    """All-to-all of per-peer (q, scales) rows (row p goes to peer p); returns what each peer sent here."""
    peers = q_rows.shape[0]
    q_len = q_rows.shape[1]
    packed = torch.cat([q_rows, scale_rows.view(torch.uint8)], dim=1)
    width = packed.shape[1]
    received = WAIT(ALL_TO_ALL(packed.reshape(-1), [width] * peers, [width] * peers, group_name)).view(peers, width)
    return received[:, :q_len].contiguous(), received[:, q_len:].contiguous().view(torch.float32)


def hierarchical_reduce_scatter(
    flat: torch.Tensor, world: int, node_size: int, intra_name: str, inter_name: str, block: int
) -> torch.Tensor:
    """The sum over ranks of row ``rank`` of ``flat`` viewed ``[world, s]``, in ``flat``'s dtype."""
    shard = flat.numel() // world
    nodes = world // node_size
    padded = -(-shard // block) * block
    rows = flat.view(world, shard).float()
    if padded != shard:
        rows = F.pad(rows, (0, padded - shard))
    if node_size > 1:
        # chunk l: the rows of ranks (node, l) for every node, the part local peer l forwards
        chunks = rows.view(nodes, node_size, padded).transpose(0, 1).contiguous()
        q, scales = _zops.quantize_blockwise(chunks, BITS, block)
        q_in, scales_in = _exchange(q.view(node_size, -1), scales.view(node_size, -1), intra_name)
        if nodes == 1:
            return _zops.dequantize_reduce(q_in, scales_in, padded, BITS, block, 1.0)[:shard].to(flat.dtype)
        q, scales = _zops.dequantize_reduce_requantize(q_in, scales_in, nodes * padded, BITS, block, 1.0)
    else:
        q, scales = _zops.quantize_blockwise(rows, BITS, block)
    q_in, scales_in = _exchange(q.view(nodes, -1), scales.view(nodes, -1), inter_name)
    return _zops.dequantize_reduce(q_in, scales_in, padded, BITS, block, 1.0)[:shard].to(flat.dtype)


def quantize_grads_pass(
    gm: torch.fx.GraphModule, group_name: str, world: int, node_size: int, intra_name: str, inter_name: str, block: int
) -> torch.fx.GraphModule:
    """Replaces every floating-point sum reduce-scatter of gradients (not the model's own) over ``group_name`` by ``hierarchical_reduce_scatter``.

    The replacement sits where the reduce-scatter was issued (its all-to-alls wait at once: each
    step needs the previous one's result). Inserted nodes carry the reduce-scatter's tags.
    """
    graph = gm.graph
    fake_mode = graph_fake_mode(gm)
    reductions = [
        c
        for c in map(CollectiveNode.of, graph.find_nodes(op="call_function", target=REDUCE_SCATTER))
        if c.is_zero
        and c.reduce_op == "sum"
        and c.group_name == group_name
        and c.group_size == world
        and c.dtype.is_floating_point
        and c.wait is not None
    ]
    for reduction in reductions:
        wait = reduction.wait
        chosen = effective_block(reduction.shard_elements, block)
        with graph.inserting_before(reduction.node):
            result = inline_call(
                graph,
                lambda x: hierarchical_reduce_scatter(x, world, node_size, intra_name, inter_name, chosen),
                [reduction.input],
                fake_mode,
                tags=dict(metadata.tags(reduction.node), quantized="int4"),
            )
        wait.replace_all_uses_with(result)
        graph.erase_node(wait)
        graph.erase_node(reduction.node)
    graph.lint()
    gm.recompile()
    log.info(
        "qgZ: %d reduce-scatters -> hierarchical int4 all-to-all (%d nodes of %d)",
        len(reductions),
        world // node_size,
        node_size,
    )
    return gm
