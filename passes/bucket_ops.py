"""The copies into and out of a bucket's flat buffer: one op per bucket, not one per member.

A bucket's collective reads one flat buffer and writes another. Into it go the members' inputs
side by side per rank (``pack_bucket``: an all-gather's shards, one row; a reduce-scatter's padded
gradients, ``[N, s_i]`` each, so that rank r's row holds every member's slice for rank r); out of
an all-gather come every rank's shards of every member, rank-major, from which each member needs
its own ``[N * s_i]`` copy, and out of a reduce-scatter each member's ``[s_i]``, averaged over
ranks (``unpack_bucket``). Written as aten ops that is a ``cat`` of as many
inputs as members and a ``split`` + ``clone`` (or ``div``) per member: inductor makes each member's
copy a kernel of its own (and its C++ code generation costs about as much per kernel however small
the kernel), and the eager compiler runs three dispatcher calls per member. As ``torch.library``
custom ops each is one call per bucket: an extern kernel to inductor, which neither fuses nor
splits it, and one call in the eager compiler's code. The copies themselves are ``torch.cat`` /
``torch.split_with_sizes_copy``: the same bytes as the aten ops. Under inductor on gloo every
gather's computed input, a bucket's pack or any tensor as a bucket of one, is made as the last row
of the gather's own buffer (``pack_bucket_as_last_row``; ``all_gather_lowering``).

All three are pure (new storages, no alias of an input), with fake implementations for FakeTensorMode
(``zcompile.simulate``; the passes' fake values).
"""

from __future__ import annotations

import torch


@torch.library.custom_op("zcompile::pack_bucket", mutates_args=())
def pack_bucket(members: list[torch.Tensor], rows: int) -> torch.Tensor:
    """The members, each viewed ``[rows, numel / rows]``, side by side: flat ``[sum of numels]``."""
    return torch.cat([member.reshape(rows, -1) for member in members], dim=1).view(-1)


@pack_bucket.register_fake
def _pack_bucket_fake(members: list[torch.Tensor], rows: int) -> torch.Tensor:
    return members[0].new_empty(sum(member.numel() for member in members))


@torch.library.custom_op("zcompile::pack_bucket_as_last_row", mutates_args=())
def pack_bucket_as_last_row(members: list[torch.Tensor], rows: int, buffer_rows: int) -> torch.Tensor:
    """``pack_bucket(members, rows)`` written as the last of ``buffer_rows`` equal rows of a new flat
    buffer, the rows before it left empty: an all-gather's buffer, which the gather fills from that
    last row (``all_gather_lowering.gather_inputs_into_out_buffers``), so the pack needs no copy there."""
    width = sum(member.numel() for member in members)
    buffer = members[0].new_empty(buffer_rows * width)
    last_row = buffer[(buffer_rows - 1) * width :].view(rows, -1)
    torch.cat([member.reshape(rows, -1) for member in members], dim=1, out=last_row)
    return buffer


@pack_bucket_as_last_row.register_fake
def _pack_bucket_as_last_row_fake(members: list[torch.Tensor], rows: int, buffer_rows: int) -> torch.Tensor:
    return members[0].new_empty(buffer_rows * sum(member.numel() for member in members))


@torch.library.custom_op("zcompile::unpack_bucket", mutates_args=())
def unpack_bucket(flat: torch.Tensor, rows: int, sizes: list[int], divisor: float) -> list[torch.Tensor]:
    """``flat`` viewed ``[rows, sum(sizes)]`` and cut along its columns: member i's ``[rows * sizes[i]]``
    (the inverse of ``pack_bucket``), each divided by ``divisor`` (a reduce-scatter's mean over ranks;
    1 for none). Every member gets a storage of its own: a gradient that is a view of the bucket
    keeps the whole bucket alive, with the bytes of members whose gradients were accumulated
    elsewhere (a tied weight's second gradient, from another graph)."""
    pieces = [piece.view(-1) for piece in torch.split_with_sizes_copy(flat.view(rows, -1), list(sizes), dim=1)]
    if divisor != 1:
        torch._foreach_div_(pieces, divisor)
    return pieces


@unpack_bucket.register_fake
def _unpack_bucket_fake(flat: torch.Tensor, rows: int, sizes: list[int], divisor: float) -> list[torch.Tensor]:
    torch._check(flat.numel() == rows * sum(sizes), lambda: "unpack_bucket: the sizes do not add up to the buffer")
    return [flat.new_empty(rows * size) for size in sizes]


PACK_BUCKET = torch.ops.zcompile.pack_bucket.default
PACK_BUCKET_AS_LAST_ROW = torch.ops.zcompile.pack_bucket_as_last_row.default
UNPACK_BUCKET = torch.ops.zcompile.unpack_bucket.default
