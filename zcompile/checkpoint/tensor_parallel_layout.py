"""A tensor-parallel parameter's saved tensors: one layout for every mesh.

Each flat tensor of a DTensor parameter's shard (its master weights in ``zcompile.checkpoint``, Adam's
moments and SGD's momentum in the optimizer's state dict) is saved as this rank's piece of a flat
tensor of the parameter's *global* ``numel`` elements in the weight's own order: the same tensor a
model without tensor parallelism saves (``zcompile.checkpoint.layout``), so DCP reshards between
dp x tp layouts of any degrees, and to and from plain data parallelism; consolidated, it is the
weight.

Whose piece: the flat tensor is cut over tp first, then each tp piece over dp (DTensor
``[Shard(0), Shard(0)]`` on the mesh ordered ``("tp", "dp")``; with hybrid sharding ``("replicate",
"tp", "shard")``, whole on every replica). A weight split on dim 0
(column-wise) or replicated is then already laid out so: each rank's optimizer shard is its piece.
A weight split on another dim (row-wise) holds a strided slice of the global order; its piece is
made (and read back) through the full tensor, gathered over dp and tp one parameter at a time.
"""

from __future__ import annotations

import torch

from zcompile.common.process_group import DataParallelGroup, all_gather_eager
from zcompile.passes.dtensor_params import is_dtensor, local_tensor
from zcompile.sharding.shards import FlatPiece, shard_of


def tensor_parallel_layout(params, group: DataParallelGroup, what: str, timeout_s: float | None = None):
    """The layout of ``params``'s tensor-parallel pieces (None without tensor parallelism), after
    ``check_tensor_parallel_params``. Converting a row-wise weight's pieces is collective over dp and tp:
    with ``timeout_s``, the whole world first agrees through the store that it is making ``what`` (a
    rank that does not, ``if rank == 0: optimizer.state_dict()``, is a RankDivergenceError on the
    others within ``timeout_s``, not a collective that waits for it)."""
    check_tensor_parallel_params(params, group, what)
    if group.tensor_parallel is None:
        return None
    layout = TensorParallelStateLayout(group)
    if timeout_s is not None and any(is_dtensor(p) and layout.split_dim(p) not in (None, 0) for p in params):
        from zcompile.agreement.store_exchange import exchange_on_store

        exchange_on_store(
            what,
            group.everyone,
            timeout_s,
            "tensor-parallel-state",
            f"making or loading {what}",
            "Every rank makes (and loads) a tensor-parallel model's optimizer state dict: its row-wise weights' "
            "pieces are gathered over dp and tp. Call it on every rank (each keeps or saves its own piece)",
        )
    return layout


def check_tensor_parallel_params(params, group: DataParallelGroup, what: str) -> None:
    """``ValueError`` naming ``what`` when ``params``'s DTensors are not sharded yet (the pieces are
    cut at the first compiled step) or are split unevenly over the tp ranks."""
    params = [p for p in params if is_dtensor(p)]
    if not params:
        return
    if any(shard_of(p) is None for p in params):
        raise ValueError(
            f"zcompile: {what} of a tensor-parallel model is made or loaded after the model's first compiled step "
            "(its parameters are sharded over mesh['dp'] then); call it there"
        )
    tp = group.tensor_parallel.world_size
    uneven = next(
        (p for p in params if shard_of(p).split_over_tensor_parallel and local_tensor(p).numel() * tp != p.numel()),
        None,
    )
    if uneven is not None:
        raise ValueError(
            f"zcompile: {what} of a tensor-parallel model needs pieces of equal size on every tensor-parallel "
            f"rank; a parameter of shape {tuple(uneven.shape)} is split unevenly over {tp} ranks. Use a tp degree "
            "that divides the split dims"
        )


