"""Sets of aten ops the passes reason about: views, casts, copies, size queries.

Passes follow a gathered weight from its collective to the compute that reads it; what they may
walk through is named here once, by what the op does to the data:

- ``SHAPE_VIEWS``: the same elements re-labelled; ``SLICE_VIEWS``: a part of them;
  ``LAYOUT_VIEWS``: the same elements in another order (strides). ``VIEW_OPS`` is all three.
- ``CASTS``: a new tensor of another dtype; ``COPIES``: any op that makes a new storage holding
  the same values (a cast, a ``clone``; ``makes_copy`` also knows a bucket's unpacked pieces).
- ``PASS_THROUGH``: a tensor passes through without its data being read as data (the wait of a
  collective, views, casts); ``PREP_OPS``: what prepares a gathered buffer for its reader (also
  the copies, and buckets' ``passes.bucket_ops``, ``split`` and ``getitem``).
- ``SIZE_QUERIES``: ops that read only a tensor's size.
"""

from __future__ import annotations

import operator

import torch

from zcompile.passes.bucket_ops import PACK_BUCKET, UNPACK_BUCKET
from zcompile.passes.collectives import WAIT

aten = torch.ops.aten

SHAPE_VIEWS = frozenset(
    {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default, aten.detach.default}
)
SLICE_VIEWS = frozenset({aten.slice.Tensor, aten.select.int})
LAYOUT_VIEWS = frozenset(
    {aten.t.default, aten.transpose.int, aten.permute.default, aten.expand.default, aten.as_strided.default}
)
VIEW_OPS = SHAPE_VIEWS | SLICE_VIEWS | LAYOUT_VIEWS

CASTS = frozenset({aten._to_copy.default, torch.ops.prims.convert_element_type.default})
COPIES = CASTS | {aten.clone.default}

PASS_THROUGH = frozenset({WAIT}) | VIEW_OPS | CASTS
BUCKET_OPS = frozenset({PACK_BUCKET, UNPACK_BUCKET, aten.split_with_sizes.default, operator.getitem})
PREP_OPS = PASS_THROUGH | COPIES | BUCKET_OPS

SIZE_QUERIES = frozenset(
    {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int, aten.sym_storage_offset.default}
)


def is_call_to(node: torch.fx.Node, ops: frozenset) -> bool:
    return node.op == "call_function" and node.target in ops


def makes_copy(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a new storage holding the same values as its input: a ``COPIES`` op, or a
    member's piece of a bucket that ``unpack_bucket`` copied out."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return is_call_to(node.args[0], frozenset({UNPACK_BUCKET}))
    return node.target in COPIES
