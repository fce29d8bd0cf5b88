"""Calibrating the cost model on one measured configuration before predicting the others.

The roofline constants come from micro-benchmarks (a 512-square matmul, a 4 MiB copy, a tiny add):
on a CPU they over-state what a model's own, smaller and oddly shaped ops reach, so the predicted
compute of the compiled graphs comes out short. A step also holds work no graph shows (the
optimizer step, the autograd engine, Python between graphs). Both errors are nearly the same for
every schedule of one model, so one measured configuration fixes them for all:

- ``compute_scale``: the factor on every node's predicted time (``ComputeCosts.scaled``) at which the
  predicted forward + backward equals the measured one. Slower compute also hides more
  communication, so it is found by bisection on the predicted time, which never decreases with
  the scale (waits end no earlier when compute is slower);
- ``outside_graphs_s``: the measured step minus the measured forward + backward, added to every
  predicted step.

The tuner measures the default options first and calibrates on them; the numbers it uses are the
ones every rank agreed on (slowest rank's times), so the calibrated costs are the same everywhere.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from zcompile.predict.cost_model import ComputeCosts, Prediction

log = logging.getLogger(__name__)
ITERATIONS = 30  # bisection steps over log2 of SCALE_RANGE: about 1e-8 relative
SCALE_RANGE = (0.25, 8.0)  # a scale outside it is a broken measurement, not a slow device: clamped


@dataclass(frozen=True)
class StepCalibration:
    compute_scale: float = 1.0
    outside_graphs_s: float = 0.0

    def compute_costs(self, raw: ComputeCosts) -> ComputeCosts:
        return raw.scaled(self.compute_scale)


def calibrate(
    predict: Callable[[ComputeCosts], Prediction], raw: ComputeCosts, graphs_s: float, step_s: float
) -> StepCalibration:
    """The calibration that makes ``predict`` (the measured configuration's graphs under given compute
    costs) match ``graphs_s`` (its measured forward + backward) and ``step_s`` (its whole step)."""
    low, high = math.log2(SCALE_RANGE[0]), math.log2(SCALE_RANGE[1])
    if predict(raw).compute_s <= 0:
        return StepCalibration(1.0, max(step_s - graphs_s, 0.0))
    for _ in range(ITERATIONS):
        middle = (low + high) / 2
        if predict(raw.scaled(2**middle)).step_s < graphs_s:
            low = middle
        else:
            high = middle
    scale = 2 ** ((low + high) / 2)
    calibration = StepCalibration(scale, max(step_s - graphs_s, 0.0))
    log.info(
        "zcompile.tune: compute %.2fx the roofline's, %.1f ms per step outside the graphs",
        calibration.compute_scale,
        calibration.outside_graphs_s * 1e3,
    )
    return calibration
