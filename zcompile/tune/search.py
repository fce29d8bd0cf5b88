"""The tuner's decisions, apart from any compiling or timing: predict every point, prune, choose
what to measure, pick the best.

``run_search(points, predict, measure, ...)`` takes the two costly steps as functions, so the logic
runs the same on a fake (tests) as on the real compile-and-time of ``zcompile.tune.trial``:

1. every valid point is predicted (``predict(point) -> Predicted``); a prediction that raises is a
   ``failed`` trial; one over ``memory_limit_bytes`` is ``pruned``; one whose compiled graphs are
   those of another point (``graphs_digest``: ``bucket_mb=4`` holding the whole model makes every
   ``prefetch`` the same program) is ``same`` as that point (the default, else the lowest index)
   and not measured: timing one program twice only measures noise;
2. ``strategy="grid"`` measures every remaining point in index order; ``"model"`` measures the
   default point first, then the best predicted (predicted step time, then index) until
   ``max_trials`` points were measured; a measurement that raises is ``failed`` and the search goes on;
3. the best is the least measured step time, ties to the lower index.

Every decision reads only the predicted and measured values and the point indices. The real
``predict`` and ``measure`` agree their values across ranks before returning them (and raise on
every rank when any rank failed), so every rank decides the same.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from zcompile.tune.space import Point

log = logging.getLogger(__name__)

MEASURED, PREDICTED, PRUNED, FAILED, INVALID, SAME = "measured", "predicted", "pruned", "failed", "invalid", "same"
STRATEGIES = ("model", "grid")


@dataclass(frozen=True)
class Predicted:
    step_s: float
    exposed_comm_s: float
    memory_bytes: int  # model states + gathered peak + kept weights + saved activations, per rank
    memory_parts: dict[str, int] = field(default_factory=dict)
    time_parts: dict[str, float] = field(default_factory=dict)  # compute, issue, comm (hidden or not), in seconds
    graphs_digest: int = 0  # of the compiled graphs' code: equal digests, the same program (0: unknown)


@dataclass(frozen=True)
class Measured:
    step_s: float  # median over timed steps of the slowest rank's step
    exposed_comm_s: float  # time blocked in waits during one profiled step, the most of any rank
    memory_bytes: int  # model states held + the profiled step's peak allocation, the most of any rank
    losses: tuple[float, ...] = ()  # this rank's loss of every step run (warm-up, timed, profiled)
    graphs_s: float = 0.0  # median over timed steps of the slowest rank's forward + backward


@dataclass
class Trial:
    """One point of the space and what became of it."""

    index: int
    options: dict
    is_default: bool
    status: str = PREDICTED
    predicted: Predicted | None = None
    measured: Measured | None = None
    error: str = ""


def default_max_trials(points: int) -> int:
    """A third of the space, at least 3 (and never more than the space)."""
    return min(points, max(3, math.ceil(points / 3)))


def run_search(
    points: list[Point] | tuple[Point, ...],
    predict: Callable[[Point], Predicted],
    measure: Callable[[Point], Measured],
    *,
    strategy: str = "model",
    max_trials: int | None = None,
    memory_limit_bytes: int | None = None,
    on_trial: Callable[[Trial], None] | None = None,
) -> list[Trial]:
    """The trials of ``points`` (module docstring), in index order. ``on_trial`` sees each measured trial."""
    if strategy not in STRATEGIES:
        raise ValueError(f"zcompile.tune: strategy must be one of {STRATEGIES}, got {strategy!r}")
    trials = [Trial(p.index, p.options, p.is_default) for p in points]
    for point, trial in zip(points, trials):
        _predict_one(point, trial, predict, memory_limit_bytes)
    _mark_same_programs(trials)
    budget = len(trials) if strategy == "grid" else (max_trials or default_max_trials(len(trials)))
    for index in measure_order(trials, strategy)[:budget]:
        _measure_one(points[index], trials[index], measure)
        if on_trial is not None:
            on_trial(trials[index])
    return trials


def _predict_one(
    point: Point, trial: Trial, predict: Callable[[Point], Predicted], memory_limit_bytes: int | None
) -> None:
    if point.invalid:
        trial.status, trial.error = INVALID, point.invalid
        return
    try:
        trial.predicted = predict(point)
    except Exception as error:  # noqa: BLE001 - a failed point is recorded, the search goes on
        trial.status, trial.error = FAILED, f"prediction: {type(error).__name__}: {error}"
        log.warning("zcompile.tune: point %d %s failed to compile: %s", point.index, point.options, trial.error)
        return
    if memory_limit_bytes is not None and trial.predicted.memory_bytes > memory_limit_bytes:
        trial.status = PRUNED
        trial.error = (
            f"predicted {trial.predicted.memory_bytes / 2**20:.2f} MiB per rank, over the limit of "
            f"{memory_limit_bytes / 2**20:.2f} MiB"
        )


def _mark_same_programs(trials: list[Trial]) -> None:
    """Points compiled to the same graphs as an earlier one (the default first) become ``same``."""
    first: dict[int, Trial] = {}
    for trial in sorted(trials, key=lambda t: (not t.is_default, t.index)):
        if trial.status != PREDICTED or not trial.predicted.graphs_digest:
            continue
        twin = first.setdefault(trial.predicted.graphs_digest, trial)
        if twin is not trial:
            trial.status, trial.error = SAME, f"same compiled graphs as #{twin.index}"


def _measure_one(point: Point, trial: Trial, measure: Callable[[Point], Measured]) -> None:
    try:
        trial.measured = measure(point)
        trial.status = MEASURED
    except Exception as error:  # noqa: BLE001 - a failed trial is recorded, the search goes on
        trial.status, trial.error = FAILED, f"measurement: {type(error).__name__}: {error}"
        log.warning("zcompile.tune: trial %d %s failed: %s", point.index, point.options, trial.error)


def measure_order(trials: list[Trial], strategy: str) -> list[int]:
    """Indices of the trials to measure, first first: every predicted one for ``grid``; for ``model``
    the default, then by predicted step time (ties: lower index)."""
    candidates = [t for t in trials if t.status == PREDICTED]
    if strategy == "grid":
        return [t.index for t in candidates]
    ranked = sorted(candidates, key=lambda t: (not t.is_default, t.predicted.step_s, t.index))
    return [t.index for t in ranked]


def best_trial(trials: list[Trial]) -> Trial | None:
    """The measured trial of least step time, ties to the lower index; None when none was measured."""
    measured = [t for t in trials if t.status == MEASURED]
    return min(measured, key=lambda t: (t.measured.step_s, t.index), default=None)


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None for fewer than 3 pairs or a constant side."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman: {len(xs)} x values and {len(ys)} y values")
    if len(xs) < 3:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mean = (len(xs) + 1) / 2
    cov = sum((a - mean) * (b - mean) for a, b in zip(rx, ry))
    var_x, var_y = sum((a - mean) ** 2 for a in rx), sum((b - mean) ** 2 for b in ry)
    if var_x == 0 or var_y == 0:
        return None
    return cov / math.sqrt(var_x * var_y)


def _ranks(values: list[float]) -> list[float]:
    """1-based ranks, tied values sharing the mean of their ranks."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both coordinates (less or equal on both, less on one)."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any((a <= x and b <= y) and (a < x or b < y) for a, b in points)
        if not dominated:
            front.append(i)
    return front
