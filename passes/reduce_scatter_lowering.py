"""A reduce-scatter run as an all-to-all and a local sum, where the backend's own is slow (gloo).

Gloo has no reduce-scatter of its own: ``reduce_scatter_tensor`` all-reduces a clone of the input
and keeps the rank's slice, moving ``2(N-1)/N`` of the input per rank where a reduce-scatter moves
``(N-1)/N``. An all-to-all moves exactly the reduce-scatter's bytes (rank ``r`` receives every rank's
row ``r``) and the rank adds the ``N`` rows it received, in less time than gloo's reduce-scatter,
the more so the more ranks (``benchmarks/bench_gloo_collectives.py``).

The rewrite, for every sum reduce-scatter of the graph (``avg`` is a sum then a division by N)::

    rs = reduce_scatter_tensor(x, "sum", N, g)          a2a = all_to_all_single(x, [d/N]*N, [d/N]*N, g)
    y = wait_tensor(rs)                          ->     w = wait_tensor(a2a)
                                                        y = zcompile::sum_received_rows(w, N)

in place: the all-to-all where the reduce-scatter was issued, the sum just after its wait, so the
schedule's placement is kept. It runs after every pass that plans or rewrites reduce-scatters
(bucketing, qgZ, the schedule). The all-to-all is tagged ``metadata.LOWERED_FROM = "reduce_scatter"``,
so ``collectives.CollectiveNode`` still reads it as a reduce-scatter (its kind, group size, reduce op
and bytes): reports, the rank checks and the cost model speak of what the graph does, not of how
this backend runs it. Its output is the full ``[N, d/N]`` received rows (gloo's clone of the input
is as large, allocated where no estimate sees it) until the sum has read them.

The sum is an op of its own (``sum_received_rows``), not aten's ``sum`` over a view: inductor
generates and compiles a C++ kernel per distinct bucket size for an aten sum (a cold compile of
each, the more the more distinct bucket sizes a model has), and to inductor the op is one extern
call. Its rows are added one after another (``add`` then ``add_``), on a CPU thread faster than
aten's ``sum`` over the outer dimension at few ranks and as fast at more.

Which compiles get it is the front end's choice (``zcompile.common.process_group.reduce_scatter_by_all_to_all``:
the option ``reduce_scatter``, by default gloo groups of more than one rank).

Gloo's work holds both buffers of the exchange (the rows sent and the rows received) until gloo's
worker thread drops it, which races with the graph: where the worker drops it last, the memory is
freed a little later and on a thread the profiler does not see. The graph an eager compile runs
(``exchanged_rows_released``, the front end's executed form) frees both itself, the sent rows at
the wait and the received rows after their sum, so the peak is the one the memory walk counts, in
every run.
"""

from __future__ import annotations

import logging

import torch

from zcompile.passes.collectives import ALL_TO_ALL, REDUCE_SCATTER, WAIT, CollectiveNode
from zcompile.passes.liveness import aliases
from zcompile.passes.metadata import LOWERED_FROM, tag, tags

log = logging.getLogger(__name__)
aten = torch.ops.aten


