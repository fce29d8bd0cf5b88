"""How a ``SimulatedTuneResult`` is shown: a table of the points and the choices (rich when
installed; ``tune.report``'s table), and a plot: step time against memory per GPU, the Pareto front
highlighted (``tune.report.draw_front``), the HBM and the memory limit as vertical lines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zcompile.tune.report import draw_front, print_table, render_table
from zcompile.tune.serialization import jsonable_value

if TYPE_CHECKING:
    from zcompile.tune.simulated import SimulatedPoint, SimulatedTuneResult

GIB = 2**30
COLUMNS = ("#", "options", "status", "GiB/GPU", "step s", "exposed s", "MFU", "across nodes GiB", "sim s", "")
LEFT = {1, 2, 9}


def _gib(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / GIB


def options_text(result: SimulatedTuneResult, point: SimulatedPoint) -> str:
    return " ".join(f"{name}={jsonable_value(point.options[name])}" for name in result.space if name in point.options)


def point_rows(result: SimulatedTuneResult) -> list[list[str]]:
    """One row per point, in ``COLUMNS``; the last marks the front, the fastest fitting and the default."""
    front = {p.index for p in result.front}
    chosen = result.fastest_fitting

    def number(value, form):
        return "" if value is None else form.format(value)

    rows = []
    for p in result.points:
        marks = [
            mark
            for mark, on in (
                ("front", p.index in front),
                ("best", chosen is not None and p is chosen),
                ("default", p.is_default),
            )
            if on
        ]
        status = p.status if not p.error else f"{p.status}: {p.error[:60]}"
        rows.append(
            [
                str(p.index),
                options_text(result, p),
                status,
                number(_gib(p.memory_bytes), "{:.3g}"),
                number(p.step_s, "{:.3g}"),
                number(p.exposed_comm_s, "{:.3g}"),
                number(p.mfu and 100 * p.mfu, "{:.0f}%"),
                number(_gib(p.across_nodes_bytes), "{:.3g}"),
                f"{p.simulate_s:.1f}",
                " ".join(marks),
            ]
        )
    return rows


def summary_lines(result: SimulatedTuneResult) -> list[str]:
    limit = "" if result.memory_limit_gb is None else f", memory limit {result.memory_limit_gb} GiB"
    lines = [
        f"{len(result.points)} points simulated for {result.world_size} ranks ({result.node_size} per node, "
        f"{result.hardware}, {result.hbm_bytes / GIB:.1f} GiB HBM{limit}) in {result.wall_s:.1f} s",
        "Pareto front (memory, step): "
        + (", ".join(f"#{p.index} {p.memory_bytes / GIB:.3g} GiB {p.step_s:.3g} s" for p in result.front) or "none"),
    ]
    for label, point in (("fastest", result.fastest), ("fastest that fits HBM", result.fastest_fitting)):
        lines.append(
            f"{label}: "
            + (
                "none"
                if point is None
                else f"#{point.index} {options_text(result, point)}: "
                f"{point.step_s:.3g} s, {point.memory_bytes / GIB:.3g} GiB per GPU"
            )
        )
    return lines


def render_simulated(result: SimulatedTuneResult) -> str:
    return "\n".join([render_table(COLUMNS, point_rows(result), LEFT)] + summary_lines(result))


def print_simulated(result: SimulatedTuneResult) -> None:
    print_table(
        f"zcompile.simulate_tune: {len(result.points)} points, {result.world_size} ranks, {result.hardware}",
        COLUMNS,
        point_rows(result),
        LEFT,
        summary_lines(result),
    )


def plot_simulated(result: SimulatedTuneResult, path: str, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(6.4, 4.2), dpi=90)
    simulated = [p for p in result.points if p.step_s is not None]
    for status, color, label in (("predicted", "tab:blue", "simulated"), ("pruned", "lightgrey", "over the limit")):
        shown = [p for p in simulated if p.status == status]
        if shown:
            axis.scatter(
                [p.memory_bytes / GIB for p in shown], [p.step_s for p in shown], s=22, color=color, label=label
            )
    labels: dict[tuple[str, str], tuple] = {}  # points at one spot (3 digits) share a label
    for p in simulated:
        values = "/".join(str(jsonable_value(p.options[name])) for name in result.space if name in p.options)
        spot = (f"{p.memory_bytes / GIB:.3g}", f"{p.step_s:.3g}")
        labels.setdefault(spot, (p.memory_bytes / GIB, p.step_s, []))[2].append(f"#{p.index} {values}")
    for x, y, texts in labels.values():
        axis.annotate(", ".join(texts), (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
    axis.text(
        0.99,
        0.01,
        "labels: " + "/".join(result.space),
        transform=axis.transAxes,
        fontsize=7,
        ha="right",
        va="bottom",
        color="grey",
    )
    draw_front(axis, [(p.memory_bytes / GIB, p.step_s) for p in result.eligible])
    chosen = result.fastest_fitting
    if chosen is not None:
        axis.scatter(
            [chosen.memory_bytes / GIB],
            [chosen.step_s],
            s=80,
            facecolors="none",
            edgecolors="tab:green",
            label="fastest that fits",
        )
    axis.axvline(result.hbm_bytes / GIB, color="tab:red", linewidth=0.8, linestyle="--", label="HBM")
    if result.memory_limit_gb is not None:
        axis.axvline(result.memory_limit_gb, color="grey", linewidth=0.8, linestyle=":", label="memory limit")
    axis.set_xlabel("GiB per GPU")
    axis.set_ylabel("step s")
    axis.set_title(title or f"{result.world_size} x {result.hardware}: step time against memory", fontsize=10)
    axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
