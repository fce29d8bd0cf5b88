"""Module buffers the same on every rank: rank 0's values after each call that changed them.

A compiled graph may change registered buffers in place: BatchNorm's running mean, variance and
batch count in training mode, from the batch each rank sees. Left alone, each rank's buffers
would follow its own data, so evaluation and checkpoints (DCP saves one copy of a replicated
tensor) would depend on the rank, with no error. DDP broadcasts every buffer from rank 0 at each
forward (``broadcast_buffers=True``); here the buffers a graph changed (AOTAutograd's metadata,
``zcompile.inner.mutated_input_indices``) are broadcast from rank 0 once the call returns, one
flat collective per dtype, so between calls every rank holds rank 0's values, the values DDP's
next forward would use. Option ``broadcast_buffers=False`` keeps them per rank.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.distributed as dist

from zcompile.process_group import DataParallelGroup

log = logging.getLogger(__name__)


def changed_buffer_inputs(buffers: list[tuple[int, str]], mutated: tuple[int, ...]) -> list[tuple[int, str]]:
    """The buffer inputs (``ShardingPlan.buffers``) among the inputs a graph mutates."""
    mutated_set = set(mutated)
    return [(index, name) for index, name in buffers if index in mutated_set]


def broadcast_after_call(run: Callable, changed: list[tuple[int, str]], group: DataParallelGroup) -> Callable:
    """``run`` followed by rank 0's values of the ``changed`` buffer inputs on every rank."""
    if not changed or group.world_size == 1:
        return run
    indices = [index for index, _ in changed]
    log.info("zero backend: buffers changed by the graph, taken from rank 0 after each call: %s",
             ", ".join(name for _, name in changed))

    def run_then_broadcast(*args):
        out = run(*args)
        broadcast_from_first([args[index] for index in indices], group)
        return out

    return run_then_broadcast


def broadcast_from_first(tensors: list[torch.Tensor], group: DataParallelGroup) -> None:
    """Every rank's ``tensors`` = the group's rank 0's, in one flat broadcast per dtype and device."""
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for same in by_kind.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        dist.broadcast(flat, group_src=0, group=group.process_group)
        with torch.no_grad():
            for tensor, value in zip(same, flat.split([t.numel() for t in same])):
                tensor.copy_(value.view_as(tensor))
