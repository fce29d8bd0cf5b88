"""Tensor-parallel parameters as their local pieces: the graph takes each DTensor parameter's local
tensor and wraps it back into a DTensor where the parameter was read.

A model parallelized by torch's ``parallelize_module`` has DTensor parameters, each holding this
rank's piece of the weight. ZeRO shards what a rank holds, so the
graph must take that piece as a plain tensor: this rewrite turns each DTensor parameter placeholder
into a placeholder of its local tensor followed by ``DTensor.from_local`` with the parameter's mesh,
placements, shape and stride. The rest of the graph still sees the same DTensor, and AOTAutograd
traces the model's own tensor-parallel collectives from it; the sharding passes after this one see
plain tensors only. The caller passes the local pieces in the parameters' places at every call
(``local_piece``). Run by the backend before the sharding plan, not from the pipeline's table: it
changes the graph's inputs, which the plan is made from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LocalPieceParameter:
    """A graph input that was a DTensor parameter: its position and what wraps its piece back."""

    index: int
    mesh: object  # torch.distributed.device_mesh.DeviceMesh
    placements: tuple
    shape: torch.Size
    stride: tuple[int, ...]


def is_dtensor(value) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def local_piece(param: torch.Tensor) -> torch.Tensor:
    """The DTensor parameter's local tensor itself (the same object at every call: its shard is
    found on it), requiring grad as the parameter does (the graph takes the piece as the leaf that
    trains); a plain tensor is returned as it is."""
    if not is_dtensor(param):
        return param
    piece = local_tensor(param)
    if not isinstance(piece, torch.nn.Parameter):
        # a parameter as torch marks a Parameter(DTensor)'s local views (its _is_param flag): the sharding
        # plan, the optimizer and the checks take it for the parameter it is
        piece._is_param = True
    if piece.requires_grad != param.requires_grad and piece.is_leaf:
        piece.requires_grad_(param.requires_grad)
    return piece


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    """What a DTensor holds on this rank (its storage is the real memory; the DTensor's own reports its
    global size); a plain tensor as it is. Read only."""
    if not is_dtensor(value):
        return value
    # through the tensor-subclass protocol AOTAutograd uses: to_local() gives a fresh view of a
    # Parameter(DTensor)'s piece (torch 2.13), not the piece
    inner, _ = value.__tensor_flatten__()  # ["_local_tensor"]
    return getattr(value, inner[0])


def as_parameter_was(param: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
    """``piece`` (this rank's full local piece of ``param``) as ``param`` is: a DTensor on its mesh
    with its placements (a tensor-parallel model's state dict holds DTensors), else as it is."""
    if not is_dtensor(param):
        return piece
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        piece, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _wrapper(spec: LocalPieceParameter):
    from torch.distributed.tensor import DTensor

    def dtensor_from_local_piece(piece: torch.Tensor):
        return DTensor.from_local(
            piece, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
        )

    return dtensor_from_local_piece


def local_piece_inputs(gm: torch.fx.GraphModule, example_inputs: list) -> list[LocalPieceParameter]:
    """Rewrites ``gm`` in place so that each DTensor parameter input becomes its local piece wrapped
    back by ``DTensor.from_local``, and puts the local pieces in ``example_inputs`` (in place); returns
    the rewritten inputs (none: nothing changed). Other DTensor inputs (activations) stay DTensors."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    order = {node: position for position, node in enumerate(gm.graph.nodes)}
    rewritten = []
    for index, (node, value) in enumerate(zip(placeholders, example_inputs, strict=True)):
        if not (is_dtensor(value) and isinstance(value, torch.nn.Parameter)):
            continue
        spec = LocalPieceParameter(index, value.device_mesh, tuple(value.placements), value.shape, value.stride())
        piece = local_piece(value)
        example = node.meta.get("example_value")
        # at the weight's first reader, not at the top: the wrapped piece is where AOTAutograd's trace first
        # reads the weight, so the sharding's gathers are planned there (at the top, every weight would be
        # gathered at the start of the graph and held through it); the placeholders stay first
        first_reader = min(node.users, key=order.__getitem__, default=None)
        place = (
            gm.graph.inserting_before(first_reader)
            if first_reader is not None
            else gm.graph.inserting_after(placeholders[-1])
        )
        with place:
            wrapped = gm.graph.call_function(_wrapper(spec), (node,))
        node.replace_all_uses_with(wrapped, delete_user_cb=lambda user: user is not wrapped)
        wrapped.meta = dict(node.meta)
        if example is not None and is_dtensor(example):
            node.meta["example_value"] = local_piece(example)
        example_inputs[index] = piece
        rewritten.append(spec)
    if rewritten:
        gm.recompile()
    return rewritten
