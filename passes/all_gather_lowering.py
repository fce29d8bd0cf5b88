"""An all-gather run into a buffer the graph allocates (``all_gather_into_tensor_out``), where the
backend's own form is unsafe (gloo, torch 2.11 and 2.13).

Gloo runs the functional ``all_gather_into_tensor`` (on torch 2.13 as a coalesced all-gather,
``AsyncAllgatherCoalescedWork``), and two of them in flight at once, one on each of gloo's worker
threads, corrupt the process's heap (``malloc(): unaligned tcache chunk detected``, or a general
protection fault in ``pt_gloo_runloop``); stage 3 prefetches, so two gathers are in flight. It
needs nothing of zcompile: ``benchmarks/bench_gloo_gather_crash.py`` reproduces it with plain
functional all-gathers, and finds no crash with ``all_gather_into_tensor_out`` (gloo's flat
all-gather), ``dist.all_gather_single`` or one gather in flight at a time.

The rewrite, for every all-gather of the graph::

    ag = all_gather_into_tensor(x, N, g)          buf = empty([N * d0, ...], dtype, device)
    y = wait_tensor(ag)                     ->    ag = all_gather_into_tensor_out(x, N, g, out=buf)
                                                  y = wait_tensor(ag)

the buffer allocated where the gather is issued, as the functional op allocates its output: the
same bytes, alive over the same span. It applies to the graph a compiled function runs, not to the
pipeline's graphs that reports, dumps, the rank checks and the memory walks read (those speak of
all-gathers, and an out= collective's result aliases an argument that is not its first); the front
end applies it (``zcompile.backend.aot``) when ``zcompile.common.process_group.gathers_into_buffers`` says so.

Under inductor, a second rewrite (``gather_inputs_into_out_buffers``) writes each gather's input that
the graph computes into the last row of the buffer it gathers into (a forward input, a shard, stays
where it is: inductor never reuses that memory). Inductor models ``all_gather_into_tensor_out`` as mutating
its input and ``out``, and its wait as touching ``out`` alone, so once the collective is issued it
counts the input as dead and hands its memory to the next kernel with an output of that size, while
gloo still reads it: the gather would send garbage, with no error. An activation, a bf16 cast or a
bucket's pack of ZeRO's shards is exposed whenever a kernel's output has its size. In one buffer
with the gathered result, the input lives as long as the result is read. The buffer is made by
``zcompile::pack_bucket_as_last_row``, which allocates it and writes that row: a bucket's pack
(``zcompile::pack_bucket``) becomes that op (no copy of the pack into the buffer), and any other
input is the op's one member. An ``empty`` and a copy into its last row would not do: inductor
fuses that copy into the kernel that computes the input and may allocate the ``empty`` after that
kernel (inductor 2.11 does).
"""

from __future__ import annotations

import logging
import operator

import torch

from zcompile.passes.bucket_ops import PACK_BUCKET, PACK_BUCKET_AS_LAST_ROW
from zcompile.passes.collectives import ALL_GATHER
from zcompile.passes.inline import graph_fake_mode
from zcompile.passes.metadata import FORWARD_INPUT_PREFIX

log = logging.getLogger(__name__)
aten = torch.ops.aten
ALL_GATHER_OUT = torch.ops._c10d_functional.all_gather_into_tensor_out.default


def shape_arguments(graph: torch.fx.Graph, tensor: torch.fx.Node, first_times: int = 1) -> list:
    """The shape of ``tensor``'s value as arguments of a node inserted at the current point, its first
    dimension times ``first_times``: ints where static; where symbolic (dynamic shapes: a batch
    dimension), ``sym_size`` nodes of ``tensor``, since a SymInt is no constant a graph's code can hold."""
    shape = tensor.meta["val"].shape
    if not shape:  # a 0-d tensor, gathered into [N]
        return [first_times] if first_times != 1 else []
    dims = []
    for dim, size in enumerate(shape):
        if not isinstance(size, torch.SymInt):
            dims.append(size * first_times if dim == 0 else size)
            continue
        node = graph.call_function(aten.sym_size.int, (tensor, dim))
        node.meta["val"] = size
        if dim == 0 and first_times != 1:
            node = graph.call_function(operator.mul, (node, first_times))
            node.meta["val"] = size * first_times
        dims.append(node)
    return dims


