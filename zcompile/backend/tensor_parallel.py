"""The runtime of a tensor-parallel model's compile: the graph takes each DTensor parameter's local
piece (``passes/dtensor_params.py``), so every call passes the pieces in the parameters' places,
and each DTensor parameter carries the shard of its piece, where the optimizer, clipping and
``gathered`` find it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from zcompile.passes.dtensor_params import LocalPieceParameter, local_piece
from zcompile.sharding.sharded_parameter import SHARD_ATTR, shard_of


def link_dtensor_shards(inputs: list, pieces: list[LocalPieceParameter]) -> None:
    """Each DTensor parameter among ``inputs`` gets its local piece's shard (``SHARD_ATTR``)."""
    for spec in pieces:
        param = inputs[spec.index]
        sharded = shard_of(local_piece(param))
        if sharded is not None and shard_of(param) is not sharded:
            setattr(param, SHARD_ATTR, sharded)


def take_local_pieces(run: Callable, pieces: list[LocalPieceParameter]) -> Callable:
    """``run`` called with each DTensor parameter replaced by its local piece. A graph reused for
    other modules (regional compilation) shards their pieces at their first call: their DTensor
    parameters get the shard then."""
    positions = [spec.index for spec in pieces]

    def run_on_local_pieces(*args):
        args = list(args)
        dtensors = [args[index] for index in positions]
        for index, param in zip(positions, dtensors):
            args[index] = local_piece(param)
        out = run(*args)
        for index, param in zip(positions, dtensors):
            if getattr(param, SHARD_ATTR, None) is None:
                sharded = shard_of(args[index])
                if sharded is not None:
                    setattr(param, SHARD_ATTR, sharded)
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
