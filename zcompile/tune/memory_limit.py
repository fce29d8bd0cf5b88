"""Option ``memory_limit_mb`` at the backend's first compile: ``zcompile.plan``'s search, each candidate
predicted by compiling the graph Dynamo gave beside the real run.

A candidate is compiled by ``zero_backend`` itself on fake copies of the graph's inputs (nothing
allocated, no parameter of the model sharded, no rank check, no store exchange: the functional
collectives of fake tensors do not communicate), its forward and backward run once on them, and
``predict.simulate.predict_compiled`` gives its step peak and step on the profile of this device.
Every rank makes the same prediction from the same graph; the compile check then compares the
ranks' limits and choices with their collectives (``memory_plan``: a ``RankDivergenceError`` naming
``memory_limit_mb`` otherwise), and the choice is kept on the model, so the model's later graphs
(after a graph break, a recompile) take the same options.

What it sees: the first graph's activations with the whole model's states, so a model compiled in
several graphs is planned from its first, and each later graph says so (a warning, once). The profile: ``cpu-local`` on a CPU, by device name on
CUDA (H100 -> ``h100-sxm``, A100 -> ``a100-80gb``, else ``h100-sxm``'s costs with a warning); ``"auto"``
reads the device's memory (a CPU: the host's memory shared by its local ranks).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zcompile.backend.entry_point import zero_backend
from zcompile.config import MEMORY_PLAN_ATTR, ZeroConfig, memory_limit_bytes
from zcompile.predict.hardware import HardwareProfile, load_profile
from zcompile.predict.simulate import predict_compiled
from zcompile.tune.plan import Plan, search_plan
from zcompile.tune.plan_report import options_text
from zcompile.tune.search import FAILED, PREDICTED
from zcompile.tune.simulated import SimulatedPoint

log = logging.getLogger(__name__)

_WARNED_ATTR = "_zcompile_memory_plan_reused"  # on the model: a later graph was told it is not in the plan
MAX_CANDIDATES_COMPILED = 8
CANDIDATE_TIMEOUT_S = 600.0
_PROFILE_BY_DEVICE_NAME = (("H100", "h100-sxm"), ("A100", "a100-80gb"))


def planned_options(
    gm: torch.fx.GraphModule, example_inputs: list, options: Any, model: torch.nn.Module | None
) -> dict[str, Any]:
    """The options to compile ``gm`` with: ``options`` without ``memory_limit_mb`` and with the plan's
    choices, planned at the model's first compile (module doc) and reused for its later graphs."""
    given = dict(options) if isinstance(options, dict) else _set_fields(options)
    fixed = {name: value for name, value in given.items() if name != "memory_limit_mb"}
    kept = None if model is None else model.__dict__.get(MEMORY_PLAN_ATTR)
    if kept is not None and kept.fixed == fixed:
        if not model.__dict__.get(_WARNED_ATTR):
            model.__dict__[_WARNED_ATTR] = True
            log.warning(
                "zcompile: memory_limit_mb was planned from %s's first compiled graph; another graph (a graph "
                "break, blocks compiled one by one, a recompile) takes the same options, but the activations it "
                "saves were not in the plan. Remove the graph break, or check the peak with zcompile.step_report "
                "or zcompile.timeline.record_step",
                type(model).__name__,
            )
        return _with_record(kept, given)
    plan = plan_at_compile(gm, example_inputs, given, fixed, model)
    if model is not None:
        model.__dict__[MEMORY_PLAN_ATTR] = plan
    return _with_record(plan, given)


def _with_record(plan: Plan, given: dict) -> dict[str, Any]:
    """The plan's options with its record (``memory_plan``), which the compile check compares across
    ranks: a rank that planned alone, or chose otherwise, is a ``RankDivergenceError`` on every rank."""
    return {**plan.options, "memory_plan": f"{given['memory_limit_mb']} MiB: {options_text(plan.chosen.options)}"}


def plan_at_compile(
    gm: torch.fx.GraphModule, example_inputs: list, given: dict, fixed: dict, model: torch.nn.Module | None
) -> Plan:
    started = time.perf_counter()
    config = ZeroConfig.from_options(given)
    world = config.group.size() if config.group is not None else (dist.get_world_size() if dist.is_initialized() else 1)
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    node_size = config.node_size or (int(local) if local.isdigit() and int(local) > 0 else world)
    device = next((v.device for v in example_inputs if isinstance(v, torch.Tensor)), torch.device("cpu"))
    profile = profile_for_device(device)
    limit = memory_limit_bytes(config.memory_limit_mb, device_memory_bytes(device, node_size))
    time_sharing = profile.time_sharing(world, node_size)
    shared = profile.shared_by(world, node_size)
    params = [v for v in example_inputs if isinstance(v, torch.nn.Parameter)]
    holder = model if model is not None else _ParameterHolder(params)

    def evaluate(options: dict[str, Any]) -> SimulatedPoint:
        return in_own_thread(
            lambda: compile_candidate(gm, example_inputs, options, holder, world, node_size, shared, time_sharing),
            options,
        )

    plan = search_plan(holder, fixed, limit, world, node_size, profile.name, evaluate, MAX_CANDIDATES_COMPILED, started)
    log.info("%s", plan.summary())
    return plan


