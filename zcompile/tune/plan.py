"""``zcompile.plan``: one memory limit per rank in, the fastest options that fit it out, predicted.

    plan = zcompile.plan(make_model, batch, world_size=64, memory_limit_mb="auto", hardware="h100-sxm",
                         options={"param_dtype": "bf16"})
    plan.print()
    model = torch.compile(make_model(), backend="zero", options=plan.options)

The planned options and their trial order are ``tune.plan_space``'s; what the user passes in
``options`` is kept. Each candidate is judged by ``zcompile.simulate`` (the whole model compiled
on fake tensors for ``world_size`` ranks): it fits when its step peak (``predict.step_peak``) is
within the limit with ``PREDICTION_HEADROOM`` to spare, and the plan is the fastest candidate that
fits by the predicted step (per rank's batch of tokens where tp degrees are planned: ``pace_s``).
A stage-3 candidate over the limit is followed at once by its layout's variant keeping fewer
gathered weights (what most separates its variants' memory), down to keeping none.

Simulations are the cost, and a whole model's grows with its depth (a minute or two for a 70B one
on a CPU host). With ``extrapolate`` (the default) each candidate is judged on two shallow copies
of the model, its repeated blocks cut to 2 and 3, extrapolated to its depth (``predict.depth``:
seconds whatever the depth), and the chosen one is then simulated whole: its figures are the whole
simulation's, and if it does not fit after all it is marked over the limit and the next fastest
is simulated whole in turn. The search also skips what cannot fit before simulating it: a
candidate's model states (``estimate_memory``, exact and immediate) plus the saved activations
already simulated for its ``activation_memory_budget`` and tp degree (they do not depend on the
other planned options) is a floor of its peak; above the limit it is dropped with that reason.
At most ``max_simulations`` candidates are simulated, in trial order; when none of them fits, the
others are simulated too, least memory first, up to the first that fits; only when none does the plan gives up, with a ``PlanError`` that names the smallest predicted
peak, its parts and what would make it fit.
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

from zcompile.config import MIB, ZeroConfig, memory_limit_bytes
from zcompile.predict.estimate import estimate_memory
from zcompile.predict.hardware import HardwareProfile, load_profile
from zcompile.predict.simulate import check_world
from zcompile.tune.plan_report import mib, options_text, print_plan
from zcompile.tune.plan_space import (
    CHOSEN,
    FITS,
    NOT_SIMULATED,
    OVER,
    TENSOR_PARALLEL,
    frugality,
    planned_candidates,
)
from zcompile.tune.search import FAILED, INVALID, PREDICTED, PRUNED
from zcompile.tune.serialization import dumps_to, jsonable_options
from zcompile.tune.simulated import SimulatedPoint, simulate_point
from zcompile.tune.space import Point

log = logging.getLogger(__name__)

FORMAT = "zcompile.plan/1"
# a candidate fits when its predicted peak and this share more are within the limit: what the prediction
# leaves out (the batch, gloo's buffers of a reduce in flight, the update's intermediates) measured
# up to 2.5% of the example GPT's peak on gloo (docs/memory-limit.md)
PREDICTION_HEADROOM = 0.05


class PlanError(ValueError):
    """No candidate fits the memory limit: the message names the smallest peak and what would fit."""


@dataclass
class PlanCandidate:
    """One combination of the planned options and what the plan learned of it."""

    options: dict[str, Any]  # the planned options only
    status: str = NOT_SIMULATED  # chosen, fits, over the limit, pruned, not simulated, invalid, failed
    why: str = ""  # why it was dropped (or not simulated)
    peak_bytes: int | None = None  # predicted step peak per rank
    floor_bytes: int | None = None  # a floor of the peak (pruned): model states + activations already known
    memory_parts: dict[str, int] = field(default_factory=dict)  # model states, gathered, kept, activations
    step_s: float | None = None
    exposed_comm_s: float | None = None
    simulate_s: float = 0.0
    extrapolated: bool = False  # its figures from shallow copies (predict.depth), not a whole simulation

    @property
    def pace_s(self) -> float | None:
        """What the plan ranks by: the step's seconds per rank's batch of tokens. A tp group's ranks
        share one batch, so a tp degree t's step is counted t times: tokens per second per GPU,
        inverted, alike for every degree (the step itself where no tp is planned)."""
        return None if self.step_s is None else self.step_s * (self.options.get(TENSOR_PARALLEL) or 1)


@dataclass
class Plan:
    """The planner's answer: ``options`` to pass to the backend, and every candidate it considered."""

    options: dict[str, Any]  # the user's options and the chosen planned ones
    fixed: dict[str, Any]  # the options the user set
    memory_limit_bytes: int
    world_size: int
    node_size: int
    hardware: str
    candidates: list[PlanCandidate]
    wall_s: float = 0.0
    # the chosen tp degree: build the ("dp", "tp") mesh of world_size / tp x tp ranks, split the model
    # over mesh["tp"] and pass the mesh as option 'mesh' (docs/tensor-parallel.md); 1: no tensor parallelism
    tensor_parallel: int = 1

    @property
    def chosen(self) -> PlanCandidate:
        return next(c for c in self.candidates if c.status == CHOSEN)

    @property
    def ranked(self) -> list[PlanCandidate]:
        """The simulated candidates that fit, fastest first."""
        return sorted((c for c in self.candidates if c.status in (CHOSEN, FITS)), key=lambda c: c.pace_s)

    def summary(self) -> str:
        """One line: the choice, its predicted peak by parts, and its predicted step."""
        chosen = self.chosen
        parts = ", ".join(
            f"{name.removesuffix('_bytes').replace('_', ' ')} {mib(nbytes)}"
            for name, nbytes in chosen.memory_parts.items()
            if nbytes
        )
        return (
            f"zcompile.plan: {options_text(chosen.options)} fits {mib(self.memory_limit_bytes)} MiB per rank "
            f"at {self.world_size} ranks ({self.hardware}): peak {mib(chosen.peak_bytes)} MiB ({parts} MiB), "
            f"step {chosen.step_s * 1e3:,.1f} ms predicted; of {len(self.candidates)} candidates "
            f"{sum(c.step_s is not None for c in self.candidates)} simulated"
            f"{self._extrapolated_note()}, "
            f"{sum(c.status == PRUNED for c in self.candidates)} pruned unsimulated, "
            f"{sum(c.status == NOT_SIMULATED for c in self.candidates)} not reached; {self.wall_s:.0f} s"
        )

    def _extrapolated_note(self) -> str:
        shallow = sum(c.extrapolated for c in self.candidates)
        return f" ({shallow} extrapolated from shallow copies, the chosen whole)" if shallow else ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "options": jsonable_options(self.options),
            "fixed": jsonable_options(self.fixed),
            "memory_limit_bytes": self.memory_limit_bytes,
            "world_size": self.world_size,
            "node_size": self.node_size,
            "hardware": self.hardware,
            "wall_s": self.wall_s,
            "tensor_parallel": self.tensor_parallel,
            "candidates": [{**asdict(c), "options": jsonable_options(c.options)} for c in self.candidates],
        }

    def to_json(self, path: str | None = None) -> str:
        return dumps_to(self.to_dict(), path)

    def print(self) -> None:
        """The candidates as a table (rich when installed) and the summary line: a user-facing call."""
        print_plan(self)


