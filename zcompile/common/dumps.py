"""The dump directory: its layout, the writer the compiler uses and the loader the CLI uses.

A dump (``options={"dump": DIR}`` or ``ZCOMPILE_DUMP=DIR``) holds, per rank and per Dynamo graph::

    DIR/rank{R}/{graph_id}/NN_{pass}.{graph}.before.txt  the readable graph before pass number NN
    DIR/rank{R}/{graph_id}/NN_{pass}.{graph}.after.txt   ... and after it
    DIR/rank{R}/{graph_id}/passes.json                 one record per pass: time, nodes before/after
    DIR/rank{R}/{graph_id}/plan.json                   stage, world size, the parameters
    DIR/rank{R}/{graph_id}/{plan}.{graph}.json         a pass's plan (buckets, schedule, keep_gathered)
    DIR/rank{R}/{graph_id}/collectives.{graph}.json    the collectives of the forward/backward graph
    DIR/rank{R}/report.json                            optional: the step report (totals, formula, memory)

``graph_id`` is Dynamo's compile id made a file name (``0_0``: frame 0, first compile); ``graph`` is
``dynamo``, ``joint``, ``forward``, ``backward`` or ``inference``. Every artifact is also handed
to ``torch._logging.trace_structured``, so ``tlparse`` shows them. The loader is tolerant: every
file may be missing, and an unreadable one is a warning, not an error.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DUMP_ENV = "ZCOMPILE_DUMP"
PASSES_FILE = "passes.json"
SHARDING_PLAN_FILE = "plan.json"
REPORT_FILE = "report.json"
GRAPH_KINDS = ("dynamo", "joint", "forward", "backward", "inference")
COLLECTIVE_GRAPHS = ("forward", "backward")  # the graphs whose collectives a step runs


def resolve_dump_root(option: str | None) -> str | None:
    """The dump directory: the option, else ``$ZCOMPILE_DUMP``, else none."""
    return option or os.environ.get(DUMP_ENV) or None


def rank_dir(root: str | os.PathLike, rank: int) -> Path:
    return Path(root) / f"rank{rank}"


def graph_id_of(compile_id: Any) -> str:
    """Dynamo's compile id (``0/1``) as a folder name (``0_1``)."""
    return re.sub(r"[^0-9A-Za-z]+", "_", str(compile_id)).strip("_") or "unknown"


def pass_graph_file(index: int, pass_name: str, graph: str, when: str) -> str:
    """The readable graph ``when`` (``before`` or ``after``) pass number ``index``."""
    return f"{index:02d}_{pass_name}.{graph}.{when}.txt"


def plan_file(plan_name: str, graph: str) -> str:
    """A pass's plan: ``buckets.forward.json``; a joint-graph plan has no graph suffix (``keep_gathered.json``)."""
    return f"{plan_name}.json" if graph == "joint" else f"{plan_name}.{graph}.json"


def collectives_file(graph: str) -> str:
    return f"collectives.{graph}.json"


def report_path(root: str | os.PathLike, rank: int) -> Path:
    return rank_dir(root, rank) / REPORT_FILE


# ----------------------------------------------------------------------------- writing
@dataclass
class GraphDumpWriter:
    """Writes the artifacts of one Dynamo graph (``None`` folder: trace_structured only when tracing)."""

    graph_id: str
    folder: Path | None = None

    @classmethod
    def create(cls, root: str | None, rank: int, graph_id: str) -> GraphDumpWriter:
        folder = None
        if root:
            folder = rank_dir(root, rank) / graph_id
            folder.mkdir(parents=True, exist_ok=True)
        return cls(graph_id, folder)

    @property
    def enabled(self) -> bool:
        return self.folder is not None

    def write_text(self, filename: str, text: str) -> None:
        if self.folder is None:
            return
        (self.folder / filename).write_text(text)
        torch._logging.trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": f"zcompile_{self.graph_id}_{filename}", "encoding": "string"},
            payload_fn=lambda: text,
        )

    def write_json(self, filename: str, data: Any) -> None:
        if self.folder is not None:
            self.write_text(filename, json.dumps(data, indent=1, default=str))


# ----------------------------------------------------------------------------- reading
class DumpError(Exception):
    """The directory is missing or holds no ``rank*/`` folders."""


@dataclass
class GraphDump:
    graph_id: str
    plan: dict | None = None
    passes: list[dict] = field(default_factory=list)
    collectives: list[dict] = field(default_factory=list)  # forward then backward records


@dataclass
class RankDump:
    rank: int
    graphs: dict[str, GraphDump]
    report: dict | None


def graph_order(graph_id: str) -> tuple:
    """Sort key of graph ids: numerically by frame, then compile."""
    return tuple(int(n) for n in re.findall(r"\d+", graph_id)), graph_id


def _read_json(path: Path, expected: type, warnings: list[str]) -> Any:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        warnings.append(f"{path}: unreadable ({error})")
        return None
    if not isinstance(data, expected):
        warnings.append(f"{path}: expected a JSON {expected.__name__}, got {type(data).__name__}")
        return None
    return data


def _read_records(path: Path, warnings: list[str]) -> list[dict]:
    records = _read_json(path, list, warnings) or []
    if not all(isinstance(r, dict) for r in records):
        warnings.append(f"{path}: entries that are not JSON objects skipped")
    return [r for r in records if isinstance(r, dict)]


def _read_rank(rank: int, path: Path, warnings: list[str]) -> RankDump:
    graphs = {}
    for folder in sorted((p for p in path.iterdir() if p.is_dir()), key=lambda p: graph_order(p.name)):
        graph = GraphDump(
            folder.name,
            _read_json(folder / SHARDING_PLAN_FILE, dict, warnings),
            _read_records(folder / PASSES_FILE, warnings),
        )
        for kind in COLLECTIVE_GRAPHS:
            records = _read_records(folder / collectives_file(kind), warnings)
            graph.collectives += [{"where": kind, **record} for record in records]
        graphs[folder.name] = graph
    return RankDump(rank, graphs, _read_json(path / REPORT_FILE, dict, warnings))


def load_dump(root: str | Path, warnings: list[str]) -> dict[int, RankDump]:
    """Every ``rank{R}/`` of ``root`` (or ``root`` itself when it is a ``rank{R}`` folder), by rank."""
    root = Path(root)
    if not root.is_dir():
        raise DumpError(f"{root}: no such directory")
    ranks = {int(m.group(1)): p for p in root.iterdir() if p.is_dir() and (m := re.fullmatch(r"rank(\d+)", p.name))}
    if not ranks and (m := re.fullmatch(r"rank(\d+)", root.name)):
        ranks = {int(m.group(1)): root}
    if not ranks:
        raise DumpError(f"{root}: not a zcompile dump (no rank*/ folders); write one with options={{'dump': DIR}}")
    return {rank: _read_rank(rank, ranks[rank], warnings) for rank in sorted(ranks)}