def in_own_thread(work: Callable[[], SimulatedPoint], options: dict[str, Any]) -> SimulatedPoint:
    """``work()`` on a thread of its own: Dynamo's compile of the real graph is under way on this one,
    and its per-thread state (the metrics of the compile, the tracing context) must not take the
    candidate's compile and backward for its own. Bounded: a candidate that does not finish in
    ``CANDIDATE_TIMEOUT_S`` is recorded as failed."""
    box: list = []
    thread = threading.Thread(target=lambda: box.append(work()), name="zcompile-plan", daemon=True)
    thread.start()
    thread.join(CANDIDATE_TIMEOUT_S)
    if box:
        return box[0]
    point = SimulatedPoint(0, options, False, status=FAILED)
    point.error = "did not finish" if thread.is_alive() else "raised outside the candidate's compile"
    point.error += f" within {CANDIDATE_TIMEOUT_S:.0f} s"
    return point


def compile_candidate(
    gm: torch.fx.GraphModule,
    example_inputs: list,
    options: dict[str, Any],
    model: torch.nn.Module,
    world: int,
    node_size: int,
    profile: HardwareProfile,
    time_sharing: float,
) -> SimulatedPoint:
    """One candidate compiled on fake copies of the inputs and run once forward and backward (module doc)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    point = SimulatedPoint(0, options, False)
    began = time.perf_counter()
    graphs: list = []
    try:
        config = ZeroConfig.from_options(options).replace(
            check_ranks=False,
            sync_module_states=False,
            dump=None,
            on_compile=graphs.append,
            compiler="eager",  # fake tensors: nothing to generate code for
        )
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        fakes = [_fake_copy(value, fake_mode) for value in example_inputs]
        compiled = zero_backend(gm, fakes, config)
        # the states and the optimizer's step read the shards: the graph's fake parameters, which the
        # compile sharded, and the model's others (analytic)
        in_graph = {id(v) for v in example_inputs if isinstance(v, torch.nn.Parameter)}
        states_of = _ParameterHolder(
            [v for v in fakes if isinstance(v, torch.nn.Parameter)]
            + [p for p in model.parameters() if id(p) not in in_graph]
        )
        with fake_mode:
            outputs = compiled(*fakes)
            loss = sum(
                o.float().sum()
                for o in outputs
                if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point()
            )
            if isinstance(loss, torch.Tensor):
                loss.backward()
        result = predict_compiled(graphs, states_of, config, world, node_size, profile, 0, time_sharing)
    except Exception as error:  # noqa: BLE001 - a candidate that fails is recorded, the search goes on
        point.status, point.error = FAILED, f"{type(error).__name__}: {error}"
        log.warning("zcompile: memory_limit_mb candidate %s failed: %s", options_text(options), point.error)
        return point
    finally:
        point.simulate_s = time.perf_counter() - began
    point.status = PREDICTED
    point.memory_bytes, point.memory_parts = result.step_peak_bytes, dict(result.memory)
    point.step_s, point.exposed_comm_s = result.step_s, result.exposed_comm_s
    return point


def profile_for_device(device: torch.device) -> HardwareProfile:
    """The hardware profile whose costs rank the candidates on ``device`` (module doc)."""
    if device.type != "cuda":
        return load_profile("cpu-local")
    name = torch.cuda.get_device_name(device)
    for marker, profile in _PROFILE_BY_DEVICE_NAME:
        if marker in name:
            return load_profile(profile)
    log.warning("zcompile: no hardware profile for %s; memory_limit_mb ranks candidates by h100-sxm's costs", name)
    return load_profile("h100-sxm")


def device_memory_bytes(device: torch.device, local_ranks: int) -> int:
    """What ``memory_limit_mb="auto"`` starts from: the GPU's memory, or the host's shared by its ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, local_ranks)


def _fake_copy(value: Any, fake_mode) -> Any:
    """A fake tensor of ``value``'s shape (a parameter stays a parameter: the sharding plan finds them so)."""
    if not isinstance(value, torch.Tensor):
        return value
    fake = fake_mode.from_tensor(value.detach(), static_shapes=True)
    if isinstance(value, torch.nn.Parameter):
        return torch.nn.Parameter(fake, requires_grad=value.requires_grad)
    return fake.requires_grad_(value.requires_grad) if value.is_leaf and value.requires_grad else fake


def _set_fields(config: ZeroConfig) -> dict[str, Any]:
    """The options of a ``ZeroConfig`` that differ from the defaults: what its maker set."""
    default = ZeroConfig()
    return {
        name: getattr(config, name)
        for name in config.__dataclass_fields__
        if getattr(config, name) is not getattr(default, name) and getattr(config, name) != getattr(default, name)
    }


class _ParameterHolder(torch.nn.Module):
    """The graph's parameters as a module, where the compiled frame has no model to read states from."""

    def __init__(self, params: list[torch.nn.Parameter]):
        super().__init__()
        self._held = torch.nn.ParameterList(params)
