"""Module buffers the same on every rank: rank 0's values, taken at each optimizer step.

A compiled graph may change registered buffers in place: BatchNorm's running mean, variance and
batch count in training mode, from the batch each rank sees. Left alone, each rank's buffers
follow its own data, so evaluation and checkpoints (DCP saves one copy of a replicated tensor)
depend on the rank, with no error. DDP broadcasts its buffers from rank 0 at each forward with
gradients (``broadcast_buffers=True``). Here the buffers a graph changes (AOTAutograd's metadata,
``zcompile.backend.aot.mutated_input_indices``) are noted at each call with gradients and broadcast from
rank 0 by the next ``optimizer.step()``, right after the ranks agreed on that step: a collective
in a forward would pair with another rank's backward collectives when one rank skips a batch,
while at the step every rank is known to be there. After a step every rank holds rank 0's values,
the values DDP's next forward would use; one flat broadcast per dtype. Option
``broadcast_buffers=False`` keeps them per rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from zcompile.common.process_group import DataParallelGroup, broadcast_from_first
from zcompile.sharding.shards import shard_of

log = logging.getLogger(__name__)


@dataclass(eq=False)
class BufferSync:
    """The buffer inputs one compiled graph changes (``(index, name)``), and the buffers changed by
    calls with gradients since the last step, by identity (Dynamo reuses one graph for every block)."""

    changed: list[tuple[int, str]]
    group: DataParallelGroup
    pending: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def noted(self, args: tuple) -> None:
        if torch.is_grad_enabled():
            for index, _ in self.changed:
                self.pending[id(args[index])] = args[index]


def changed_buffer_inputs(buffers: list[tuple[int, str]], mutated: tuple[int, ...]) -> list[tuple[int, str]]:
    """The buffer inputs (``ShardingPlan.buffers``) among the inputs a graph mutates."""
    mutated_set = set(mutated)
    return [(index, name) for index, name in buffers if index in mutated_set]


def note_changed_buffers(run: Callable, sync: BufferSync, param_indices: list[int]) -> Callable:
    """``run`` (taking the call's own arguments), then its changed buffers noted in ``sync``, which
    each parameter of the call points to (``ShardedParam.buffer_sync``): the optimizer's step finds
    it there."""
    log.info(
        "zcompile: buffers changed by the graph, taken from rank 0 at each optimizer step: %s",
        ", ".join(name for _, name in sync.changed),
    )

    def run_and_note(*args):
        out = run(*args)
        sync.noted(args)
        for index in param_indices:
            sharded = shard_of(args[index])
            if sharded is not None:
                sharded.buffer_sync = sync
        return out

    return run_and_note


def changed_buffers_summary(members: list) -> str:
    """What the next ``broadcast_changed_buffers(members)`` will broadcast, for the step's agreement:
    a rank whose modules ran in another mode (``model.eval()`` on one rank only) changed other
    buffers, and its broadcasts would not pair with the others' (a wait with no end)."""
    syncs = {id(m.buffer_sync): m.buffer_sync for m in members if m.buffer_sync is not None and m.buffer_sync.pending}
    names = sorted(name for sync in syncs.values() for _, name in sync.changed)
    tensors = sum(len(sync.pending) for sync in syncs.values())
    return f"{tensors} buffers ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})" if tensors else "none"


def broadcast_changed_buffers(members: list) -> None:
    """At a step every rank agreed on: the buffers changed since the last one (``ShardedParam``
    ``members``' syncs) take rank 0's values."""
    syncs = {id(m.buffer_sync): m.buffer_sync for m in members if m.buffer_sync is not None}
    for sync in syncs.values():
        if sync.pending and sync.group.world_size > 1:
            broadcast_from_first(list(sync.pending.values()), sync.group)
            if sync.group.replicate is not None:  # hybrid sharding: from the first shard group to the others
                broadcast_from_first(list(sync.pending.values()), sync.group.replicate)
        sync.pending.clear()
