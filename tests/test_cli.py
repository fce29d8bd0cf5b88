"""zcompile.cli: ``inspect`` and ``diff`` over dump directories written here by hand to the dump
layout (see zcompile/cli.py), plain and rich output, bad paths, and ``python -m zcompile``."""

import copy
import json
import os
import subprocess
import sys

import pytest

from zcompile.cli.commands import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rec(kind, elements, where, param, itemsize=4):
    return {
        "kind": kind,
        "elements": elements,
        "bytes": elements * itemsize,
        "dtype": "torch.float32",
        "where": where,
        "params": [param],
    }


def _pass(index, name, graph, seconds, before, after):
    return {
        "index": index,
        "pass": name,
        "graph": graph,
        "seconds": seconds,
        "nodes_before": before,
        "nodes_after": after,
        "added": {},
        "removed": {},
    }


def _graphs():
    """Two Dynamo graphs of a stage-3 run: what each file of the dump holds."""
    params = [
        {"index": i, "name": n, "shape": s, "requires_grad": True, "dtype": "torch.float32"}
        for i, (n, s) in enumerate([("wte.weight", [256, 32]), ("h.0.w", [32, 32]), ("h.0.b", [32])])
    ]
    return {
        "0_0": {
            "plan": {
                "stage": 3,
                "world_size": 2,
                "group_name": "0",
                "param_dtype": "None",
                "reduce_dtype": "None",
                "params": params,
            },
            "passes": [
                _pass(0, "insert_param_collectives", "dynamo", 0.0012, 40, 95),
                _pass(1, "autocast", "dynamo", 0.0003, 95, 95),
                _pass(2, "remove_unused_gathers", "forward", 0.0021, 120, 118),
                _pass(3, "remove_unused_gathers", "backward", 0.0040, 300, 290),
            ],
            "forward": [
                _rec("all_gather", 8192, "forward", "wte.weight"),
                _rec("all_gather", 1024, "forward", "h.0.w"),
                _rec("all_gather", 32, "forward", "h.0.b"),
            ],
            "backward": [
                _rec("all_gather", 8192, "backward", "wte.weight"),
                _rec("reduce_scatter", 8192, "backward", "wte.weight"),
                _rec("reduce_scatter", 1024, "backward", "h.0.w"),
                _rec("reduce_scatter", 32, "backward", "h.0.b"),
            ],
        },
        "1_0": {
            "plan": {
                "stage": 3,
                "world_size": 2,
                "group_name": "0",
                "param_dtype": "None",
                "reduce_dtype": "None",
                "params": params[:1],
            },
            "passes": [_pass(0, "insert_param_collectives", "dynamo", 0.0005, 10, 21)],
            "forward": [_rec("all_gather", 8192, "forward", "wte.weight")],
            "backward": [_rec("reduce_scatter", 8192, "backward", "wte.weight")],
        },
    }


REPORT = {
    "stage": 3,
    "world_size": 2,
    "num_params": 9248,
    "collectives": [_rec("all_gather", 9248, "forward", "all")],
    "totals": {"all_gather": 17440, "reduce_scatter": 9248, "total": 26688},
    "formula_elements": 27744,
    "memory": {"model_states_bytes": 74240, "formula_bytes": 73984, "peak_gathered_bytes": 36864},
}


def write_dump(root, graphs=None, ranks=(0, 1), report=REPORT):
    graphs = _graphs() if graphs is None else graphs
    for rank in ranks:
        for gid, g in graphs.items():
            folder = root / f"rank{rank}" / gid
            folder.mkdir(parents=True)
            (folder / "plan.json").write_text(json.dumps(g["plan"]))
            (folder / "passes.json").write_text(json.dumps(g["passes"]))
            for kind in ("forward", "backward"):
                (folder / f"collectives.{kind}.json").write_text(json.dumps(g[kind]))
            for p in g["passes"]:
                stem = f"{p['index']:02d}_{p['pass']}.{p['graph']}"
                (folder / f"{stem}.before.txt").write_text("graph():\n")
                (folder / f"{stem}.after.txt").write_text("graph():\n")
        if report is not None:
            (root / f"rank{rank}" / "report.json").write_text(json.dumps(report))
    return root


