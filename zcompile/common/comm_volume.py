"""Communication volume of a training step: the collectives read from the compiled graphs, and the
optimizer's, as records with the elements each moves per rank (counted by
``zcompile.passes.collectives.CollectiveNode``: an all-gather moves its output, the others their input,
padding included).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from zcompile.passes import metadata
from zcompile.passes.collectives import collective_nodes


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
        return {
            "kind": self.kind,
            "elements": self.elements,
            "bytes": self.bytes,
            "dtype": str(self.dtype),
            "where": self.where,
            "params": list(self.params),
            "group": self.group,
            "group_size": self.group_size,
        }


def graph_collectives(gm: torch.fx.GraphModule | None, where: str) -> list[CollectiveRecord]:
    """The collectives of an (AOTAutograd, aten-level) graph, in graph order."""
    return [
        CollectiveRecord(
            c.kind, c.elements, c.dtype, where, tuple(metadata.params_of(c.node)), c.group_name, c.group_size
        )
        for c in collective_nodes(gm)
    ]


def step_collectives(compiled_graphs, optimizer=None) -> list[CollectiveRecord]:
    """Every collective of one training step: each graph's forward and backward, then the optimizer's."""
    records = []
    for graphs in compiled_graphs:  # each as often as it ran in the last step (blocks: once per layer)
        records += graph_collectives(graphs.forward, "forward") * graphs.calls_per_step
        records += graph_collectives(graphs.backward, "backward") * graphs.calls_per_step
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
