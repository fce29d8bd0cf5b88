"""Tuning by simulation: every point of an option space simulated at a world this machine does not
have, and the Pareto front of memory per GPU against step time.

    result = zcompile.simulate_tune(make_model, batch, world_size=512, hardware="h100-sxm",
                                    space={"stage": [2, 3], "bucket_mb": [16, 64], "hpz_size": [None, "node"]},
                                    base_options={"param_dtype": "bf16"}, memory_limit_gb=70)
    result.print(); result.plot("pareto.png")
    model = torch.compile(make_model(), backend="zero", options=result.best)

The space is checked and enumerated by ``tune.space.SearchSpace`` (the real-run tuner's rules and
errors); each valid point is one ``zcompile.simulate`` call, a compile of the whole model on fake
tensors (longer the larger the model). A point that fails to compile is recorded with its error.
Nothing is measured, so there is no calibration and no ``same`` rule: every point is a prediction
with the hardware profile's costs.

Decisions: points whose step peak (``zcompile.predict.step_peak``: the most bytes per GPU at any
moment of a step, not the sum of the parts, which may be above or below it) is over
``memory_limit_gb`` (GiB per GPU) are ``pruned``; the front and the choices read the remaining
``predicted`` points only. ``front``: the points no other point beats on both memory and step time
(``tune.search.pareto_front``); ``fastest``: least step time, ties to the lower
index; ``fastest_fitting``: the same among points that also fit the profile's HBM; ``best``: the
full options of ``fastest_fitting``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from zcompile.config import ZeroConfig
from zcompile.predict.hardware import HardwareProfile, load_profile
from zcompile.predict.simulate import check_world, simulate
from zcompile.tune.plan_space import TENSOR_PARALLEL
from zcompile.tune.policies import policy_from_name
from zcompile.tune.search import FAILED, INVALID, PREDICTED, PRUNED, pareto_front
from zcompile.tune.serialization import dumps_to, jsonable_options, jsonable_value
from zcompile.tune.simulated_report import plot_simulated, print_simulated, render_simulated
from zcompile.tune.space import POLICY_OPTION, Point, SearchSpace

log = logging.getLogger(__name__)
GIB = 2**30
FORMAT = "zcompile.simulate_tune/1"


@dataclass
class SimulatedPoint:
    """One point of the space and its simulation (the numbers are None when it was not simulated)."""

    index: int
    options: dict[str, Any]  # the space's options of this point (base options not repeated)
    is_default: bool
    status: str = PREDICTED  # predicted, pruned (over the memory limit), failed, invalid
    # per GPU: the step's peak (zcompile.predict.step_peak: what must fit; the parts' sum can be below it, by
    # backward's transients, or above, each part's own peak being at another time)
    memory_bytes: int | None = None
    memory_parts: dict[str, int] = field(default_factory=dict)  # model states, gathered peak, kept, activations
    step_s: float | None = None
    exposed_comm_s: float | None = None
    compute_s: float | None = None
    mfu: float | None = None
    across_nodes_bytes: int | None = None  # per GPU and step
    simulate_s: float = 0.0  # wall time of its simulation
    error: str = ""
    extrapolated: bool = False  # from shallow copies of the model (predict.depth), not the whole of it


@dataclass
class SimulatedTuneResult:
    points: list[SimulatedPoint]
    base_options: dict[str, Any]
    space: dict[str, list]
    world_size: int
    node_size: int
    hardware: str
    hbm_bytes: float  # the profile's memory per GPU
    memory_limit_gb: float | None = None
    wall_s: float = 0.0

    @property
    def eligible(self) -> list[SimulatedPoint]:
        """The simulated points within the memory limit: what the front and the choices read."""
        return [p for p in self.points if p.status == PREDICTED]

    @property
    def front(self) -> list[SimulatedPoint]:
        """The Pareto front of memory per GPU against step time, by memory (then index)."""
        eligible = self.eligible
        indices = pareto_front([(p.memory_bytes, p.step_s) for p in eligible])
        return sorted((eligible[i] for i in indices), key=lambda p: (p.memory_bytes, p.index))

    @property
    def fastest(self) -> SimulatedPoint | None:
        return min(self.eligible, key=lambda p: (p.step_s, p.index), default=None)

    @property
    def fastest_fitting(self) -> SimulatedPoint | None:
        """The fastest point that also fits the profile's HBM."""
        fitting = [p for p in self.eligible if p.memory_bytes <= self.hbm_bytes]
        return min(fitting, key=lambda p: (p.step_s, p.index), default=None)

    @property
    def best(self) -> dict[str, Any]:
        """The full options of ``fastest_fitting`` (``ValueError`` naming why when no point fits)."""
        point = self.fastest_fitting
        if point is None:
            raise ValueError(
                f"zcompile.simulate_tune: no point fits {self.hbm_bytes / GIB:.1f} GiB of {self.hardware} HBM"
                + ("" if self.memory_limit_gb is None else f" and memory_limit_gb={self.memory_limit_gb}")
                + "; add activation_memory_budget, a higher stage or more GPUs to the space"
            )
        return {**self.base_options, **point.options}

    def to_dict(self) -> dict[str, Any]:
        def index(point):
            return None if point is None else point.index

        points = [{**asdict(p), "options": jsonable_options(p.options)} for p in self.points]
        return {
            "format": FORMAT,
            "world_size": self.world_size,
            "node_size": self.node_size,
            "hardware": self.hardware,
            "hbm_bytes": self.hbm_bytes,
            "memory_limit_gb": self.memory_limit_gb,
            "wall_s": self.wall_s,
            "base_options": jsonable_options(self.base_options),
            "space": {name: [jsonable_value(v) for v in values] for name, values in self.space.items()},
            "front": [p.index for p in self.front],
            "fastest": index(self.fastest),
            "fastest_fitting": index(self.fastest_fitting),
            "points": points,
        }

    def to_json(self, path: str | None = None) -> str:
        return dumps_to(self.to_dict(), path)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SimulatedTuneResult:
        if data.get("format") != FORMAT:
            raise ValueError(
                f"zcompile.simulate_tune: not a simulate_tune result (format {data.get('format')!r}, "
                f"expected {FORMAT!r})"
            )
        return cls(
            [SimulatedPoint(**p) for p in data["points"]],
            data["base_options"],
            data["space"],
            data["world_size"],
            data["node_size"],
            data["hardware"],
            data["hbm_bytes"],
            data.get("memory_limit_gb"),
            data.get("wall_s", 0.0),
        )

    @classmethod
    def from_json(cls, path: str) -> SimulatedTuneResult:
        with open(path) as handle:
            return cls.from_dict(json.load(handle))

    def print(self) -> None:
        """The points as a table (rich when installed) and the choices: a user-facing call."""
        print_simulated(self)

    def render(self) -> str:
        return render_simulated(self)

    def plot(self, path: str, title: str | None = None) -> None:
        """Step time against memory per GPU, the Pareto front highlighted (matplotlib)."""
        plot_simulated(self, path, title)


