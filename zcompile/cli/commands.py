"""``zcompile inspect DIR`` and ``zcompile diff DIR_A DIR_B`` read the backend's dump directories;
``zcompile consolidate CKPT OUT`` writes a checkpoint's full weights to one file (no process group);
``zcompile tune-report tune.json`` prints a result saved by ``zcompile.tune`` again.

The dump's layout and its loader are ``zcompile.common.dumps``.
Every file may be missing; an unreadable one is a warning on stderr. Tables fit 100 columns and
use ``rich`` when it is installed (``pip install zcompile[inspect]``), plain text otherwise.
Exit status: 0, or 2 when a directory is missing or is not a dump.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter, defaultdict
from typing import Any

from zcompile.cli.plan import add_parser as add_plan_parser
from zcompile.cli.plan import cmd_plan
from zcompile.cli.simulate import add_parser as add_simulate_parser
from zcompile.cli.simulate import cmd_simulate
from zcompile.common.dumps import GRAPH_KINDS, DumpError, GraphDump, RankDump, graph_order, load_dump
from zcompile.passes.collectives import KINDS

WIDTH = 100
WHERE = ("forward", "backward", "optimizer")


# ----------------------------------------------------------------------------- summaries (plain data)
def collective_summary(records: list[dict]) -> dict[tuple[str, str], list[int]]:
    """``{(where, kind): [count, elements, bytes]}``."""
    summary: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    for record in records:
        row = summary[(str(record.get("where", "?")), str(record.get("kind", "?")))]
        row[0] += 1
        row[1] += _int(record.get("elements"))
        row[2] += _int(record.get("bytes"))
    return dict(summary)


def totals_by_kind(records: list[dict]) -> dict[str, list[int]]:
    """``{kind: [count, elements, bytes]}`` plus ``"total"``."""
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for (_, kind), row in collective_summary(records).items():
        for key in (kind, "total"):
            totals[key] = [a + b for a, b in zip(totals[key], row)]
    return dict(sorted(totals.items(), key=lambda kv: (kv[0] == "total", _kind_order(kv[0]))))


def _num(value: Any) -> float:
    """``value`` if it is a number, else 0 (a tolerant reader)."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def _int(value: Any) -> int:
    return int(_num(value))


def _kind_order(kind: str) -> int:
    return KINDS.index(kind) if kind in KINDS else len(KINDS)


def _where_kind_order(key: tuple[str, str]) -> tuple:
    where, kind = key
    return (WHERE.index(where) if where in WHERE else len(WHERE), where, _kind_order(kind), kind)


def nodes_after_last_pass(passes: list[dict]) -> dict[str, int]:
    """``{graph kind: nodes after the last pass on it}``."""
    last: dict[str, dict] = {}
    for record in sorted(passes, key=lambda r: r.get("index", 0)):
        last[str(record.get("graph", "?"))] = record
    order = sorted(last, key=lambda k: (GRAPH_KINDS.index(k) if k in GRAPH_KINDS else len(GRAPH_KINDS), k))
    return {kind: _int(last[kind].get("nodes_after")) for kind in order}


def rank_differences(ranks: dict[int, RankDump]) -> list[str]:
    """How each rank differs from the first: graphs, passes, nodes, plan size, collectives, report totals."""

    def signature(dump: RankDump) -> dict:
        sig = {}
        for gid, graph in dump.graphs.items():
            sig[gid] = {
                "passes": [r.get("pass") for r in graph.passes],
                "nodes": nodes_after_last_pass(graph.passes),
                "params": len((graph.plan or {}).get("params", [])),
                "collectives": collective_summary(graph.collectives),
            }
        return sig

    first, *others = sorted(ranks)
    base, notes = signature(ranks[first]), []
    for rank in others:
        sig = signature(ranks[rank])
        if set(sig) != set(base):
            notes.append(f"rank {rank} has graphs {_ids(sig)}, rank {first} has {_ids(base)}")
        for gid in sorted(set(sig) & set(base), key=graph_order):
            for what in ("passes", "nodes", "params", "collectives"):
                if sig[gid][what] != base[gid][what]:
                    notes.append(f"rank {rank} graph {gid}: {what} differ from rank {first}")
        totals = [(ranks[r].report or {}).get("totals") for r in (first, rank)]
        if totals[0] != totals[1]:
            notes.append(f"rank {rank}: report totals {totals[1]} vs rank {first} {totals[0]}")
    return notes


