"""Schedule auto-tuning: predict every point of a space with the cost model, measure what matters,
report how well the prediction held.

    result = zcompile.tune.tune(make_model, loss_fn, batches,
                                space={"bucket_mb": [0.25, 1, 4], "prefetch": [0, 1, 2]})
    model = torch.compile(make_model(), backend="zero", options=result.best)

Why both: DeepSpeed's autotuner launches a job per configuration and ranks them with a learned
model; DeepCompile profiles once and decides greedily. Neither says how good its prediction was.
Here every point is compiled once and predicted (``zcompile.predict.cost_model``, with collective and
compute costs measured once per call and agreed across ranks); the best predicted are trained
and timed (``strategy="model"``; ``"grid"`` times all); the result carries both numbers per
trial and their rank correlation, so a poor prediction shows.

The parts: ``tune.space`` checks the space before anything compiles and enumerates it;
``tune.search`` decides (prune, order, pick) on values every rank agrees on; ``tune.trial``
compiles, predicts and measures one point from a fresh model and a reset Dynamo;
``tune.result`` / ``tune.report`` hold, save and show the outcome; ``tune.policies`` holds the
schedule policies a space can compare (``schedule_policy``).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from zcompile.common.process_group import DataParallelGroup
from zcompile.optim.sharded import AdamW
from zcompile.predict.cost_model import measure_collective_costs, measure_compute_costs
from zcompile.tune.result import TuneResult
from zcompile.tune.search import STRATEGIES, Measured, Trial, default_max_trials, run_search
from zcompile.tune.space import Point, SearchSpace
from zcompile.tune.trial import TrialFailed, TrialSetup, measure_point, predict_point

log = logging.getLogger(__name__)
MIB = 2**20
RESULT_JSON, RESULT_PNG = "tune.json", "tune.png"


def load_result(path: str) -> TuneResult:
    """A result saved by ``tune(out_dir=...)`` (``tune.json``): ``load_result(path).best`` are its options."""
    return TuneResult.from_json(path)


def default_optimizer(params):
    """``zcompile.optim.AdamW(params, lr=1e-3)``: the optimizer a trial trains with unless given one."""
    return AdamW(params, lr=1e-3)


@dataclass
class _Progress:
    """A tqdm bar over the trials on the first rank (when asked and installed): points predicted, then measured."""

    enabled: bool
    bar: Any = None

    def start(self, total: int) -> None:
        if not self.enabled:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            log.warning(
                "zcompile.tune: progress=True needs tqdm (pip install zcompile[inspect]); going on without a bar"
            )
            return
        self.bar = tqdm(total=total, desc="zcompile.tune: predicting", unit="point")

    def predicted(self) -> None:
        self._advance("zcompile.tune: predicting")

    def measured(self, trial: Trial) -> None:
        step = "" if trial.measured is None else f" #{trial.index} {trial.measured.step_s * 1e3:.1f} ms"
        self._advance(f"zcompile.tune: measuring{step}")

    def _advance(self, description: str) -> None:
        if self.bar is not None:
            self.bar.set_description(description)
            self.bar.update(1)

    def close(self) -> None:
        """Ends the bar at what was done (the model strategy may measure fewer than its budget)."""
        if self.bar is not None:
            self.bar.total = self.bar.n
            self.bar.refresh()
            self.bar.close()


def tune(
    make_model: Callable[[], torch.nn.Module],
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    batches: Sequence[Any],
    *,
    space: dict[str, list],
    base_options: dict[str, Any] | None = None,
    optimizer: Callable[[Any], Any] | None = None,
    steps: int = 5,
    warmup: int = 2,
    memory_limit_mb: float | None = None,
    strategy: str = "model",
    max_trials: int | None = None,
    out_dir: str | None = None,
    progress: bool = False,
) -> TuneResult:
    """Tunes the zero backend's options for ``make_model`` on this machine (module docstring).

    ``make_model()`` returns a fresh model (the same weights on every rank); ``loss_fn(model, batch)``
    a scalar loss; ``batches`` this rank's batches, reused cyclically; ``optimizer(params)`` builds
    the optimizer (default ``default_optimizer``); ``space`` maps zero backend options to candidate
    lists (``schedule_policy`` also takes ``"greedy"`` and ``"cost_guided"``); ``base_options`` the
    fixed ones. Points predicted over ``memory_limit_mb`` per rank are pruned. ``strategy="model"``
    measures the default and the best predicted, ``max_trials`` in all (default a third of the
    space, at least 3); ``"grid"`` measures every point. ``out_dir``: the first rank writes
    ``tune.json`` and ``tune.png`` there. ``progress``: a tqdm bar on the first rank.

    Every rank must call it with the same arguments (it trains with collectives). Bad arguments
    raise before anything compiles.
    """
    started = time.perf_counter()
    search_space = SearchSpace.build(space, base_options)
    _check_arguments(batches, optimizer, steps, warmup, memory_limit_mb, strategy, max_trials, out_dir)
    group = DataParallelGroup.resolve(search_space.base_options.get("group"))
    timings = {"costs_s": 0.0, "calibrate_s": 0.0, "predict_s": 0.0, "measure_s": 0.0}
    collective_costs = measure_collective_costs(group.process_group)
    raw_compute = measure_compute_costs(group=group.process_group)
    timings["costs_s"] = time.perf_counter() - started
    setup = TrialSetup(
        make_model,
        loss_fn,
        list(batches),
        optimizer or default_optimizer,
        search_space.base_options,
        group,
        collective_costs,
        raw_compute,
        steps,
        warmup,
    )
    bar = _Progress(progress and group.rank == 0)
    bar.start(
        len(search_space)
        + (len(search_space) if strategy == "grid" else (max_trials or default_max_trials(len(search_space))))
    )
    default, setup = _measure_default(setup, search_space.default, timings)

    def predict(point):
        began = time.perf_counter()
        predicted = predict_point(setup, point)
        timings["predict_s"] += time.perf_counter() - began
        bar.predicted()
        return predicted

    def measure(point):
        if point.index == search_space.default.index:
            return default()
        began = time.perf_counter()
        try:
            return measure_point(setup, point)[0]
        finally:
            timings["measure_s"] += time.perf_counter() - began

    limit = None if memory_limit_mb is None else int(memory_limit_mb * MIB)
    try:
        trials = run_search(
            search_space.points,
            predict,
            measure,
            strategy=strategy,
            max_trials=max_trials,
            memory_limit_bytes=limit,
            on_trial=bar.measured,
        )
    finally:
        bar.close()
    result = TuneResult(
        trials,
        search_space.base_options,
        search_space.space,
        strategy,
        group.world_size,
        steps,
        warmup,
        memory_limit_mb,
        time.perf_counter() - started,
        timings,
        collective_costs,
        setup.compute_costs,
        setup.calibration,
    )
    log.info(
        "zcompile.tune: %d points, %d measured, best %s, Spearman %s, %.1f s",
        len(trials),
        len(result.measured),
        None if result.best_trial is None else result.best_trial.index,
        result.rank_correlation,
        result.wall_s,
    )
    if out_dir is not None and group.rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        result.to_json(os.path.join(out_dir, RESULT_JSON))
        result.plot(os.path.join(out_dir, RESULT_PNG))
    return result


def _measure_default(
    setup: TrialSetup, point: Point, timings: dict[str, float]
) -> tuple[Callable[[], Measured], TrialSetup]:
    """Measures the default options first and calibrates the cost model on them
    (``zcompile.tune.calibration``): returns how the search gets that measurement (the measurement,
    or the failure raised again) and the setup whose predictions use the calibrated costs."""
    began = time.perf_counter()
    try:
        measured, calibration = measure_point(setup, point, calibrate_costs=True)
    except TrialFailed as error:
        log.warning("zcompile.tune: the default options failed (%s); predicting with uncalibrated costs", error)
        failure = error

        def default() -> Measured:
            raise failure

        return default, setup
    finally:
        timings["calibrate_s"] = time.perf_counter() - began
    setup = replace(setup, compute_costs=calibration.compute_costs(setup.compute_costs), calibration=calibration)
    return lambda: measured, setup


def _check_arguments(batches, optimizer, steps, warmup, memory_limit_mb, strategy, max_trials, out_dir) -> None:
    """Refuses bad arguments with the argument named, before anything compiles."""
    if strategy not in STRATEGIES:
        raise ValueError(f"zcompile.tune: strategy must be one of {STRATEGIES}, got {strategy!r}")
    for name, value, least in (("steps", steps, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"zcompile.tune: {name} must be an int >= {least}, got {value!r}")
    if max_trials is not None and (isinstance(max_trials, bool) or not isinstance(max_trials, int) or max_trials < 1):
        raise ValueError(
            f"zcompile.tune: max_trials must be an int >= 1 or None (a third of the space), got {max_trials!r}"
        )
    if memory_limit_mb is not None and (
        isinstance(memory_limit_mb, bool)
        or not isinstance(memory_limit_mb, (int, float))
        or not math.isfinite(memory_limit_mb)
        or memory_limit_mb <= 0
    ):
        raise ValueError(
            f"zcompile.tune: memory_limit_mb must be a positive number (MiB per rank) or None, got {memory_limit_mb!r}"
        )
    if optimizer is not None and not callable(optimizer):
        raise TypeError(f"zcompile.tune: optimizer must be a callable optimizer(params), got {optimizer!r}")
    try:
        count = len(batches)
    except TypeError:
        raise TypeError(
            f"zcompile.tune: batches must be a sequence of this rank's batches (a list), got {type(batches).__name__}"
        ) from None
    if count == 0:
        raise ValueError("zcompile.tune: batches is empty; give this rank's batches (reused cyclically)")
    if out_dir is not None and not isinstance(out_dir, (str, os.PathLike)):
        raise TypeError(f"zcompile.tune: out_dir must be a directory path, got {out_dir!r}")
