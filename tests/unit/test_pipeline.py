"""The pipeline table: its order constraints, which rows run for which options, plans and dumps.

Runs ``run_passes`` on a hand-built aten graph (3 all-gathers, a reduce-scatter) with a context
made by hand, so no process is launched: what runs is read from the runner's records, the graph
and the dump folder.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from support.hand_built import layered_graph
from zcompile.backend.compiled import CompileContext
from zcompile.backend.pass_runner import PassRunner
from zcompile.backend.pipeline import PIPELINE, PassRow, check_table, run_passes
from zcompile.backend.zeropp import ZeroPPSettings
from zcompile.common.dumps import GraphDumpWriter
from zcompile.common.process_group import DataParallelGroup
from zcompile.config import ZeroConfig
from zcompile.passes.collectives import ALL_GATHER, collective_nodes
from zcompile.passes.param_collectives import ShardingPlan

REPO = Path(__file__).resolve().parents[2]


def _context(folder: Path | None = None, **options) -> CompileContext:
    config = ZeroConfig(**options)
    group = DataParallelGroup(rank=0, world_size=2, name="0", process_group=None)
    sharding = ShardingPlan(config.stage, 2, "0", None, None)
    return CompileContext(config, group, sharding, ZeroPPSettings(), PassRunner(GraphDumpWriter("0_0", folder)))


def _ran(context: CompileContext) -> list[tuple[str, str]]:
    return [(r.name, r.graph) for r in context.runner.records]


def test_table_order_is_consistent():
    check_table()
    rows = {row.name: row for row in PIPELINE}
    late = replace(rows["schedule"], name="early_schedule")
    with pytest.raises(ValueError, match="must run after 'bucket_collectives'"):
        check_table((late,) + PIPELINE)
    with pytest.raises(ValueError, match="not in the table"):
        check_table((PassRow("orphan", ("forward",), lambda gm: gm, after=("nowhere",)),))


def test_every_pass_in_passes_is_a_row():
    """A ``*_pass`` function no row runs is dead or forgotten."""
    defined = set()
    for path in (REPO / "passes").glob("*.py"):
        defined |= set(re.findall(r"^def (\w+_pass)\(", path.read_text(), flags=re.M))
    assert defined == {row.apply.__name__ for row in PIPELINE}


def test_rows_follow_the_options():
    everything = _context(bucket_mb=4.0, overlap=True)
    gm = run_passes(everything, "forward", layered_graph())
    assert _ran(everything) == [
        ("remove_unused_gathers", "forward"),
        ("drop_identity_views", "forward"),
        ("bucket_collectives", "forward"),
        ("schedule", "forward"),
    ]
    assert sorted(everything.plans) == ["buckets.forward", "schedule.forward"]
    assert len([c for c in collective_nodes(gm) if c.kind == "all_gather"]) == 1  # 3 gathers, one bucket

    plain = _context(bucket_mb=0, overlap=False)
    gm = run_passes(plain, "forward", layered_graph())
    assert _ran(plain) == [("remove_unused_gathers", "forward"), ("drop_identity_views", "forward")]
    assert plain.plans == {}
    assert len(gm.graph.find_nodes(op="call_function", target=ALL_GATHER)) == 3

    # Dynamo-graph rows: stage 1 inserts nothing, no param_dtype means no autocast
    dynamo = _context(stage=1)
    run_passes(dynamo, "dynamo", layered_graph())
    assert _ran(dynamo) == []


def test_plans_and_graphs_are_dumped(tmp_path):
    context = _context(tmp_path, bucket_mb=4.0, overlap=True)
    run_passes(context, "backward", layered_graph())
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "buckets.backward.json" in files and "schedule.backward.json" in files
    assert "04_bucket_collectives.backward.before.txt" in files and "05_schedule.backward.after.txt" in files
    dumped = json.loads((tmp_path / "buckets.backward.json").read_text())
    assert dumped == json.loads(context.plans["buckets.backward"].to_json())
    assert len(dumped["buckets"]) == 1 and len(dumped["buckets"][0]["members"]) == 3