def totals(graphs, kind=None):
    records = [r for g in graphs.values() for w in ("forward", "backward") for r in g[w] if kind in (None, r["kind"])]
    return len(records), sum(r["elements"] for r in records), sum(r["bytes"] for r in records)


def run(capsys, *argv):
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def row(out, first):
    """The cells of the plain-text table row starting with ``first``."""
    return next(line.split() for line in out.splitlines() if line.split()[:1] == [first])


# ----------------------------------------------------------------------------- inspect
def test_inspect_shows_the_dump(tmp_path, capsys):
    graphs = _graphs()
    status, out, err = run(capsys, "inspect", "--plain", str(write_dump(tmp_path, graphs)))
    assert status == 0 and err == ""
    assert "2 ranks agree" in out
    for kind in ("all_gather", "reduce_scatter", None):
        count, elements, nbytes = totals(graphs, kind)
        assert row(out, kind or "total") == [kind or "total", str(count), f"{elements:,}", f"{nbytes:,}"]
    assert row(out, "0_0")[:6] == ["0_0", "3", "2", "3", "4", "7.60"]  # stage, world, params, passes, ms
    assert row(out, "1_0")[:6] == ["1_0", "3", "2", "1", "1", "0.50"]
    # passes in order, with time and node delta
    passes = [line.split() for line in out.splitlines() if "_gathers" in line or "_collectives" in line]
    assert [p[2] for p in passes] == [
        "insert_param_collectives",
        "remove_unused_gathers",
        "remove_unused_gathers",
        "insert_param_collectives",
    ]
    assert ["0_0", "0", "insert_param_collectives", "dynamo", "1.20", "40", "->", "95", "+55"] in passes
    assert ["0_0", "3", "remove_unused_gathers", "backward", "4.00", "300", "->", "290", "-10"] in passes
    # per graph and where: forward of 0_0 gathers 3 tensors
    per_graph = [line.split() for line in out.splitlines() if line.split()[:1] in (["0_0"], ["1_0"])]
    assert ["0_0", "forward", "all_gather", "3", "9,248", "36,992"] in per_graph
    assert ["0_0", "backward", "reduce_scatter", "3", "9,248", "36,992"] in per_graph


def test_inspect_report(tmp_path, capsys):
    status, out, _ = run(capsys, "inspect", "--plain", str(write_dump(tmp_path)))
    assert status == 0
    assert "Ψ = 9,248 parameters" in out
    assert row(out, "formula") == ["formula", "27,744", "3.000"]
    assert f"total / formula = {26688 / 27744:.3f}" in out
    assert "74,240 B  0.07 MiB" in out and "peak_gathered_bytes" in out
    assert f"model states / formula = {74240 / 73984:.3f}" in out


def test_inspect_rich(tmp_path, capsys):
    pytest.importorskip("rich")
    graphs = _graphs()
    status, out, _ = run(capsys, "inspect", str(write_dump(tmp_path, graphs)))
    assert status == 0
    count, elements, nbytes = totals(graphs)
    assert row(out, "total") == ["total", str(count), f"{elements:,}", f"{nbytes:,}"]
    assert max(len(line) for line in out.splitlines()) <= 100


def test_inspect_fits_100_columns(tmp_path, capsys):
    graphs = _graphs()
    graphs["0_0"]["passes"].append(_pass(4, "a_pass_with_a_very_long_name_" * 4, "backward", 0.1, 290, 290))
    status, out, _ = run(capsys, "inspect", "--plain", str(write_dump(tmp_path, graphs)))
    assert status == 0 and max(len(line) for line in out.splitlines()) <= 100


