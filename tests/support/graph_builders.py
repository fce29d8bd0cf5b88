"""Small FX graphs for the graph-level pass tests, and a fake process group to run them on.

Tracing needs no process group. The ``_c10d_functional`` ops' fake kernels read only the group
size argument; the group name is carried as a plain string and never resolved (checked on torch
2.13: ``make_fx(tracing_mode="fake")`` of ``wait_tensor(all_gather_into_tensor(x, 4, "world"))``
works with ``torch.distributed`` not initialized). So :func:`trace` sets up no group, and the
tests name groups freely ("world", "hpz", "intra", ...).

*Running* a graph with collectives on real tensors does need a group registered under the name
the graph uses: :func:`fake_process_group` initializes torch's fake backend for the duration of a
``with`` block and always destroys it (other tests in the same pytest process expect none). On
torch 2.13 its collectives copy local data (see ``NOTE [FakeProcessGroup collective semantics]``
in ``FakeProcessGroup.hpp``): an all-gather returns this rank's input repeated ``world_size``
times, i.e. every rank holding the same shard; a reduce-scatter and an all-to-all over one rank
are exact; an all-to-all over several ranks fills arbitrary (deterministic) values.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from zcompile.passes import metadata
from zcompile.passes.collectives import ALL_GATHER, REDUCE_SCATTER, WAIT, collective_kind


@contextlib.contextmanager
def fake_process_group(rank: int = 0, world_size: int = 1) -> Iterator[str]:
    """A fake default process group for the ``with`` block; yields its group name."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "a process group is already initialized; refusing to replace it"
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def trace(fn: Callable, *example_inputs: torch.Tensor) -> torch.fx.GraphModule:
    """aten-level graph of ``fn``; every node carries a fake ``meta["val"]`` (the passes read it)."""
    return make_fx(fn, tracing_mode="fake")(*example_inputs)


def as_zero_collectives(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with each untagged collective tagged as the ZeRO one zcompile would have inserted (a
    parameter's gather, a gradient's reduction): the passes rewrite only those; an untagged one is
    the model's own. Collectives already tagged keep their tags."""
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind is not None and not metadata.tags(node).get(metadata.ROLE):
            metadata.tag(node, role=metadata.ROLE_GATHER if kind == "all_gather" else metadata.ROLE_REDUCE)
    return gm


def all_gather_graph(numel: int, group_size: int, group_name: str, dtype=torch.float32) -> torch.fx.GraphModule:
    """``wait(all_gather(shard))`` times 2 (a user of the gathered value, as a forward has), the
    gather tagged as ZeRO's."""
    return as_zero_collectives(
        trace(lambda shard: WAIT(ALL_GATHER(shard, group_size, group_name)) * 2, torch.zeros(numel, dtype=dtype))
    )


def reduce_scatter_graph(numel: int, group_size: int, group_name: str, dtype=torch.float32) -> torch.fx.GraphModule:
    """``wait(reduce_scatter(grad, "sum"))`` of a flat gradient of ``numel`` elements, tagged as ZeRO's."""
    return as_zero_collectives(
        trace(lambda grad: WAIT(REDUCE_SCATTER(grad, "sum", group_size, group_name)), torch.zeros(numel, dtype=dtype))
    )


def calls(gm: torch.fx.GraphModule, target) -> list[torch.fx.Node]:
    """The ``call_function`` nodes of ``gm`` calling ``target``, in graph order."""
    return list(gm.graph.find_nodes(op="call_function", target=target, sort=True))


def linear_graph() -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """A Dynamo-like graph ``linear(x, weight, bias) + weight.sum()`` and example inputs.

    Built by hand, as Dynamo would emit it (torch-level calls, parameters as placeholders whose
    example values are ``nn.Parameter``), so ``plan_sharding`` finds ``weight`` and ``bias``.
    """
    graph = torch.fx.Graph()
    weight = graph.placeholder("weight")
    x = graph.placeholder("x")
    bias = graph.placeholder("bias")
    y = graph.call_function(torch.nn.functional.linear, (x, weight, bias))
    z = graph.call_function(operator.add, (y, graph.call_function(torch.sum, (weight,))))
    graph.output((z,))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    gen = torch.Generator().manual_seed(0)
    inputs = [
        torch.nn.Parameter(torch.randn(3, 5, generator=gen)),
        torch.randn(2, 5, generator=gen),
        torch.nn.Parameter(torch.randn(3, generator=gen)),
    ]
    return gm, inputs