def _ids(sig: dict) -> str:
    return ", ".join(sorted(sig, key=graph_order)) or "none"


# ----------------------------------------------------------------------------- output
def _n(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _ratio(a: Any, b: Any) -> str:
    return f"{b / a:.3f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else "-"


def _mib(nbytes: Any) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if isinstance(nbytes, (int, float)) else "-"


class Output:
    """Headings, lines and tables on stdout: rich tables when available, aligned text otherwise."""

    def __init__(self, plain: bool):
        self.console = None
        if not plain:
            try:
                from rich.console import Console
            except ImportError:
                pass
            else:
                self.console = Console(file=sys.stdout, width=WIDTH, highlight=False, emoji=False)

    def line(self, text: str = "") -> None:
        if self.console is not None:
            self.console.print(text, markup=False)
        else:
            print(text)

    def table(self, title: str, headers: list[str], rows: list[list[Any]], numeric: set[int] = frozenset()) -> None:
        cells = [[_n(v) for v in row] for row in rows]
        if self.console is not None:
            from rich.box import SIMPLE_HEAD
            from rich.table import Table

            self.console.print(title, style="bold", markup=False)
            table = Table(box=SIMPLE_HEAD, header_style="bold", pad_edge=False, show_edge=False)
            for i, header in enumerate(headers):
                table.add_column(header, justify="right" if i in numeric else "left", overflow="fold")
            for row in cells:
                table.add_row(*row)
            self.console.print(table)
            self.console.print()
            return
        widths = [max(len(c) for c in column) for column in zip(headers, *cells)]
        while sum(widths) + 2 * len(widths) > WIDTH and max(widths) > 12:  # trim the widest column
            widest = widths.index(max(widths))
            widths[widest] -= 1
        print(title)
        for row in [headers, ["-" * w for w in widths], *cells]:
            parts = [
                (c if len(c) <= w else c[: w - 1] + "~").rjust(w)
                if i in numeric
                else (c if len(c) <= w else c[: w - 1] + "~").ljust(w)
                for i, (c, w) in enumerate(zip(row, widths))
            ]
            print("  " + "  ".join(parts).rstrip())
        print()


# ----------------------------------------------------------------------------- inspect
def _pick_rank(path: str, ranks: dict[int, RankDump], rank: int | None) -> int:
    """``rank``, or the lowest rank of the dump when it is None."""
    if rank is None:
        return min(ranks)
    if rank not in ranks:
        raise DumpError(f"{path}: no rank {rank} (ranks: {', '.join(map(str, ranks))})")
    return rank


def _pick_dump(path: str, ranks: dict[int, RankDump], rank: int | None) -> RankDump:
    return ranks[_pick_rank(path, ranks, rank)]


def inspect_rank(out: Output, dump: RankDump) -> None:
    graphs = list(dump.graphs.values())
    out.table(
        f"Graphs (rank {dump.rank})",
        ["graph", "stage", "world", "params", "passes", "pass ms", "nodes after"],
        [
            [
                g.graph_id,
                (g.plan or {}).get("stage"),
                (g.plan or {}).get("world_size"),
                len((g.plan or {}).get("params", [])) if g.plan else None,
                len(g.passes),
                round(sum(_num(r.get("seconds")) for r in g.passes) * 1e3, 2),
                ", ".join(f"{k} {v:,}" for k, v in nodes_after_last_pass(g.passes).items()),
            ]
            for g in graphs
        ],
        numeric={1, 2, 3, 4, 5},
    )
    rows = []
    for g in graphs:
        for r in sorted(g.passes, key=lambda r: r.get("index", 0)):
            before, after = r.get("nodes_before"), r.get("nodes_after")
            delta = f"{after - before:+,}" if isinstance(before, int) and isinstance(after, int) else "-"
            rows.append(
                [
                    g.graph_id,
                    r.get("index"),
                    r.get("pass"),
                    r.get("graph"),
                    round(_num(r.get("seconds")) * 1e3, 2),
                    f"{_n(before)} -> {_n(after)}",
                    delta,
                ]
            )
    out.table("Passes, in order", ["graph", "#", "pass", "on", "ms", "nodes", "delta"], rows, numeric={1, 4, 5, 6})
    rows = [
        [g.graph_id, where, kind, *row]
        for g in graphs
        for (where, kind), row in sorted(
            collective_summary(g.collectives).items(), key=lambda kv: _where_kind_order(kv[0])
        )
    ]
    out.table(
        "Collectives per graph", ["graph", "where", "kind", "count", "elements", "bytes"], rows, numeric={3, 4, 5}
    )
    everything = [r for g in graphs for r in g.collectives]
    out.table(
        "Totals (graphs)",
        ["kind", "count", "elements", "bytes"],
        [[kind, *row] for kind, row in totals_by_kind(everything).items()],
        numeric={1, 2, 3},
    )
    if dump.report is not None:
        inspect_report(out, dump.report)


def inspect_report(out: Output, report: dict) -> None:
    psi = report.get("num_params")
    out.line(
        f"Step report: stage {_n(report.get('stage'))}, world {_n(report.get('world_size'))}, Ψ = {_n(psi)} parameters"
    )
    step = report.get("collectives") or []
    out.table(
        "Step collectives (report.json)",
        ["where", "kind", "count", "elements", "bytes"],
        [
            [where, kind, *row]
            for (where, kind), row in sorted(collective_summary(step).items(), key=lambda kv: _where_kind_order(kv[0]))
        ],
        numeric={2, 3, 4},
    )
    totals, formula = report.get("totals") or {}, report.get("formula_elements")
    rows = [
        [kind, value, f"{value / psi:.3f}" if psi and isinstance(value, (int, float)) else "-"]
        for kind, value in totals.items()
    ]
    rows.append(["formula", formula, f"{formula / psi:.3f}" if psi and isinstance(formula, (int, float)) else "-"])
    out.table("Elements per step vs ZeRO's formula", ["", "elements", "Ψ"], rows, numeric={1, 2})
    out.line(f"total / formula = {_ratio(formula, totals.get('total'))}")
    memory = report.get("memory") or {}
    for key, value in memory.items():
        out.line(f"memory {key:<22} {_n(value):>14} B  {_mib(value)}")
    if "model_states_bytes" in memory and "formula_bytes" in memory:
        out.line(f"model states / formula = {_ratio(memory['formula_bytes'], memory['model_states_bytes'])}")
    out.line()


def cmd_inspect(args: argparse.Namespace, out: Output, warnings: list[str]) -> int:
    ranks = load_dump(args.dir, warnings)
    chosen = sorted(ranks) if args.all_ranks else [_pick_rank(args.dir, ranks, args.rank)]
    out.line(f"zcompile dump {args.dir}: ranks {', '.join(map(str, ranks))}")
    notes = rank_differences(ranks)
    if notes:
        out.line("WARNING: ranks differ (every rank must compile the same graphs and collectives):")
        for note in notes[:20]:
            out.line(f"  {note}")
        if len(notes) > 20:
            out.line(f"  ... and {len(notes) - 20} more")
    elif len(ranks) > 1:
        out.line(f"{len(ranks)} ranks agree on graphs, passes, plans and collectives")
    out.line()
    for rank in chosen:
        inspect_rank(out, ranks[rank])
    return 0


# ----------------------------------------------------------------------------- diff
def cmd_diff(args: argparse.Namespace, out: Output, warnings: list[str]) -> int:
    a, b = (_pick_dump(path, load_dump(path, warnings), args.rank) for path in (args.dir_a, args.dir_b))
    out.line(f"A = {args.dir_a} (rank {a.rank})\nB = {args.dir_b} (rank {b.rank})")
    ids = sorted(set(a.graphs) | set(b.graphs), key=graph_order)
    for label, mine, theirs in (("A", a, b), ("B", b, a)):
        only = [gid for gid in ids if gid in mine.graphs and gid not in theirs.graphs]
        if only:
            out.line(f"graphs only in {label}: {', '.join(only)}")
    empty = GraphDump("")
    ga = {gid: a.graphs.get(gid, empty) for gid in ids}
    gb = {gid: b.graphs.get(gid, empty) for gid in ids}

    rows = []
    for gid in ids:
        pa, pb = (Counter(f"{r.get('pass')} ({r.get('graph')})" for r in g[gid].passes) for g in (ga, gb))
        if pa != pb:
            rows.append(
                [gid, ", ".join(sorted((pa - pb).elements())) or "-", ", ".join(sorted((pb - pa).elements())) or "-"]
            )
    if rows:
        out.table("Passes", ["graph", "only in A", "only in B"], rows)
    else:
        out.line("Passes: the same in A and B\n")
    rows = []
    for gid in ids:
        na, nb = nodes_after_last_pass(ga[gid].passes), nodes_after_last_pass(gb[gid].passes)
        for kind in dict.fromkeys([*na, *nb]):
            delta = nb[kind] - na[kind] if kind in na and kind in nb else None
            rows.append([gid, kind, na.get(kind), nb.get(kind), f"{delta:+,}" if delta is not None else "-"])
    out.table("Nodes after the last pass", ["graph", "graph kind", "A", "B", "B - A"], rows, numeric={2, 3, 4})
    rows = []
    for gid in ids:
        sa, sb = collective_summary(ga[gid].collectives), collective_summary(gb[gid].collectives)
        for key in sorted(set(sa) | set(sb), key=_where_kind_order):
            ra, rb = sa.get(key, [0, 0, 0]), sb.get(key, [0, 0, 0])
            rows.append([gid, *key, ra[0], rb[0], ra[2], rb[2], _ratio(ra[2], rb[2])])
    out.table(
        "Collectives",
        ["graph", "where", "kind", "count A", "count B", "bytes A", "bytes B", "B/A"],
        rows,
        numeric={3, 4, 5, 6, 7},
    )
    ta, tb = (totals_by_kind([r for g in graphs.values() for r in g.collectives]) for graphs in (ga, gb))
    rows = []
    for kind in sorted(set(ta) | set(tb), key=lambda k: (k == "total", _kind_order(k))):
        ra, rb = ta.get(kind, [0, 0, 0]), tb.get(kind, [0, 0, 0])
        rows.append([kind, ra[0], rb[0], ra[1], rb[1], ra[2], rb[2], _ratio(ra[2], rb[2])])
    headers = ["kind", "count A", "count B", "elements A", "elements B", "bytes A", "bytes B", "B/A"]
    out.table("Totals (graphs)", headers, rows, numeric={1, 2, 3, 4, 5, 6, 7})
    if a.report is not None or b.report is not None:
        rows = []
        for section in ("totals", "memory"):
            sa, sb = ((d.report or {}).get(section) or {} for d in (a, b))
            for key in list(dict.fromkeys([*sa, *sb])):
                rows.append([f"{section}.{key}", sa.get(key), sb.get(key), _ratio(sa.get(key), sb.get(key))])
        ra, rb = ((d.report or {}).get("formula_elements") for d in (a, b))
        rows.append(["formula_elements", ra, rb, _ratio(ra, rb)])
        out.table("Step report (report.json)", ["", "A", "B", "B/A"], rows, numeric={1, 2, 3})
    return 0


# ----------------------------------------------------------------------------- entry point
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zcompile", description="Read zcompile's dumps and checkpoints.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--plain", action="store_true", help="plain text tables even when rich is installed")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", parents=[common], help="graphs, passes and collectives of a dump")
    inspect.add_argument("dir")
    ranks = inspect.add_mutually_exclusive_group()
    ranks.add_argument("--rank", type=int, help="the rank to show (default: the lowest, 0)")
    ranks.add_argument("--all-ranks", action="store_true", help="show every rank")
    diff = commands.add_parser("diff", parents=[common], help="what differs between two dumps")
    diff.add_argument("dir_a")
    diff.add_argument("dir_b")
    diff.add_argument(
        "--rank",
        type=int,
        help="the rank to compare (default: each dump's lowest, 0); "
        "diff DIR/rank0 DIR/rank1 compares two ranks of one dump",
    )
    consolidate = commands.add_parser(
        "consolidate",
        parents=[common],
        help="full fp32 weights of a zcompile.checkpoint directory, in one file "
        "a plain model loads (torch.save, or safetensors for OUT ending in .safetensors)",
    )
    consolidate.add_argument("checkpoint")
    consolidate.add_argument("out")
    consolidate.add_argument(
        "--no-verify",
        action="store_true",
        help="skip comparing the checkpoint's files with the checksums its save recorded (sizes are still checked)",
    )
    clean = commands.add_parser(
        "clean-saves",
        parents=[common],
        help="list (and with --remove delete) what stopped checkpoint saves left in DIR: staging directories "
        "of unfinished saves and replaced checkpoints; run it while no save is running",
    )
    clean.add_argument("dir")
    clean.add_argument("--remove", action="store_true", help="delete what is listed")
    report = commands.add_parser(
        "tune-report",
        parents=[common],
        help="the trials and choice of a zcompile.tune result (tune.json), as tune printed them",
    )
    report.add_argument("result")
    add_simulate_parser(commands, common)
    add_plan_parser(commands, common)
    return parser


def cmd_tune_report(args: argparse.Namespace, out: Output, warnings: list[str]) -> int:
    import json

    from zcompile.tune.result import TuneResult  # local: the dump commands load no torch.compile machinery

    try:
        result = TuneResult.from_json(args.result)
    except FileNotFoundError:
        raise DumpError(f"{args.result}: no such file (tune writes OUT_DIR/tune.json)") from None
    except (json.JSONDecodeError, ValueError, KeyError, TypeError) as error:
        raise DumpError(f"{args.result}: not a zcompile tune result ({type(error).__name__}: {error})") from None
    if args.plain:
        out.line(result.render())
    else:
        result.print()
    return 0


def cmd_consolidate(args: argparse.Namespace, out: Output, warnings: list[str]) -> int:
    from zcompile.checkpoint.consolidate import consolidate  # local: import cost, as above
    from zcompile.checkpoint.layout import CheckpointError

    try:
        summary = consolidate(
            args.checkpoint, args.out, verify_checksums=not args.no_verify
        )  # the swap window read as load reads it
    except CheckpointError as error:
        raise DumpError(str(error)) from None
    out.line(
        f"{summary['out']}: {summary['parameters']} parameters ({summary['elements']:,} elements), "
        f"{summary['tensors']} tensors with aliases and buffers, from a checkpoint of "
        f"{summary['saved_world_size']} rank(s)"
    )
    if summary["excluded_frozen"]:
        out.line(
            f"without the {len(summary['excluded_frozen'])} frozen parameters the checkpoint left out "
            f"(saved with exclude_frozen_parameters=True): {', '.join(summary['excluded_frozen'][:3])}"
            f"{', ...' if len(summary['excluded_frozen']) > 3 else ''}"
        )
    return 0


def cmd_clean_saves(args: argparse.Namespace, out: Output, warnings: list[str]) -> int:
    from zcompile.checkpoint.commit import leftovers, remove_directory  # local: import cost, as above

    if not os.path.isdir(args.dir):
        raise DumpError(f"{args.dir}: no such directory")
    found = leftovers(args.dir)
    for directory, what in found:
        if args.remove:
            remove_directory(directory)
        out.line(f"{'removed ' if args.remove else ''}{directory}: {what}")
    if not found:
        out.line(f"{args.dir}: nothing left by stopped saves")
    elif not args.remove:
        out.line(f"{len(found)} director{'y' if len(found) == 1 else 'ies'}; --remove deletes them")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out, warnings = Output(args.plain), []
    try:
        command = {
            "inspect": cmd_inspect,
            "diff": cmd_diff,
            "consolidate": cmd_consolidate,
            "clean-saves": cmd_clean_saves,
            "tune-report": cmd_tune_report,
            "simulate": cmd_simulate,
            "plan": cmd_plan,
        }[args.command]
        status = command(args, out, warnings)
    except DumpError as error:
        print(f"zcompile {args.command}: error: {error}", file=sys.stderr)
        status = 2
    except BrokenPipeError:  # `zcompile inspect DIR | head`: the reader left, nothing else to say
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (the interpreter flushes stdout at exit)
        return 0
    for warning in warnings:
        print(f"zcompile {args.command}: warning: {warning}", file=sys.stderr)
    return status