class TensorParallelStateLayout:
    """Converts a DTensor parameter's optimizer shards to and from their pieces of the global flat
    tensor (the module docstring). Made once per ``state_dict`` or ``load_state_dict`` call: it
    holds the meshes the pieces live on, made from the existing groups (no new process group)."""

    def __init__(self, group: DataParallelGroup):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import Replicate, Shard

        self.group = group
        self.tp = group.tensor_parallel
        mesh = group.mesh  # ("dp", "tp"), or ("replicate", "shard", "tp") with hybrid sharding
        dp = "dp" if "dp" in mesh.mesh_dim_names else "shard"
        # a replicated weight's state: cut over dp (the shard group), whole on every tp rank and replica
        self.whole_mesh = mesh
        self.whole = [Shard(0) if name == dp else Replicate() for name in mesh.mesh_dim_names]
        # a split weight's: cut over tp first, then over dp; whole on every replica
        order = [name for name in ("replicate", "tp", dp) if name in mesh.mesh_dim_names]
        self.split_mesh = DeviceMesh.from_group(
            [mesh[name].get_group() for name in order],
            mesh.device_type,
            mesh=mesh.mesh.permute(*[mesh.mesh_dim_names.index(name) for name in order]),
            mesh_dim_names=tuple(order),
        )
        self.split = [Replicate() if name == "replicate" else Shard(0) for name in order]

    def split_dim(self, param: torch.Tensor) -> int | None:
        """The dim ``param`` is split on over tp (None: replicated)."""
        placement = param.placements[0]
        if not placement.is_shard():
            return None
        return placement.dim % param.dim()

    def template(self, param: torch.Tensor, piece: FlatPiece, device) -> torch.Tensor:
        """An empty piece of ``param``'s global flat tensor laid out as ``piece`` makes it: what DCP loads into."""
        return self._as_piece(torch.empty(piece.owned, device=device), param)

    def piece(self, shard_value: torch.Tensor, param: torch.Tensor, piece: FlatPiece) -> torch.Tensor:
        """This rank's piece of the global flat tensor from its optimizer shard (``piece.owned`` elements)."""
        dim = self.split_dim(param)
        local = shard_value.detach()[: piece.owned]
        if dim not in (None, 0):  # this rank's slice of the global order lies on other ranks: through the full tensor
            start = self.tp.rank * piece.numel + piece.offset
            local = self._full(shard_value, param, piece, dim)[start : start + piece.owned].clone()
        return self._as_piece(local, param)

    def _as_piece(self, local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """``local`` as this rank's DTensor piece of ``param``'s global flat tensor."""
        from torch.distributed.tensor import DTensor

        split = self.split_dim(param) is not None
        mesh, placements = (self.split_mesh, self.split) if split else (self.whole_mesh, self.whole)
        shape = torch.Size([param.numel()])
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=(1,))

    def shard(self, value: torch.Tensor, param: torch.Tensor, piece: FlatPiece) -> torch.Tensor:
        """This rank's ``owned`` elements of its optimizer shard from its piece ``value`` (as ``piece`` makes it)."""
        local = value.to_local().reshape(-1)
        dim = self.split_dim(param)
        if dim is None or dim == 0:
            return local
        rows = self._gathered_over_tp(self._gathered_over_dp(piece.padded(local), piece))
        return self.shard_of_full(rows, param, piece)

    def shard_of_full(self, full: torch.Tensor, param: torch.Tensor, piece: FlatPiece) -> torch.Tensor:
        """This rank's ``owned`` elements of its optimizer shard from the global state tensor ``full``
        (the weight's elements in its order, any shape)."""
        full = full.reshape(param.shape)
        dim = self.split_dim(param)
        mine = full if dim is None else full.chunk(self.tp.world_size, dim=dim)[self.tp.rank]
        return mine.reshape(-1)[piece.offset : piece.offset + piece.owned].clone()

    def _gathered_over_dp(self, padded: torch.Tensor, piece: FlatPiece) -> torch.Tensor:
        """The ``piece.numel`` elements that the dp ranks' padded shards hold together."""
        full = torch.empty(piece.chunk * piece.world, dtype=padded.dtype, device=padded.device)
        all_gather_eager(full, padded.contiguous(), self.group)
        return full[: piece.numel]

    def _gathered_over_tp(self, local_flat: torch.Tensor) -> torch.Tensor:
        """Every tp rank's ``local_flat`` (same size on each), one row per tp rank."""
        rows = torch.empty(self.tp.world_size * local_flat.numel(), dtype=local_flat.dtype, device=local_flat.device)
        all_gather_eager(rows, local_flat.contiguous(), self.tp)
        return rows.view(self.tp.world_size, -1)

    def _full(self, shard_value: torch.Tensor, param: torch.Tensor, piece: FlatPiece, dim: int) -> torch.Tensor:
        """The global state tensor, flat in the weight's order, from every rank's optimizer shard."""
        local_shape = local_tensor(param).shape
        pieces = self._gathered_over_tp(self._gathered_over_dp(shard_value, piece))
        return torch.cat([row.view(local_shape) for row in pieces], dim=dim).reshape(-1)