def test_inspect_notes_ranks_that_differ(tmp_path, capsys):
    write_dump(tmp_path, ranks=(0,))
    fewer = _graphs()
    del fewer["1_0"]
    fewer["0_0"]["forward"] = fewer["0_0"]["forward"][:2]
    fewer["0_0"]["passes"][-1]["nodes_after"] = 280
    write_dump(tmp_path, fewer, ranks=(1,))
    status, out, _ = run(capsys, "inspect", "--plain", str(tmp_path))
    assert status == 0
    assert "WARNING: ranks differ" in out
    assert "rank 1 has graphs 0_0, rank 0 has 0_0, 1_0" in out
    assert "rank 1 graph 0_0: collectives differ from rank 0" in out
    assert "rank 1 graph 0_0: nodes differ from rank 0" in out


def test_inspect_rank_selection(tmp_path, capsys):
    write_dump(tmp_path)
    status, out, _ = run(capsys, "inspect", "--plain", str(tmp_path), "--all-ranks")
    assert status == 0 and "Graphs (rank 0)" in out and "Graphs (rank 1)" in out
    status, out, _ = run(capsys, "inspect", "--plain", str(tmp_path), "--rank", "1")
    assert status == 0 and "Graphs (rank 1)" in out and "Graphs (rank 0)" not in out
    status, out, _ = run(capsys, "inspect", "--plain", str(tmp_path / "rank1"))  # a rank folder itself
    assert status == 0 and "Graphs (rank 1)" in out
    status, out, _ = run(capsys, "diff", "--plain", str(tmp_path / "rank0"), str(tmp_path / "rank1"))  # two ranks
    assert status == 0 and "(rank 0)" in out and "(rank 1)" in out and "Passes: the same in A and B" in out


def test_inspect_tolerates_missing_and_broken_files(tmp_path, capsys):
    graphs = _graphs()
    write_dump(tmp_path, graphs, ranks=(0,), report=None)
    (tmp_path / "rank0" / "0_0" / "plan.json").unlink()
    (tmp_path / "rank0" / "0_0" / "collectives.backward.json").write_text("{not json")
    (tmp_path / "rank0" / "1_0" / "passes.json").write_text('{"a": 1}')
    (tmp_path / "rank0" / "1_0" / "collectives.forward.json").write_text('[1, {"kind": "all_gather", "bytes": "x"}]')
    status, out, err = run(capsys, "inspect", "--plain", str(tmp_path))
    assert status == 0
    assert "collectives.backward.json: unreadable" in err and "expected a JSON list" in err
    assert "entries that are not JSON objects skipped" in err
    assert row(out, "0_0")[:5] == ["0_0", "-", "-", "-", "4"]
    count, elements, nbytes = totals(graphs)
    # lost: 0_0's backward (broken file); 1_0's forward gather became one without elements or bytes
    lost = totals(
        {"0_0": {"forward": [], "backward": graphs["0_0"]["backward"]}, "1_0": {"forward": [], "backward": []}}
    )
    lost_1_0 = totals({"1_0": {"forward": graphs["1_0"]["forward"], "backward": []}})
    assert row(out, "total") == [
        "total",
        str(count - lost[0]),
        f"{elements - lost[1] - lost_1_0[1]:,}",
        f"{nbytes - lost[2] - lost_1_0[2]:,}",
    ]
    assert "Step report" not in out


