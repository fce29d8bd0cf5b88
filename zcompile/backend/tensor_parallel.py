"""The runtime of a tensor-parallel model's compile: the graph takes each DTensor parameter's local
piece (``passes/dtensor_params.py``), so every call passes the pieces in the parameters' places,
and each DTensor parameter carries the shard of its piece, where the optimizer, clipping and
``gathered`` find it."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import Shard

from zcompile.passes.dtensor_params import LocalPieceParameter, local_piece
from zcompile.sharding.sharded_parameter import SHARD_ATTR, shard_of


def link_dtensor_shards(inputs: list, pieces: list[LocalPieceParameter]) -> None:
    """Each DTensor parameter among ``inputs`` gets its local piece's shard (``SHARD_ATTR``)."""
    for spec in pieces:
        param = inputs[spec.index]
        _link(param, shard_of(local_piece(param)), spec)


def _link(param: torch.Tensor, sharded, spec: LocalPieceParameter) -> None:
    if sharded is None or getattr(param, SHARD_ATTR, None) is sharded:
        return
    sharded.split_over_tensor_parallel = any(isinstance(p, Shard) for p in spec.placements)
    setattr(param, SHARD_ATTR, sharded)


def take_local_pieces(run: Callable, pieces: list[LocalPieceParameter]) -> Callable:
    """``run`` called with each DTensor parameter replaced by its local piece. A graph reused for
    other modules (regional compilation) shards their pieces at their first call: their DTensor
    parameters get the shard then."""

    def run_on_local_pieces(*args):
        args = list(args)
        dtensors = [args[spec.index] for spec in pieces]
        for spec, param in zip(pieces, dtensors):
            args[spec.index] = local_piece(param)
        out = run(*args)
        for spec, param in zip(pieces, dtensors):
            if getattr(param, SHARD_ATTR, None) is None:
                _link(param, shard_of(args[spec.index]), spec)
        return out

    return run_on_local_pieces


def static_fake_pieces(tracing_inputs: list, pieces: list[LocalPieceParameter]) -> list:
    """The local pieces the tracing inputs still hold as real tensors (stage 1 keeps them in place)
    as static-shape fakes of Dynamo's fake mode, as ``ShardSwap.swap_for_tracing`` makes its own."""
    fake_mode = torch._guards.detect_fake_mode(tracing_inputs)
    if fake_mode is None:
        return tracing_inputs
    from torch._subclasses.fake_tensor import FakeTensor

    out = list(tracing_inputs)
    for spec in pieces:
        value = out[spec.index]
        if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            out[spec.index] = fake_mode.from_tensor(value, static_shapes=True)
    return out
