"""An all-gather run into a buffer the graph allocates (``all_gather_into_tensor_out``), where the
backend's own form is unsafe (gloo, torch 2.11 and 2.13).

Gloo runs the functional ``all_gather_into_tensor`` (on torch 2.13 as a coalesced all-gather,
``AsyncAllgatherCoalescedWork``), and two of them in flight at once, one on each of gloo's worker
threads, corrupt the process's heap: ``malloc(): unaligned tcache chunk detected`` or a general
protection fault in ``pt_gloo_runloop``, in about 1 of 10 two-rank runs of ``tests/test_schedule.py``'s
specs (stage 3 prefetches, so two gathers are in flight), and in one CI run. It needs nothing of
zcompile (``benchmarks/bench_gloo_gather_crash.py``): 2 gloo ranks issuing 8 functional all-gathers
of 16 KiB before waiting on them, 300 rounds a launch, crashed 2 of 16 launches
(``results/gloo_gather_crash.json``; 7 of 24 in earlier runs, with or without grad on the inputs);
the same with ``all_gather_into_tensor_out`` (gloo's flat all-gather), with ``dist.all_gather_single``
and with one gather in flight at a time crashed none (0 of 16 each; 0 of 24, 0 of 8, 0 of 8 before).
On torch 2.11: 5 of 16 against 0 of 16 for each other form (``results/gloo_gather_crash_2.11.json``).
With this rewrite the 2-rank specs above ran 40 of 40 times (3 of 30 crashed without it).

The rewrite, for every all-gather of the graph::

    ag = all_gather_into_tensor(x, N, g)          buf = empty([N * d0, ...], dtype, device)
    y = wait_tensor(ag)                     ->    ag = all_gather_into_tensor_out(x, N, g, out=buf)
                                                  y = wait_tensor(ag)

the buffer allocated where the gather is issued, as the functional op allocates its output: the
same bytes, alive over the same span. It applies to the graph a compiled function runs, not to the
pipeline's graphs that reports, dumps, the rank checks and the memory walks read (those speak of
all-gathers, and an out= collective's result aliases an argument that is not its first); the front
end applies it (``zcompile.inner``) when ``zcompile.process_group.gathers_into_buffers`` says so.
"""

from __future__ import annotations

import logging

import torch

from zcompile.passes.collectives import ALL_GATHER

log = logging.getLogger(__name__)
aten = torch.ops.aten
ALL_GATHER_OUT = torch.ops._c10d_functional.all_gather_into_tensor_out.default


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
            buffer = graph.call_function(aten.empty.memory_format, (list(gathered.shape),),
                                         {"dtype": gathered.dtype, "device": gathered.device})
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
