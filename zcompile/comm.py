"""What collectives a compiled step issues: read from the graphs, and recorded by the optimizer.

Elements are counted per rank the way ZeRO's volume formulas count them: an all-gather moves its
output's size, a reduce-scatter its input's size, an all-reduce its size (padding included), an
all-to-all its input's size.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from zcompile.collectives import COLLECTIVE_KINDS
from zcompile.passes import metadata



@dataclass(frozen=True)
class CollectiveRecord:
    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all
    elements: int
    dtype: torch.dtype
    where: str  # forward | backward | optimizer
    params: tuple[str, ...] = ()  # the parameters it gathers or reduces
    group: str = ""  # process group name ("" in records made before groups were named)
    group_size: int = 0

    @property
    def bytes(self) -> int:
        return self.elements * self.dtype.itemsize

    def to_json(self) -> dict:
        return {"kind": self.kind, "elements": self.elements, "bytes": self.bytes, "dtype": str(self.dtype),
                "where": self.where, "params": list(self.params), "group": self.group,
                "group_size": self.group_size}


def graph_collectives(gm: torch.fx.GraphModule | None, where: str) -> list[CollectiveRecord]:
    """The collectives of an (AOTAutograd, aten-level) graph, in graph order."""
    if gm is None:
        return []
    records = []
    for node in gm.graph.nodes:
        kind = COLLECTIVE_KINDS.get(node.target) if node.op == "call_function" else None
        if kind is None:
            continue
        source = node.args[0].meta.get("val")
        elements = source.numel() * (node.args[1] if kind == "all_gather" else 1)
        group = str(node.args[-1])
        group_size = node.args[1] if kind == "all_gather" else node.args[2] if kind == "reduce_scatter" else \
            len(node.args[1]) if kind == "all_to_all" else 0
        records.append(CollectiveRecord(kind, int(elements), source.dtype, where, tuple(metadata.params_of(node)),
                                        group, int(group_size)))
    return records


def step_collectives(compiled_graphs, optimizer=None) -> list[CollectiveRecord]:
    """Every collective of one training step: each graph's forward and backward, then the optimizer's."""
    records = []
    for graphs in compiled_graphs:
        records += graph_collectives(graphs.forward, "forward")
        records += graph_collectives(graphs.backward, "backward")
    if optimizer is not None:
        records += list(getattr(optimizer, "last_step_collectives", []))
    return records


def summarize(records: list[CollectiveRecord]) -> dict[str, int]:
    """Elements moved per kind (and ``total``)."""
    totals = Counter()
    for record in records:
        totals[record.kind] += record.elements
        totals["total"] += record.elements
    return dict(totals)