def plan(
    make_model: Callable[[], torch.nn.Module],
    example_batch: Any,
    *,
    world_size: int,
    memory_limit_mb: float | str = "auto",
    hardware: str | HardwareProfile = "h100-sxm",
    node_size: int | None = None,
    options: dict[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    max_simulations: int = 16,
    simulated: dict[str, Any] | None = None,
    extrapolate: bool = True,
    tensor_parallel: str | int | tuple[int, ...] = "auto",
    parallelize: Callable[[torch.nn.Module, Any], Any] | None = None,
) -> Plan:
    """The fastest options within ``memory_limit_mb`` per rank, predicted (module doc).

    The arguments are ``zcompile.simulate``'s; ``options``: the user's, kept; ``memory_limit_mb``:
    MiB per rank, a size string or ``"auto"``; ``simulated``: a dict the plan reads and fills with
    each candidate's simulation (keyed by its options), to plan for several limits at the cost of
    one; ``extrapolate``: judge candidates on shallow copies, the chosen one whole (module doc);
    ``tensor_parallel``: the tp degrees to plan (``"auto"``: those ``tensor_parallel_degrees``
    finds for the model; an int or a tuple: those), each split by ``parallelize(model, tp_mesh)``
    (default ``zcompile.apply_tp_plan``, a transformers model's declared plan); the chosen degree
    is ``Plan.tensor_parallel``. ``PlanError`` when nothing fits.
    """
    started = time.perf_counter()
    fixed = dict(options or {})
    ZeroConfig.from_options(fixed)  # the user's options checked, naming the option, before anything compiles
    profile = hardware if isinstance(hardware, HardwareProfile) else load_profile(hardware)
    check_world(world_size, node_size)
    node_size = node_size or fixed.get("node_size") or profile.node_size
    limit = memory_limit_bytes(memory_limit_mb, profile.memory_bytes)
    cache = {} if simulated is None else simulated
    model = _fake_model(make_model)
    degrees = tensor_parallel_degrees(model, tensor_parallel, world_size, node_size, fixed, parallelize)

    def simulated_point(options: dict[str, Any], extrapolated: bool) -> SimulatedPoint:
        key = json.dumps({**jsonable_options(options), "(extrapolated)": extrapolated}, sort_keys=True)
        if key not in cache:
            point = Point(0, options, False)
            cache[key] = simulate_point(
                point, make_model, example_batch, loss_fn, {}, world_size, node_size, profile, extrapolated, parallelize
            )
        return cache[key]

    return search_plan(
        model,
        fixed,
        limit,
        world_size,
        node_size,
        profile.name,
        lambda options: simulated_point(options, extrapolate),
        max_simulations,
        started,
        confirm=(lambda options: simulated_point(options, False)) if extrapolate else None,
        tensor_parallel=degrees,
    )


def tensor_parallel_degrees(
    model: torch.nn.Module, asked, world_size: int, node_size: int, fixed: dict[str, Any], parallelize
) -> tuple[int, ...]:
    """The tp degrees ``zcompile.plan`` tries. ``"auto"``: 1, and where the model can be split (a
    ``parallelize`` given, or a transformers config's ``base_model_tp_plan``) and no ``mesh`` option
    is set, the powers of two up to the node that divide the world and, for a transformers config,
    its attention and key-value heads. An int or a tuple: those, checked."""
    if asked == "auto":
        config = getattr(model, "config", None)
        if fixed.get("mesh") is not None or (parallelize is None and not getattr(config, "base_model_tp_plan", None)):
            return (1,)
        heads = [getattr(config, name, None) for name in ("num_attention_heads", "num_key_value_heads")]
        return tuple(
            tp
            for tp in (2**i for i in range(node_size.bit_length()))
            if world_size % tp == 0 and all(not h or h % tp == 0 for h in heads)
        )
    degrees = (asked,) if isinstance(asked, int) and not isinstance(asked, bool) else asked
    if (
        not isinstance(degrees, (tuple, list))
        or not degrees
        or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 or world_size % t for t in degrees)
    ):
        raise ValueError(
            f"zcompile.plan: tensor_parallel must be 'auto', or an int or a tuple of ints >= 1 that divide "
            f"world_size={world_size}, got {asked!r}"
        )
    if fixed.get("mesh") is not None and tuple(degrees) != (1,):
        raise ValueError("zcompile.plan: give tensor_parallel degrees or the option 'mesh', not both")
    return tuple(degrees)


