"""The tuner's two costly steps on real ranks: predict a point (compile, one forward and backward, the
cost model) and measure it (train, time, profile one step).

Each starts from ``torch._dynamo.reset()`` and a fresh model from ``make_model()`` (and a fresh
optimizer), and drops them after: no compiled code, shard or optimizer state of one point reaches
the next. Every number either returns is agreed across ranks before it is used (``agreed``: the
largest over ranks, so a step is as slow as its slowest rank), and a failure on any rank raises
``TrialFailed`` on every rank with the first failing rank's error, so the search takes the same
path everywhere. A rank that fails in the middle of a step can leave the others inside a collective
of the step, where only the process group's own timeout ends their wait: the failing rank logs its
error at once (a warning), and trials run with a longer ``check_timeout_s`` (``TRIAL_CHECK_TIMEOUT_S``)
so that a loaded machine's skew between ranks is not such a failure.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from zcompile.common.process_group import DataParallelGroup
from zcompile.predict.cost_model import CollectiveCosts, ComputeCosts, predict_step
from zcompile.reports.step_report import step_report
from zcompile.reports.timeline import record_step
from zcompile.sharding.memory import model_state_bytes
from zcompile.tune.calibration import StepCalibration, calibrate
from zcompile.tune.policies import POLICY_NAMES, policy_from_name
from zcompile.tune.search import Measured, Predicted
from zcompile.tune.space import POLICY_OPTION, Point

log = logging.getLogger(__name__)
T = TypeVar("T")


# zcompile's rank checks wait 60 s for the other ranks by default; a trial compiles while another rank may
# still be finishing the last trial's profiled step on a loaded machine, and a rank that gives up leaves
# the others inside a collective: a trial waits longer unless the options say otherwise.
TRIAL_CHECK_TIMEOUT_S = 300.0


class TrialFailed(RuntimeError):
    """A point failed to compile or train on at least one rank (raised on every rank)."""


@dataclass(frozen=True)
class TrialSetup:
    """What every trial of one ``tune`` call shares: the user's functions and the agreed costs."""

    make_model: Callable[[], torch.nn.Module]
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    batches: Sequence[Any]
    make_optimizer: Callable[[Any], Any]
    base_options: dict[str, Any]
    group: DataParallelGroup
    collective_costs: CollectiveCosts
    compute_costs: ComputeCosts  # what predictions use: calibrated once the default was measured
    steps: int = 5
    warmup: int = 2
    calibration: StepCalibration = StepCalibration()

    def options(self, point: Point) -> dict[str, Any]:
        """The backend options of ``point``: base + the point's, a policy name turned into the policy."""
        options = {"check_timeout_s": TRIAL_CHECK_TIMEOUT_S, **self.base_options, **point.options}
        if isinstance(options.get(POLICY_OPTION), str) and options[POLICY_OPTION] in POLICY_NAMES:
            options[POLICY_OPTION] = policy_from_name(options[POLICY_OPTION], self.collective_costs, self.compute_costs)
        return options

    def batch(self, step: int) -> Any:
        return self.batches[step % len(self.batches)]


def predict_point(setup: TrialSetup, point: Point) -> Predicted:
    """Compiles ``point``, runs one forward and backward (no optimizer step) and predicts a step of it."""
    options = setup.options(point)

    def local() -> list[float]:
        graphs: list = []
        model = setup.make_model()
        compiled = torch.compile(model, backend="zero", options={**options, "on_compile": graphs.append})
        setup.loss_fn(compiled, setup.batch(0)).backward()
        prediction = predict_step(graphs, setup.collective_costs, setup.compute_costs)
        memory = step_report(model, None, graphs).memory
        return [
            prediction.step_s,
            prediction.exposed_comm_s,
            prediction.compute_s,
            prediction.issue_s,
            prediction.comm_s,
            graphs_digest(graphs),
            memory["formula_bytes"],
            memory["peak_gathered_bytes"],
            memory["kept_gathered_bytes"],
            memory["saved_activation_bytes"],
        ]

    step_s, exposed_s, compute_s, issue_s, comm_s, digest, *parts = _fresh(lambda: agreed(local, 10, setup.group))
    names = ("model_states", "gathered_peak", "kept_gathered", "saved_activations")
    memory_parts = {name: int(value) for name, value in zip(names, parts)}
    outside = setup.calibration.outside_graphs_s
    time_parts = {"compute": compute_s, "issue": issue_s, "comm": comm_s, "outside_graphs": outside}
    return Predicted(step_s + outside, exposed_s, sum(memory_parts.values()), memory_parts, time_parts, int(digest))


