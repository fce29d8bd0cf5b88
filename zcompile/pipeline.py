"""Runs zcompile's passes by name: timing, op-count diffs, graph dumps, and errors that say where.

Every pass is applied through ``PassRunner.run``, which

- logs one info line per pass (time, nodes added and removed by op);
- with a dump directory (``options={"dump": DIR}`` or ``ZCOMPILE_DUMP=DIR``) writes, per rank and
  per Dynamo graph, the readable graph before and after the pass (``print_readable`` with shapes
  and dtypes), ``passes.json`` (one record per pass) and whatever else the backend adds
  (``plan.json``, ``collectives.{forward,backward}.json``), and hands the same artifacts to
  ``torch._logging.trace_structured`` so that tlparse shows them;
- turns an exception inside a pass into a ``PassError`` naming the pass, the graph, the node being
  rewritten (set with ``PassRunner.at``, else the innermost FX node found in the failing frames'
  locals) and where the dump is.

Layout: ``DIR/rank{R}/{graph_id}/{NN}_{pass}.{graph}.before.txt`` (and ``.after.txt``), where
``graph_id`` is Dynamo's compile id (``0_0``: frame 0, first compile) and ``graph`` is ``dynamo``,
``forward`` or ``backward``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

DUMP_ENV = "ZCOMPILE_DUMP"


class PassError(RuntimeError):
    """A pass failed; the message names the pass, the graph, the node and the dump."""


@dataclass
class PassRecord:
    """What one pass did to one graph (a line of ``passes.json``)."""

    index: int
    name: str
    graph: str  # dynamo | forward | backward
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
    """Per-compile state of the pass pipeline for one Dynamo graph (and its forward/backward)."""

    graph_id: str
    dump_dir: Path | None = None
    records: list[PassRecord] = field(default_factory=list)
    current_node: str | None = None

    @classmethod
    def for_graph(cls, gm: torch.fx.GraphModule, dump_root: str | None, rank: int) -> PassRunner:
        compile_id = str(gm.meta.get("dynamo_compile_id", "unknown"))
        graph_id = re.sub(r"[^0-9A-Za-z]+", "_", compile_id).strip("_") or "unknown"
        dump_dir = None
        if dump_root:
            dump_dir = Path(dump_root) / f"rank{rank}" / graph_id
            dump_dir.mkdir(parents=True, exist_ok=True)
        return cls(graph_id=graph_id, dump_dir=dump_dir)

    def at(self, node: torch.fx.Node | None) -> None:
        """Passes call this with the node they are about to rewrite, for error messages."""
        self.current_node = None if node is None else f"{node.name} ({node.op} {_target_name(node)})"

    def run(self, name: str, pass_fn: Callable[..., torch.fx.GraphModule], gm: torch.fx.GraphModule, graph: str,
            *args: Any) -> torch.fx.GraphModule:
        """Applies ``pass_fn(gm, *args)`` and records it; see the module docstring."""
        index = len(self.records)
        stem = f"{index:02d}_{name}.{graph}"
        before_ops = _op_counts(gm)
        if self.dump_dir is not None:
            self._write_artifact(f"{stem}.before.txt", _readable(gm))
        self.current_node = None
        start = time.perf_counter()
        try:
            result = pass_fn(gm, *args)
        except Exception as error:
            where = f"; graphs dumped under {self.dump_dir}" if self.dump_dir else (
                f"; set options={{'dump': DIR}} or {DUMP_ENV}=DIR to dump the graphs")
            current = self.current_node or _node_in_traceback(error.__traceback__)
            node = f" at node {current}" if current else ""
            raise PassError(
                f"zcompile pass {name!r} failed on the {graph} graph of Dynamo graph {self.graph_id}{node}: "
                f"{type(error).__name__}: {error}{where}"
            ) from error
        seconds = time.perf_counter() - start
        after_ops = _op_counts(result)
        record = PassRecord(
            index, name, graph, seconds, sum(before_ops.values()), sum(after_ops.values()),
            dict(after_ops - before_ops), dict(before_ops - after_ops),
        )
        self.records.append(record)
        log.info(
            "pass %s on %s graph %s: %.1f ms, %d -> %d nodes, added %s, removed %s", name, graph, self.graph_id,
            seconds * 1e3, record.nodes_before, record.nodes_after, record.added or "{}", record.removed or "{}",
        )
        if self.dump_dir is not None:
            self._write_artifact(f"{stem}.after.txt", _readable(result))
            self.write_json("passes.json", [r.to_json() for r in self.records])
        return result

    def write_json(self, filename: str, data: Any) -> None:
        """Writes ``data`` as JSON into this graph's dump folder (and to trace_structured)."""
        if self.dump_dir is not None:
            self._write_artifact(filename, json.dumps(data, indent=1, default=str))

    def _write_artifact(self, filename: str, text: str) -> None:
        (self.dump_dir / filename).write_text(text)
        torch._logging.trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": f"zcompile_{self.graph_id}_{filename}", "encoding": "string"},
            payload_fn=lambda: text,
        )


def resolve_dump_root(option: str | None) -> str | None:
    """The dump directory: the option, else ``$ZCOMPILE_DUMP``, else none."""
    return option or os.environ.get(DUMP_ENV) or None


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
