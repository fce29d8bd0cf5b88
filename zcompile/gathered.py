"""``gathered(model)``: the full parameters of a stage-3 model, materialized for eager use."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from zcompile.param_shards import ShardedParam, shard_of


def _stage3_shards(model: torch.nn.Module) -> list[ShardedParam]:
    seen, shards = set(), []
    for param in model.parameters():
        sharded = shard_of(param)
        if sharded is not None and sharded.stage == 3 and id(param) not in seen:
            seen.add(id(param))
            shards.append(sharded)
    return shards


@contextlib.contextmanager
def gathered(model: torch.nn.Module, writeback: bool = True) -> Iterator[torch.nn.Module]:
    """Materializes the full parameters of ``model`` inside the block and frees them after.

    Use it for evaluation, export or inspection in eager mode (call the original module,
    ``compiled._orig_mod``, or read ``state_dict()``). Every rank of the group must enter it: the
    parameters are all-gathered. With ``writeback=True`` changes made to the full parameters inside
    the block are copied back into this rank's shards on exit. Parameters of stages 1 and 2 are
    always full, so for them this is a no-op.
    """
    shards = _stage3_shards(model)
    with torch.no_grad():
        for sharded in shards:
            sharded.materialize_full()
    try:
        yield model
    finally:
        with torch.no_grad():
            for sharded in shards:
                if writeback:
                    sharded.write_shard_from_full()
                sharded.free_full()
