"""How a ``TuneResult`` is shown: one table of trials and a summary (rich when installed, plain text
otherwise), and a plot (matplotlib): predicted against measured step time, and measured step time
against measured memory with the Pareto front (no other trial both faster and smaller) marked.

``rich`` and ``matplotlib`` are imported when used (``pip install zcompile[inspect]``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zcompile.tune.search import MEASURED, Trial, pareto_front
from zcompile.tune.serialization import jsonable_value

if TYPE_CHECKING:
    from zcompile.tune.result import TuneResult

COLUMNS = ("#", "options", "status", "pred ms", "meas ms", "pred exposed", "meas exposed", "pred MiB", "meas MiB", "")
LEFT = {1, 2, 9}  # the columns of text, left-justified


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.1f}"


def _mib(nbytes: float | None) -> str:
    return "" if nbytes is None else f"{nbytes / 2**20:.1f}"


def _options_text(result: TuneResult, trial: Trial) -> str:
    return " ".join(f"{name}={jsonable_value(trial.options[name])}" for name in result.space if name in trial.options)


def trial_rows(result: TuneResult) -> list[list[str]]:
    """One row per trial, in the columns of ``COLUMNS``; the last marks the best and the default."""
    best = result.best_trial
    rows = []
    for t in result.trials:
        p, m = t.predicted, t.measured
        marks = " ".join(
            mark for mark, on in (("best", best is not None and t.index == best.index), ("default", t.is_default)) if on
        )
        status = t.status if not t.error else f"{t.status}: {t.error[:60]}"
        rows.append(
            [
                str(t.index),
                _options_text(result, t),
                status,
                _ms(p and p.step_s),
                _ms(m and m.step_s),
                _ms(p and p.exposed_comm_s),
                _ms(m and m.exposed_comm_s),
                _mib(p and p.memory_bytes),
                _mib(m and m.memory_bytes),
                marks,
            ]
        )
    return rows


def summary_lines(result: TuneResult) -> list[str]:
    best, default = result.best_trial, result.default
    measured = len(result.measured)
    lines = [
        f"strategy {result.strategy}: {measured} of {len(result.trials)} points measured "
        f"({result.steps} timed steps after {result.warmup} warm-up, {result.world_size} rank(s)) in "
        f"{result.wall_s:.1f} s"
    ]
    if best is None:
        return lines + ["no trial was measured: see the errors above"]
    lines.append(f"best: #{best.index} {_options_text(result, best)}: {best.measured.step_s * 1e3:.1f} ms per step")
    speedup = result.speedup_over_default
    if speedup is not None:
        lines.append(
            f"against the default (#{default.index}, {default.measured.step_s * 1e3:.1f} ms): "
            f"{speedup:.3f}x ({(1 - 1 / speedup) * 100:+.1f}% of the default's step time saved)"
        )
    rho = result.rank_correlation
    lines.append(
        "prediction: Spearman rank correlation of predicted and measured step time "
        + ("n/a (fewer than 3 measured)" if rho is None else f"{rho:.2f}")
    )
    return lines


def render_table(columns: tuple[str, ...], rows: list[list[str]], left: set[int]) -> str:
    """Plain-text table: columns padded to their widest cell, ``left`` ones left-justified."""
    rows = [list(columns)] + rows
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    return "\n".join(
        "  ".join(cell.ljust(w) if i in left else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    )


def print_table(title: str, columns: tuple[str, ...], rows: list[list[str]], left: set[int], lines: list[str]) -> None:
    """A rich table (plain text without rich) and the ``lines`` after it."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print("\n".join([title, render_table(columns, rows, left)] + lines))
        return
    table = Table(title=title)
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i in left else "right")
    for row in rows:
        table.add_row(*row)
    console = Console()
    if not console.is_terminal:  # a log or a pipe: one line per row rather than 80 columns of wrapped cells
        console = Console(width=180)
    console.print(table)
    for line in lines:
        console.print(line, highlight=False)


def render_result(result: TuneResult) -> str:
    return "\n".join([render_table(COLUMNS, trial_rows(result), LEFT)] + summary_lines(result))


def print_result(result: TuneResult) -> None:
    print_table(
        f"zcompile.tune: {len(result.trials)} points, {result.world_size} rank(s)",
        COLUMNS,
        trial_rows(result),
        LEFT,
        summary_lines(result),
    )


def draw_front(axis, points: list[tuple[float, float]], label: str = "Pareto front") -> None:
    """The Pareto front of ``points`` (no other point less on both coordinates) as a line on ``axis``."""
    front = sorted(points[i] for i in pareto_front(points))
    if front:
        axis.plot([x for x, _ in front], [y for _, y in front], color="tab:orange", marker="o", label=label)


def plot_result(result: TuneResult, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = result.measured
    best = result.best_trial
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6), dpi=80)
    pairs = [(t.predicted.step_s * 1e3, t.measured.step_s * 1e3) for t in measured if t.predicted is not None]
    if pairs:
        left.scatter([p for p, _ in pairs], [m for _, m in pairs], s=18, color="tab:blue")
        low, high = min(min(pair) for pair in pairs), max(max(pair) for pair in pairs)
        left.plot([low, high], [low, high], color="grey", linewidth=0.8, linestyle="--", label="measured = predicted")
        rho = result.rank_correlation
        left.set_title("step time" + ("" if rho is None else f" (Spearman {rho:.2f})"), fontsize=10)
    left.set_xlabel("predicted ms")
    left.set_ylabel("measured ms")
    points = [(t.measured.memory_bytes / 2**20, t.measured.step_s * 1e3) for t in measured]
    right.scatter([m for m, _ in points], [s for _, s in points], s=18, color="tab:blue", label="measured")
    draw_front(right, points)
    for trial, label, color in ((best, "best", "tab:green"), (result.default, "default", "tab:red")):
        if trial is not None and trial.status == MEASURED:
            right.scatter(
                [trial.measured.memory_bytes / 2**20],
                [trial.measured.step_s * 1e3],
                s=60,
                facecolors="none",
                edgecolors=color,
                label=label,
            )
    right.set_xlabel("measured MiB per rank")
    right.set_ylabel("measured ms per step")
    right.set_title("step time against memory", fontsize=10)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
