"""Applies one pass to one graph: timing, op-count diffs, graph dumps, and errors that say where.

``PassRunner.run`` (called by the pipeline, ``zcompile.backend.pipeline``, for every pass it applies)

- logs one info line per pass (time, nodes added and removed by op);
- with a dump directory writes the readable graph before and after the pass (``print_readable``
  with shapes and dtypes) and ``passes.json`` (one record per pass), as ``zcompile.common.dumps`` lays
  them out;
- turns an exception inside a pass into a ``PassError`` naming the pass, the graph, the node being
  rewritten (the innermost FX node found in the failing frames' locals) and where the dump is.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from zcompile.common.dumps import DUMP_ENV, PASSES_FILE, GraphDumpWriter, graph_id_of, pass_graph_file

log = logging.getLogger(__name__)


class PassError(RuntimeError):
    """A pass failed; the message names the pass, the graph, the node and the dump."""


@dataclass
class PassRecord:
    """What one pass did to one graph (a line of ``passes.json``)."""

    index: int
    name: str
    graph: str  # dynamo | joint | forward | backward | inference
    seconds: float
    nodes_before: int
    nodes_after: int
    added: dict[str, int]
    removed: dict[str, int]

    def to_json(self) -> dict:
        data = asdict(self)
        data["pass"] = data.pop("name")
        return data


@dataclass
class PassRunner:
    """The passes applied so far to one Dynamo graph (and the graphs AOTAutograd made of it), and its dump."""

    dump: GraphDumpWriter
    records: list[PassRecord] = field(default_factory=list)

    @classmethod
    def for_graph(cls, gm: torch.fx.GraphModule, dump_root: str | None, rank: int) -> PassRunner:
        graph_id = graph_id_of(gm.meta.get("dynamo_compile_id", "unknown"))
        return cls(GraphDumpWriter.create(dump_root, rank, graph_id))

    @property
    def graph_id(self) -> str:
        return self.dump.graph_id

    def run(
        self,
        name: str,
        pass_fn: Callable[..., torch.fx.GraphModule],
        gm: torch.fx.GraphModule,
        graph: str,
        *args: Any,
        **kwargs: Any,
    ) -> torch.fx.GraphModule:
        """Applies ``pass_fn(gm, *args, **kwargs)`` and records it; see the module docstring."""
        index = len(self.records)
        before_ops = _op_counts(gm)
        if self.dump.enabled:
            self.dump.write_text(pass_graph_file(index, name, graph, "before"), _readable(gm))
        start = time.perf_counter()
        try:
            result = pass_fn(gm, *args, **kwargs)
            result.graph.lint()  # passes lint and recompile themselves; this catches one that left a broken graph
        except Exception as error:
            where = (
                f"; graphs dumped under {self.dump.folder}"
                if self.dump.enabled
                else (f"; set options={{'dump': DIR}} or {DUMP_ENV}=DIR to dump the graphs")
            )
            current = _node_in_traceback(error.__traceback__)
            node = f" at node {current}" if current else ""
            raise PassError(
                f"zcompile: pass {name!r} failed on the {graph} graph of Dynamo graph {self.graph_id}{node}: "
                f"{type(error).__name__}: {error}{where}"
            ) from error
        seconds = time.perf_counter() - start
        after_ops = _op_counts(result)
        record = PassRecord(
            index,
            name,
            graph,
            seconds,
            sum(before_ops.values()),
            sum(after_ops.values()),
            dict(after_ops - before_ops),
            dict(before_ops - after_ops),
        )
        self.records.append(record)
        log.info(
            "pass %s on %s graph %s: %.1f ms, %d -> %d nodes, added %s, removed %s",
            name,
            graph,
            self.graph_id,
            seconds * 1e3,
            record.nodes_before,
            record.nodes_after,
            record.added or "{}",
            record.removed or "{}",
        )
        if self.dump.enabled:
            self.dump.write_text(pass_graph_file(index, name, graph, "after"), _readable(result))
            self.dump.write_json(PASSES_FILE, [r.to_json() for r in self.records])
        return result


def _readable(gm: torch.fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=False, include_device=True)


def _target_name(node: torch.fx.Node) -> str:
    if node.op in ("placeholder", "output"):
        return node.op
    target = node.target
    if isinstance(target, str):
        return f"{node.op}:{target}"
    if hasattr(target, "name") and callable(target.name):  # OpOverload
        return target.name()
    module = getattr(target, "__module__", "") or ""
    return f"{module}.{getattr(target, '__name__', str(target))}".lstrip(".")


def _node_in_traceback(traceback) -> str | None:
    """The FX node the failing pass was working on: the innermost frame holding one in a local."""
    frames = []
    while traceback is not None:
        frames.append(traceback.tb_frame)
        traceback = traceback.tb_next
    for frame in reversed(frames):
        nodes = [value for value in frame.f_locals.values() if isinstance(value, torch.fx.Node)]
        if nodes:
            node = nodes[-1]
            return f"{node.name} ({node.op} {_target_name(node)})"
    return None


def _op_counts(gm: torch.fx.GraphModule) -> Counter:
    return Counter(_target_name(node) for node in gm.graph.nodes)