def graphs_digest(graphs: list) -> int:
    """48 bits of a hash of the forward and backward graphs' code: the same for the same program (exact
    in a float64, so it travels with the agreed values)."""
    code = "".join(
        (g.forward.code if g.forward is not None else "") + (g.backward.code if g.backward is not None else "")
        for g in graphs
    )
    return int(hashlib.sha1(code.encode()).hexdigest()[:12], 16)


def measure_point(
    setup: TrialSetup, point: Point, calibrate_costs: bool = False
) -> tuple[Measured, StepCalibration | None]:
    """Trains ``point`` ``warmup`` steps untimed and ``steps`` timed, then profiles one more step.

    Step time: the median over the timed steps of the slowest rank's time (each step started from a
    barrier); ``graphs_s`` the same for forward + backward alone. Exposed communication: time
    blocked in ``wait_tensor`` in the profiled step. Memory: model states held after the steps plus
    the profiled step's peak of allocations. ``calibrate_costs``: also fit the cost model to these
    agreed times on this point's graphs (``zcompile.tune.calibration``).
    """
    options = setup.options(point)
    losses: list[float] = []
    graphs: list = []

    def local() -> list[float]:
        model = setup.make_model()
        optimizer = setup.make_optimizer(model.parameters())
        compiled = torch.compile(model, backend="zero", options={**options, "on_compile": graphs.append})
        times: list[float] = []

        def train_step() -> None:
            start = time.perf_counter()
            loss = setup.loss_fn(compiled, setup.batch(len(losses)))
            loss.backward()
            times.append(time.perf_counter() - start)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())

        for _ in range(setup.warmup):
            train_step()
        steps, in_graphs = [], []
        for _ in range(setup.steps):
            _barrier(setup.group)
            start = time.perf_counter()
            train_step()
            steps.append(time.perf_counter() - start)
            in_graphs.append(times[-1])
        _barrier(setup.group)
        with tempfile.TemporaryDirectory() as trace_dir:
            timeline = record_step(train_step, trace_dir, rank=setup.group.rank)
        states = model_state_bytes(model, optimizer).total
        return [*steps, *in_graphs, timeline.wait_us / 1e6, states + timeline.peak_bytes]

    def run() -> tuple[Measured, StepCalibration | None]:
        values = agreed(local, 2 * setup.steps + 2, setup.group)
        step_s, graphs_s = (statistics.median(values[i * setup.steps : (i + 1) * setup.steps]) for i in (0, 1))
        measured = Measured(step_s, values[-2], int(values[-1]), tuple(losses), graphs_s)
        calibration = None
        if calibrate_costs:
            calibration = calibrate(
                lambda costs: predict_step(graphs, setup.collective_costs, costs), setup.compute_costs, graphs_s, step_s
            )
        graphs.clear()
        return measured, calibration

    return _fresh(run)


def _fresh(run: Callable[[], T]) -> T:
    """``run()`` between two Dynamo resets, garbage collected after: nothing of it reaches the next trial."""
    torch._dynamo.reset()
    try:
        return run()
    finally:
        torch._dynamo.reset()
        gc.collect()


def agreed(local: Callable[[], list[float]], width: int, group: DataParallelGroup) -> list[float]:
    """``local()``'s ``width`` values, each the largest over ranks; ``TrialFailed`` on every rank when
    ``local`` raised on any (with the error of the lowest failing rank)."""
    error = None
    try:
        values = [float(v) for v in local()]
    except Exception as raised:  # noqa: BLE001 - reported to every rank, then raised there
        error, values = f"{type(raised).__name__}: {raised}", [0.0] * width
        log.warning(
            "zcompile.tune: trial failed on rank %d: %s", group.rank, error, exc_info=log.isEnabledFor(logging.DEBUG)
        )
    if group.world_size == 1:
        if error is not None:
            raise TrialFailed(error)
        return values
    flags = torch.tensor([float(error is not None), *values], dtype=torch.float64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group.process_group)
    if flags[0].item() > 0:
        errors: list = [None] * group.world_size
        dist.all_gather_object(errors, error, group=group.process_group)
        rank, text = next((r, e) for r, e in enumerate(errors) if e is not None)
        raise TrialFailed(f"rank {rank}: {text}")
    return flags[1:].tolist()


def _barrier(group: DataParallelGroup) -> None:
    if group.world_size > 1:
        dist.barrier(group=group.process_group)