def search_plan(
    model: torch.nn.Module,
    fixed: dict[str, Any],
    limit: int,
    world_size: int,
    node_size: int,
    hardware: str,
    evaluate: Callable[[dict[str, Any]], SimulatedPoint],
    max_simulations: int,
    started: float,
    confirm: Callable[[dict[str, Any]], SimulatedPoint] | None = None,
    tensor_parallel: tuple[int, ...] = (1,),
) -> Plan:
    """The search of the module doc over ``tune.plan_space``'s candidates around the ``fixed`` options:
    ``evaluate(options)`` predicts one (a simulation, or a compile beside the real run), ``model``
    (its parameters; fake tensors will do) gives each candidate's model states; ``confirm(options)``,
    where ``evaluate``'s figures are extrapolated, predicts the chosen one whole; ``tensor_parallel``:
    the tp degrees planned (their candidates' model states are floored by the unsplit model's over
    the whole world, which a tp layout's replicated weights only add to)."""
    if isinstance(max_simulations, bool) or not isinstance(max_simulations, int) or max_simulations < 1:
        raise ValueError(f"zcompile.plan: max_simulations must be an int >= 1, got {max_simulations!r}")
    dtype = ZeroConfig.from_options(fixed).param_dtype or torch.float32
    gathered_mib = sum(p.numel() for p in dict.fromkeys(model.parameters())) * dtype.itemsize / MIB
    candidates = [
        PlanCandidate(c) for c in planned_candidates(fixed, gathered_mib, world_size, node_size, tensor_parallel)
    ]
    activations: dict[Any, int] = {}  # activation_memory_budget -> saved activation bytes simulated
    evaluated: set[str] = set()

    def judge(candidate: PlanCandidate, *, budgeted: bool) -> None:
        options = {**fixed, **candidate.options}
        try:
            config = ZeroConfig.from_options({k: v for k, v in options.items() if k != TENSOR_PARALLEL})
            states = estimate_memory(model, world_size, config.replace(node_size=node_size)).model_states_bytes
        except ValueError as error:
            candidate.status, candidate.why = INVALID, str(error)
            return
        budget_key = repr((config.activation_memory_budget, options.get(TENSOR_PARALLEL)))
        floor = states + activations.get(budget_key, 0)
        if floor * (1 + PREDICTION_HEADROOM) > limit:
            known = f" + saved activations {mib(activations[budget_key])}" if budget_key in activations else ""
            candidate.status, candidate.floor_bytes = PRUNED, floor
            candidate.memory_parts = {
                "model_states_bytes": states,
                "saved_activation_bytes": activations.get(budget_key, 0),
            }
            candidate.why = f"at least {mib(floor)} MiB: model states {mib(states)}{known} MiB"
            return
        if budgeted and len(evaluated) >= max_simulations:
            candidate.why = f"max_simulations={max_simulations} reached"
            return
        evaluated.add(json.dumps(jsonable_options(options), sort_keys=True))
        _record(candidate, evaluate(options), limit)
        if candidate.memory_parts:
            activations[budget_key] = candidate.memory_parts.get("saved_activation_bytes", 0)

    for candidate in candidates:
        judge(candidate, budgeted=True)
        # kept weights are most of the gap between a stage-3 layout's variants: over the limit, the
        # same layout keeping less, before the next layout (bucket and prefetch as they were)
        while candidate.status == OVER and (leaner := _keeping_less(candidate, candidates)) is not None:
            if leaner.status != NOT_SIMULATED:
                break
            judge(leaner, budgeted=True)
            candidate = leaner
    if not any(c.status == FITS for c in candidates):  # over budget: the rest, least memory first, to the first fit
        for candidate in sorted(candidates, key=lambda c: frugality(c.options)):
            if candidate.status == NOT_SIMULATED:
                judge(candidate, budgeted=False)
                if candidate.status == FITS:
                    break
    best = _confirmed_fastest(candidates, fixed, limit, confirm)
    wall = time.perf_counter() - started
    if best is None:
        raise PlanError(_nothing_fits(candidates, limit, world_size, fixed))
    best.status = CHOSEN
    options = {k: v for k, v in {**fixed, **best.options}.items() if k != TENSOR_PARALLEL}
    tp = best.options.get(TENSOR_PARALLEL) or 1
    result = Plan(options, fixed, limit, world_size, node_size, hardware, candidates, wall, tp)
    log.info("%s", result.summary())
    return result