def simulate_tune(
    make_model: Callable[[], torch.nn.Module],
    example_batch: Any,
    *,
    space: dict[str, list],
    world_size: int,
    node_size: int | None = None,
    base_options: dict[str, Any] | None = None,
    hardware: str | HardwareProfile = "h100-sxm",
    memory_limit_gb: float | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> SimulatedTuneResult:
    """Simulates every point of ``space`` on top of ``base_options`` (module docstring).

    The arguments are ``zcompile.simulate``'s (``make_model``, one rank's ``example_batch``,
    ``loss_fn(output)``, ``world_size``, ``node_size``, ``hardware``) and ``tune``'s (``space``,
    ``base_options``); ``memory_limit_gb``: GiB per GPU. Bad arguments raise before anything compiles.
    """
    started = time.perf_counter()
    search_space = SearchSpace.build(space, base_options)
    if memory_limit_gb is not None and (
        isinstance(memory_limit_gb, bool)
        or not isinstance(memory_limit_gb, (int, float))
        or not math.isfinite(memory_limit_gb)
        or memory_limit_gb <= 0
    ):
        raise ValueError(
            f"zcompile.simulate_tune: memory_limit_gb must be a positive number (GiB per GPU) or None, got {memory_limit_gb!r}"
        )
    profile = hardware if isinstance(hardware, HardwareProfile) else load_profile(hardware)
    check_world(world_size, node_size)
    node_size = node_size or search_space.base_options.get("node_size") or profile.node_size
    limit = None if memory_limit_gb is None else memory_limit_gb * GIB
    points = []
    for point in search_space.points:
        simulated = simulate_point(
            point, make_model, example_batch, loss_fn, search_space.base_options, world_size, node_size, profile
        )
        if simulated.status == PREDICTED and limit is not None and simulated.memory_bytes > limit:
            simulated.status = PRUNED
            simulated.error = f"{simulated.memory_bytes / GIB:.2f} GiB per GPU, over memory_limit_gb={memory_limit_gb}"
        points.append(simulated)
    result = SimulatedTuneResult(
        points,
        search_space.base_options,
        search_space.space,
        world_size,
        node_size,
        profile.name,
        profile.memory_bytes,
        memory_limit_gb,
        time.perf_counter() - started,
    )
    log.info(
        "simulate_tune: %d points at %d ranks (%s) in %.1f s; front %s, fastest fitting %s",
        len(points),
        world_size,
        profile.name,
        result.wall_s,
        [p.index for p in result.front],
        None if result.fastest_fitting is None else result.fastest_fitting.index,
    )
    return result


def simulate_point(
    point: Point,
    make_model,
    example_batch,
    loss_fn,
    base_options: dict[str, Any],
    world_size: int,
    node_size: int,
    profile: HardwareProfile,
    extrapolate: bool = False,
    parallelize: Callable | None = None,
) -> SimulatedPoint:
    """One ``simulate`` call (``extrapolate``: from shallow copies, ``predict.depth``; a planned
    ``tensor_parallel`` degree among the options: split by ``parallelize``); its failure recorded,
    not raised."""
    simulated = SimulatedPoint(point.index, point.options, point.is_default)
    if point.invalid:
        simulated.status, simulated.error = INVALID, point.invalid
        return simulated
    began = time.perf_counter()
    try:
        options = _resolved_options({**base_options, **point.options}, world_size, node_size, profile)
        tensor_parallel = options.pop(TENSOR_PARALLEL, None) or 1
        result = simulate(
            make_model,
            example_batch,
            world_size=world_size,
            node_size=node_size,
            options=options,
            hardware=profile,
            loss_fn=loss_fn,
            extrapolate=extrapolate,
            tensor_parallel=tensor_parallel,
            parallelize=parallelize,
        )
    except Exception as error:  # noqa: BLE001 - a failing point is recorded, the search goes on
        simulated.status, simulated.error = FAILED, f"{type(error).__name__}: {error}"
        log.warning("zcompile.simulate_tune: point %d %s failed: %s", point.index, point.options, simulated.error)
        return simulated
    finally:
        simulated.simulate_s = time.perf_counter() - began
    simulated.memory_bytes, simulated.memory_parts = result.step_peak_bytes, dict(result.memory)
    simulated.step_s, simulated.exposed_comm_s = result.step_s, result.exposed_comm_s
    simulated.compute_s, simulated.mfu = result.compute_s, result.mfu
    simulated.across_nodes_bytes = result.bytes_by(inside_node=False)
    simulated.extrapolated = result.extrapolated_from is not None
    log.info(
        "simulate_tune: point %d %s: %.2f GiB per GPU, step %.3f s (%.1f s)",
        point.index,
        point.options,
        simulated.memory_bytes / GIB,
        simulated.step_s,
        simulated.simulate_s,
    )
    return simulated


def _resolved_options(
    options: dict[str, Any], world_size: int, node_size: int, profile: HardwareProfile
) -> dict[str, Any]:
    """``options`` with a built-in policy name turned into the policy, on the profile's costs as the
    world's ranks see them (``HardwareProfile.shared_by``, as ``simulate`` prices the step)."""
    name = options.get(POLICY_OPTION)
    if not isinstance(name, str):
        return options
    profile = profile.shared_by(world_size, node_size)
    dtype = ZeroConfig.from_options({**options, POLICY_OPTION: None}).param_dtype or torch.float32
    policy = policy_from_name(name, profile.collective_costs(world_size, node_size), profile.compute_costs(dtype))
    return {**options, POLICY_OPTION: policy}