# ----------------------------------------------------------------------------- diff
def test_diff(tmp_path, capsys):
    a = write_dump(tmp_path / "a")
    changed = _graphs()
    g = changed["0_0"]
    g["passes"].insert(2, _pass(2, "bucket_gathers", "forward", 0.001, 118, 112))
    g["passes"][3:] = [
        _pass(3, "remove_unused_gathers", "forward", 0.0021, 112, 110),
        _pass(4, "remove_unused_gathers", "backward", 0.0040, 300, 290),
    ]
    g["forward"] = [_rec("all_gather", 8192 + 1024 + 32, "forward", "bucket")]  # 3 gathers bucketed into 1
    report = copy.deepcopy(REPORT)
    report["memory"]["peak_gathered_bytes"] = 2 * 36864
    b = write_dump(tmp_path / "b", changed, report=report)
    status, out, err = run(capsys, "diff", "--plain", str(a), str(b))
    assert status == 0 and err == ""
    assert row(out, "0_0") == ["0_0", "-", "bucket_gathers", "(forward)"]  # passes: only in B
    nodes = [line.split() for line in out.splitlines() if line.split()[:2] == ["0_0", "forward"]]
    assert ["0_0", "forward", "118", "110", "-8"] in nodes
    assert ["0_0", "forward", "all_gather", "3", "1", "36,992", "36,992", "1.000"] in nodes
    assert row(out, "all_gather") == ["all_gather", "5", "3", "25,632", "25,632", "102,528", "102,528", "1.000"]
    assert row(out, "memory.peak_gathered_bytes") == ["memory.peak_gathered_bytes", "36,864", "73,728", "2.000"]
    assert row(out, "totals.total") == ["totals.total", "26,688", "26,688", "1.000"]


def test_diff_graphs_only_on_one_side(tmp_path, capsys):
    a = write_dump(tmp_path / "a")
    fewer = _graphs()
    del fewer["1_0"]
    b = write_dump(tmp_path / "b", fewer, report=None)
    status, out, _ = run(capsys, "diff", "--plain", str(a), str(b))
    assert status == 0
    assert "graphs only in A: 1_0" in out
    assert ["1_0", "dynamo", "21", "-", "-"] in [line.split() for line in out.splitlines()]
    assert row(out, "reduce_scatter")[5:] == [
        f"{(8192 + 1024 + 32 + 8192) * 4:,}",
        f"{(8192 + 1024 + 32) * 4:,}",
        f"{(8192 + 1024 + 32) / (8192 + 1024 + 32 + 8192):.3f}",
    ]
    assert row(out, "memory.model_states_bytes") == ["memory.model_states_bytes", "74,240", "-", "-"]


# ----------------------------------------------------------------------------- errors and entry points
def test_bad_paths_exit_2(tmp_path, capsys):
    write_dump(tmp_path / "dump")
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    for argv, message in [
        (["inspect", str(tmp_path / "missing")], "no such directory"),
        (["inspect", str(tmp_path / "file")], "no such directory"),
        (["inspect", str(tmp_path / "empty")], "not a zcompile dump"),
        (["inspect", str(tmp_path / "dump"), "--rank", "5"], "no rank 5 (ranks: 0, 1)"),
        (["diff", str(tmp_path / "dump"), str(tmp_path / "missing")], "no such directory"),
    ]:
        status, out, err = run(capsys, *argv)
        assert status == 2 and message in err and out == "", argv
    with pytest.raises(SystemExit) as exit_info:  # argparse: usage errors exit 2 too
        main(["inspect"])
    assert exit_info.value.code == 2


def test_python_m_zcompile(tmp_path):
    graphs = _graphs()
    write_dump(tmp_path, graphs)
    env = {**os.environ, "PYTHONPATH": REPO}
    done = subprocess.run(
        [sys.executable, "-m", "zcompile", "inspect", "--plain", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    count, elements, nbytes = totals(graphs)
    assert row(done.stdout, "total") == ["total", str(count), f"{elements:,}", f"{nbytes:,}"]
    done = subprocess.run(
        [sys.executable, "-m", "zcompile", "inspect", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2 and "no such directory" in done.stderr


def test_console_script():
    from importlib.metadata import entry_points

    scripts = [e for e in entry_points(group="console_scripts") if e.name == "zcompile"]
    if not scripts:
        pytest.skip("the zcompile console script is not installed (pip install -e . again)")
    assert scripts[0].value == "zcompile.cli:main"