def _keeping_less(candidate: PlanCandidate, candidates: list[PlanCandidate]) -> PlanCandidate | None:
    """The candidate with ``candidate``'s options but the next smaller ``keep_gathered_mb``, if any."""
    keep = candidate.options.get("keep_gathered_mb")
    if not keep:
        return None
    others = {k: v for k, v in candidate.options.items() if k != "keep_gathered_mb"}
    smaller = [
        c
        for c in candidates
        if (c.options.get("keep_gathered_mb") or 0.0) < keep
        and {k: v for k, v in c.options.items() if k != "keep_gathered_mb"} == others
    ]
    return max(smaller, key=lambda c: c.options.get("keep_gathered_mb") or 0.0, default=None)


def _confirmed_fastest(
    candidates: list[PlanCandidate], fixed: dict[str, Any], limit: int, confirm
) -> PlanCandidate | None:
    """The fastest candidate that fits (by ``PlanCandidate.pace_s``); with ``confirm``, the fastest
    that still fits simulated whole (one that does not is left over the limit, with its whole
    figures, and the next is tried)."""
    while True:
        fitting = [c for c in candidates if c.status == FITS]
        if not fitting:
            return None
        best = min(fitting, key=lambda c: c.pace_s)
        if confirm is None or not best.extrapolated:
            return best
        spent = best.simulate_s
        _record(best, confirm({**fixed, **best.options}), limit)
        best.simulate_s += spent
        if best.status == FITS:
            return best
        best.why += " simulated whole (extrapolated, it fitted)"