def all_gathers_into_buffers(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrites each ``all_gather_into_tensor`` of ``gm`` into an ``empty`` of its output's shape and
    an ``all_gather_into_tensor_out`` into it (module docstring); its users read the latter. Reads
    and writes ``meta["val"]``."""
    graph = gm.graph
    gathers = list(graph.find_nodes(op="call_function", target=ALL_GATHER))
    for gather in gathers:
        shard, group_size, group_name = gather.args
        gathered = gather.meta.get("val")
        if gathered is None:
            raise ValueError(f"all_gathers_into_buffers: {gather.name} has no meta['val'] (its output's shape)")
        with graph.inserting_before(gather):
            buffer = graph.call_function(
                aten.empty.memory_format,
                (shape_arguments(graph, shard, group_size),),
                {"dtype": gathered.dtype, "device": gathered.device},
            )
            into = graph.call_function(ALL_GATHER_OUT, (shard, group_size, group_name), {"out": buffer})
        buffer.meta["val"] = into.meta["val"] = gathered
        into.meta.update({k: v for k, v in gather.meta.items() if k != "val"})
        gather.replace_all_uses_with(into)
        graph.erase_node(gather)
    if gathers:
        log.debug("all_gathers_into_buffers: %d all-gathers run into graph-allocated buffers", len(gathers))
        graph.lint()
        gm.recompile()
    return gm


def gather_inputs_into_out_buffers(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrites each ``all_gather_into_tensor_out(x, N, g, out=empty(shape))`` of ``gm`` into one
    buffer ``[N + 1, *x.shape]`` that ``pack_bucket_as_last_row`` makes with ``x`` in its last row,
    gathered from there into the first ``N`` (module docstring: inductor would reuse ``x``'s memory
    while the gather reads it). The gather's result, a view of those rows, keeps the whole buffer
    alive. Where ``x`` is a bucket's pack read by this gather alone, the pack itself becomes the op
    (no copy); any other ``x`` is the op's one member (one copy of it). Reads and writes ``meta["val"]``."""
    graph = gm.graph
    fake_mode = graph_fake_mode(gm)
    gathers = list(graph.find_nodes(op="call_function", target=ALL_GATHER_OUT))
    for gather in gathers:
        source, group_size, group_name = gather.args
        if source.op == "placeholder" and source.name.startswith(FORWARD_INPUT_PREFIX):
            continue  # a shard the forward takes as input: memory inductor never reuses (not a donated buffer)
        out = gather.kwargs["out"]
        if out.target is not aten.empty.memory_format or len(out.users) != 1:
            raise ValueError(
                f"gather_inputs_into_out_buffers: {gather.name} does not gather into a buffer of its own "
                f"(run all_gathers_into_buffers first)"
            )
        gathered, shard = out.meta["val"], source.meta["val"]
        # the op makes the buffer (an extern allocation inductor cannot misplace: module docstring), a
        # bucket's pack where the schedule placed the pack, any other input as a bucket of one at the gather
        packed = _packed_for_this_gather_alone(source, gather)
        with graph.inserting_before(source if packed else gather):
            rows = [group_size + 1, *shape_arguments(graph, source)]
            members, pack_rows = source.args if packed else ([source], 1)
            flat = graph.call_function(PACK_BUCKET_AS_LAST_ROW, (members, pack_rows, group_size + 1))
            buffer = graph.call_function(aten.view.default, (flat, rows))
            read = graph.call_function(aten.select.int, (buffer, 0, group_size))
            head = graph.call_function(aten.slice.Tensor, (buffer, 0, 0, group_size))
            gathered_slot = graph.call_function(aten.view.default, (head, shape_arguments(graph, source, group_size)))
        with fake_mode:
            buffer.meta["val"] = torch.empty(
                [group_size + 1, *shard.shape], dtype=gathered.dtype, device=gathered.device
            )
            flat.meta["val"] = buffer.meta["val"].view(-1)
            read.meta["val"] = buffer.meta["val"][group_size]
            head.meta["val"] = buffer.meta["val"][:group_size]
            gathered_slot.meta["val"] = head.meta["val"].view(gathered.shape)
        gather.args = (read, group_size, group_name)
        gather.kwargs = {"out": gathered_slot}
        graph.erase_node(out)
        if packed:
            graph.erase_node(source)
    if gathers:
        log.debug("gather_inputs_into_out_buffers: %d all-gathers read their input from their own buffer", len(gathers))
        graph.lint()
        gm.recompile()
    return gm


def _packed_for_this_gather_alone(source: torch.fx.Node, gather: torch.fx.Node) -> bool:
    """Whether ``source`` is a bucket's pack that only ``gather`` reads, of a static size (the buffer's
    sizes are then no ``sym_size`` nodes of the pack, which is erased): then the pack is made as the
    last row of the gather's buffer (``pack_bucket_as_last_row``)."""
    return (
        source.target is PACK_BUCKET and list(source.users) == [gather] and isinstance(source.meta["val"].numel(), int)
    )
