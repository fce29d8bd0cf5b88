"""How a ``Plan`` is shown: its candidates as a table (rich when installed; ``tune.report``'s table),
chosen first, then the others that fit by predicted step, then the ones dropped with the reason;
those never simulated are counted in the plan's summary line, not listed. A candidate judged on
shallow copies of the model (``predict.depth``) says "(extrapolated)"; the chosen one is whole."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zcompile.tune.plan_space import CHOSEN, FITS, NOT_SIMULATED, OVER, PLANNED
from zcompile.tune.report import print_table, render_table

if TYPE_CHECKING:
    from zcompile.tune.plan import Plan, PlanCandidate

MIB = 2**20
COLUMNS = ("options", "status", "peak MiB", "states MiB", "activations MiB", "step ms", "exposed ms", "why")
LEFT = {0, 1, 7}


def options_text(options: dict[str, Any]) -> str:
    """The planned options that are not their default, as ``name=value`` (``None``: left out)."""
    shown = [f"{name}={options[name]}" for name in PLANNED if options.get(name) is not None]
    return " ".join(shown) or "(defaults)"


def mib(nbytes: float) -> str:
    """MiB with three significant figures below 100, whole above (``1.23``, ``80,000``)."""
    value = nbytes / MIB
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _order(candidate: PlanCandidate) -> tuple:
    rank = {CHOSEN: 0, FITS: 1, OVER: 2}.get(candidate.status, 3)
    return (rank, candidate.pace_s if candidate.pace_s is not None else float("inf"))


def candidate_rows(result: Plan) -> list[list[str]]:
    def number(value, scale, form="{:,.1f}"):
        return "" if value is None else form.format(value / scale)

    def size(value):
        return "" if value is None else mib(value)

    rows = []
    for c in sorted(result.candidates, key=_order):
        if c.status == NOT_SIMULATED:  # counted in the summary line
            continue
        parts = c.memory_parts
        rows.append(
            [
                options_text(c.options),
                c.status + (" (extrapolated)" if c.extrapolated else ""),
                size(c.peak_bytes),
                size(parts.get("model_states_bytes")),
                size(parts.get("saved_activation_bytes")),
                number(c.step_s, 1e-3),
                number(c.exposed_comm_s, 1e-3),
                c.why[:70],
            ]
        )
    return rows


def render_plan(result: Plan) -> str:
    return "\n".join([render_table(COLUMNS, candidate_rows(result), LEFT), result.summary()])


def print_plan(result: Plan) -> None:
    print_table(
        f"zcompile.plan: {mib(result.memory_limit_bytes)} MiB per rank, {result.world_size} ranks, {result.hardware}",
        COLUMNS,
        candidate_rows(result),
        LEFT,
        [result.summary()],
    )