def _record(candidate: PlanCandidate, point, limit: int) -> None:
    """A simulated point's figures on ``candidate``, and whether it fits."""
    candidate.simulate_s = point.simulate_s
    candidate.extrapolated = point.extrapolated
    if point.status == FAILED:
        candidate.status, candidate.why = FAILED, point.error
        return
    candidate.peak_bytes, candidate.memory_parts = point.memory_bytes, dict(point.memory_parts)
    candidate.step_s, candidate.exposed_comm_s = point.step_s, point.exposed_comm_s
    if point.status == PREDICTED and point.memory_bytes * (1 + PREDICTION_HEADROOM) <= limit:
        candidate.status, candidate.why = FITS, ""
    else:
        candidate.status = OVER
        candidate.why = f"peak {mib(point.memory_bytes)} MiB"


def _fake_model(make_model: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """The model on fake tensors (nothing allocated): what ``estimate_memory`` reads of its parameters."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return make_model()


def _nothing_fits(candidates: list[PlanCandidate], limit: int, world_size: int, fixed: dict[str, Any]) -> str:
    """The refusal: the smallest predicted peak, its parts, and what would make it fit."""
    simulated = [c for c in candidates if c.peak_bytes is not None]
    head = f"zcompile.plan: nothing fits memory_limit_mb={mib(limit)} MiB per rank at {world_size} ranks"
    fixed_text = f" with the options you set ({', '.join(sorted(fixed))})" if fixed else ""
    if not simulated:
        pruned = [c for c in candidates if c.status == PRUNED]
        if not pruned:
            reasons = "; ".join(sorted({c.why for c in candidates if c.why}))[:600]
            return f"{head}{fixed_text}: no candidate could be simulated ({reasons})"
        smallest = min(pruned, key=lambda c: c.floor_bytes)
        ranks = math.ceil(world_size * smallest.floor_bytes * (1 + PREDICTION_HEADROOM) / limit)
        return (
            f"{head}{fixed_text}: the model states alone are over it ({options_text(smallest.options)}: "
            f"{smallest.why}). To fit: more ranks (at stage 3 the states shrink as 1/ranks: at least {ranks} for "
            "them alone), or drop a fixed option that keeps them large"
        )
    smallest = min(simulated, key=lambda c: c.peak_bytes)
    peak, exact = smallest.peak_bytes, True
    pruned = [c for c in candidates if c.status == PRUNED and c.floor_bytes < peak]
    if pruned:  # a candidate dropped unsimulated may be smaller than any simulated: its floor is what is known
        smallest = min(pruned, key=lambda c: c.floor_bytes)
        peak, exact = smallest.floor_bytes, False
    parts = smallest.memory_parts
    states = parts.get("model_states_bytes", 0)
    saved = parts.get("saved_activation_bytes", 0)
    room = limit / (1 + PREDICTION_HEADROOM)  # what the predicted peak may reach
    rest = peak - states
    fixes = []
    if rest < room and smallest.options.get("stage", fixed.get("stage")) == 3 and states:
        ranks = math.ceil(world_size * states / (room - rest))
        fixes.append(f"at least {ranks} ranks (model states shrink as 1/ranks at stage 3)")
    if saved:
        left = room - (peak - saved)
        if 0 < left < saved:
            fixes.append(
                f"a micro-batch or sequence at least {100 * (1 - left / saved):.0f}% shorter (saved activations "
                "scale with the tokens per rank)"
            )
    listed = ", ".join(
        f"{name.removesuffix('_bytes').replace('_', ' ')} {mib(nbytes)} MiB" for name, nbytes in parts.items() if nbytes
    )
    fix = "; or ".join(fixes) if fixes else "more ranks and a smaller micro-batch together"
    return (
        f"{head}{fixed_text}: the smallest predicted peak is {'' if exact else 'at least '}{mib(peak)} MiB "
        f"({options_text(smallest.options)}: {listed}), and a candidate fits with "
        f"{100 * PREDICTION_HEADROOM:.0f}% to spare. To fit: {fix}"
    )