@torch.library.custom_op("zcompile::sum_received_rows", mutates_args=())
def sum_received_rows(received: torch.Tensor, ranks: int) -> torch.Tensor:
    """The sum of ``received``'s ``ranks`` equal blocks along dim 0 (row ``r``: what rank ``r`` sent),
    added in rank order: the reduce-scatter's result. A new tensor, never a view of ``received``."""
    by_rank = received.view(ranks, received.shape[0] // ranks, *received.shape[1:])
    total = torch.add(by_rank[0], by_rank[1]) if ranks > 1 else by_rank[0].clone()
    for rank in range(2, ranks):
        total.add_(by_rank[rank])
    return total


@sum_received_rows.register_fake
def _sum_received_rows_fake(received: torch.Tensor, ranks: int) -> torch.Tensor:
    return received.new_empty((received.shape[0] // ranks, *received.shape[1:]))


SUM_RECEIVED_ROWS = torch.ops.zcompile.sum_received_rows.default


def _lowerable(collective: CollectiveNode) -> bool:
    return (
        collective.node.target is REDUCE_SCATTER
        and collective.is_zero
        and collective.reduce_op in ("sum", "avg")
        and collective.wait is not None
        and collective.input_val is not None
        and collective.group_size > 1
    )


def _lower(gm: torch.fx.GraphModule, collective: CollectiveNode) -> None:
    graph, node, wait, world = gm.graph, collective.node, collective.wait, collective.group_size
    full = collective.input_val
    rows = full.shape[0] // world
    splits = [rows] * world
    with graph.inserting_before(node):
        exchange = graph.call_function(ALL_TO_ALL, (collective.input, splits, splits, collective.group_name))
    exchange.meta.update(node.meta)
    exchange.meta["val"] = full.new_empty(full.shape)
    tag(exchange, **{LOWERED_FROM: "reduce_scatter"})
    with graph.inserting_before(wait):
        received = graph.call_function(WAIT, (exchange,))
    received.meta.update(wait.meta)
    received.meta["val"] = exchange.meta["val"]
    with graph.inserting_after(received):
        reduced = graph.call_function(SUM_RECEIVED_ROWS, (received, world))
    reduced.meta["val"] = wait.meta["val"].new_empty(wait.meta["val"].shape)
    if collective.reduce_op == "avg":
        with graph.inserting_after(reduced):
            reduced = graph.call_function(aten.div.Tensor, (reduced, world))
        reduced.meta["val"] = wait.meta["val"].new_empty(wait.meta["val"].shape)
    wait.replace_all_uses_with(reduced)
    graph.erase_node(wait)
    graph.erase_node(node)


def reduce_scatter_as_all_to_all_pass(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrites each sum (or mean) ``reduce_scatter_tensor`` whose only user is its wait into an
    ``all_to_all_single`` of the same input, its wait, and a sum over the received rows (module
    docstring: what gloo's reduce-scatter costs, and why the kind stays ``reduce_scatter``). Reads
    ``meta["val"]``; writes ``meta["val"]`` on the new nodes and ``LOWERED_FROM`` on the all-to-all."""
    lowered = [c for c in map(CollectiveNode.of, list(gm.graph.nodes)) if c is not None and _lowerable(c)]
    for collective in lowered:
        _lower(gm, collective)
    if lowered:
        log.info("reduce_scatter_as_all_to_all: %d reduce-scatters run as all-to-all + sum", len(lowered))
    gm.graph.lint()
    gm.recompile()
    return gm


def release_storage(tensor: torch.Tensor) -> None:
    """Frees ``tensor``'s memory now, on this thread (its storage resized to no bytes): a collective's
    buffer the graph no longer reads, which the backend's finished work still references."""
    tensor.untyped_storage().resize_(0)


def exchanged_rows_released(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Frees each lowered reduce-scatter's buffers where the graph stops reading them (module
    docstring): after the all-to-all's wait the rows sent, where the graph made them for the exchange
    alone (an op's own output, read by nothing else), and after ``sum_received_rows`` the rows
    received. For the graph an eager compile runs on CPU: inductor plans buffer reuse itself."""
    graph, released = gm.graph, 0
    for exchange in list(graph.find_nodes(op="call_function", target=ALL_TO_ALL)):
        collective = CollectiveNode.of(exchange)
        wait = collective.wait if collective is not None else None
        if tags(exchange).get(LOWERED_FROM) != "reduce_scatter" or wait is None or len(exchange.users) != 1:
            continue
        sent = exchange.args[0]
        if _made_for(sent, exchange):
            with graph.inserting_after(wait):
                graph.call_function(release_storage, (sent,))
            released += 1
        summed = list(wait.users)
        if len(summed) == 1 and summed[0].target is SUM_RECEIVED_ROWS:
            with graph.inserting_after(summed[0]):
                graph.call_function(release_storage, (wait,))
            released += 1
    if released:
        log.debug("exchanged_rows_released: %d all-to-all buffers freed where the graph stops reading them", released)
        graph.lint()
        gm.recompile()
    return gm


def _made_for(sent: torch.fx.Node, exchange: torch.fx.Node) -> bool:
    """``sent`` is a CPU tensor of the graph's own (an op's fresh output, not an input or a view of
    one) that nothing but ``exchange`` reads."""
    value = sent.meta.get("val") if isinstance(sent, torch.fx.Node) else None
    return (
        isinstance(value, torch.Tensor)
        and value.device.type == "cpu"
        and sent.op == "call_function"
        and isinstance(sent.target, torch._ops.OpOverload)
        and not aliases(sent)
        and set(sent.users) == {exchange}
    )
