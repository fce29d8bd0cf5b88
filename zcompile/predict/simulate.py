"""``simulate``: compile a model for a world of ranks this machine does not have, and predict its step.

``simulate(make_model, example_batch, world_size=1024, options=..., hardware="h100-sxm")`` builds
the model under a ``FakeTensorMode`` (parameters with shapes and dtypes, no storage), starts
torch's fake process group of ``world_size`` ranks (``torch.testing._internal.distributed.fake_pg``:
collectives return at once, nothing is sent) and runs one forward and backward through the real
zero backend and its passes on fake inputs. Nothing is allocated at full size: shards of fake
parameters are fake too (``sharding.shards``).

This process plays rank 0. The choices that depend on the rank are the shard sizes (rank 0 holds
a full chunk, the largest) and the hpZ/qgZ group layout (rank 0's node); the plans (buckets,
schedule, kept weights) read only the graph and are the same on every rank. The compile-time rank
check and the step agreement are off: there are no other ranks to ask. ``node_size`` is also the
ZeRO++ option ``node_size`` (``hpz_size="node"``, qgZ's hierarchy) unless the options set it.

From the compiled graphs it returns:

- memory per rank: model states by ``estimate_memory``'s allocation rules (equal to ZeRO's
  formulas up to padding), the gathered peak of the schedule, kept weights and saved activations by
  ``passes.liveness``, as ``step_report`` counts them; and the step's peak from a walk over the
  compiled graphs (``zcompile.predict.step_peak``: the parts plus backward's transients, forward's
  intermediates and the gradients made so far), with the phase that holds it;
- every collective of a step with its bytes, its group's size, whether its group's ranks stay
  inside a node and its predicted transfer time, plus the optimizer's all-gather and
  reduce-scatter of stages 1 and 2 (not in the graphs);
- the predicted step time and exposed communication (``cost_model.predict_step`` with the hardware
  profile's costs, each collective priced on its own group's link: ``HardwareProfile.link_costs``),
  the optimizer's communication added as exposed and its update as compute (``zcompile.optim.AdamW``
  over rank 0's shards: its fused kernel, one pass reading parameter, gradient and both moments
  and writing three of them, on a GPU the Triton kernel, on a CPU torch's own, at the profile's
  memory bandwidth, which torch's CPU kernel reaches only in part: the CPU update is predicted
  shorter than it runs), and
  MFU: 6 x parameters x tokens per step over the step time and the profile's peak FLOP/s. A CPU
  profile adds the host's time per graph call and per trained parameter (``host_overhead_s``,
  ``HardwareProfile.host_overhead_seconds``), which a GPU's host spends ahead of the device. With
  more ranks on a node than the profile's ``host_cores`` every figure of time is that ratio slower
  (``HardwareProfile.shared_by``): the ranks take turns.
- the ranks' agreements through the store (``zcompile.agreement.step_agreement``, with the default
  ``check_ranks=True``): the step's, and one before each training call of a graph whose calls are
  agreed (``backend.entry_point.agrees_on_each_call``: stages 2 and 3) but the first after the step. One server
  answers every rank's requests, 5 per rank an exchange (``store_exchange.ANSWERED_REQUESTS_PER_EXCHANGE``),
  each waiting its round trip or the server's turn through the N ranks' (``HardwareProfile.store_seconds``),
  so an exchange's time grows with N once the server is busy. Blocks compiled one by one, or a graph
  break in the layer loop, make one a layer. On a CPU profile the host's waits add to the step; on a
  GPU's the host runs ahead of the device, and they show where they outlast the device's step. A
  loop that clips gradients makes one more a step at stages 2 and 3, not counted: the simulation
  does not clip.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from zcompile.agreement.store_exchange import ANSWERED_REQUESTS_PER_EXCHANGE
from zcompile.backend.entry_point import agrees_on_each_call
from zcompile.common.process_group import group_ranks_by_name
from zcompile.config import ZeroConfig
from zcompile.optim.buckets import plan_optimizer_buckets, plan_reduce_buckets, replayed_step_buffer_peak
from zcompile.passes.collectives import collective_nodes
from zcompile.passes.liveness import gathered_peak_parts, saved_activation_bytes
from zcompile.predict import depth
from zcompile.predict.cost_model import ComputeCosts, predict_step, step_graphs
from zcompile.predict.estimate import estimate_memory, fake_call
from zcompile.predict.hardware import HardwareProfile, LinkCosts, load_profile
from zcompile.predict.step_peak import step_peak
from zcompile.sharding.shards import shard_of

log = logging.getLogger(__name__)
STORE_SHARE_WORTH_A_WARNING = 0.1  # of the predicted step
OPTIMIZER_BUCKET_MB = 4.0  # zcompile.optim's default bucket_mb: the optimizer the simulation assumes


@dataclass
class SimulatedCollective:
    where: str  # forward, backward or optimizer
    kind: str
    bytes: int
    group_size: int
    inside_node: bool  # its group's ranks are on one node: priced on the intra-node link
    seconds: float = 0.0  # predicted transfer time
    graph: str = ""  # forward0, backward0 (cost_model.StepGraph.name); "" for the optimizer's
    node: str = ""  # the collective's node in that graph


@dataclass
class SimulationResult:
    world_size: int
    node_size: int
    hardware: str
    num_params: int
    tokens_per_rank: int
    memory: dict[str, int]  # bytes per rank, the parts of step_report().memory
    collectives: list[SimulatedCollective] = field(default_factory=list)
    step_s: float = 0.0
    compute_s: float = 0.0  # the graphs' compute and the optimizer's update
    exposed_comm_s: float = 0.0
    optimizer_update_s: float = 0.0  # the optimizer's update of this rank's shards
    # the host's time per graph call and trained parameter (the profile's; 0 on a GPU profile)
    host_overhead_s: float = 0.0
    graph_calls: int = 0  # compiled graph calls per step (forward and backward graphs)
    store_exchanges: int = 0  # the ranks' agreements through the store per step (module docstring)
    store_s: float = 0.0  # their time on the store (HardwareProfile.store_seconds: round trip or the server's turn)
    mfu: float = 0.0
    simulate_s: float = 0.0  # wall time of the simulation itself
    step_peak_bytes: int = (
        0  # the most bytes per rank during a step (zcompile.predict.step_peak), model states included
    )
    step_peak_phase: str = ""  # the phase that holds it: forward<i>, backward<i> or optimizer
    time_sharing: float = 1.0  # HardwareProfile.time_sharing: ranks over the host's cores, where more
    tensor_parallel: int = 1  # the tp degree (simulate's tensor_parallel): each tp group shares its tokens
    # (blocks of the two copies simulated, the model's blocks) when extrapolated (predict.depth); None: whole
    extrapolated_from: tuple[int, int, int] | None = None

    @property
    def per_rank_bytes(self) -> int:
        return sum(
            self.memory[k]
            for k in (
                "model_states_bytes",
                "peak_gathered_bytes",
                "gather_staging_bytes",
                "kept_gathered_bytes",
                "saved_activation_bytes",
            )
        )

    @property
    def tokens_per_s_per_rank(self) -> float:
        """Tokens a second per rank of the global batch (a tp group's ranks share their tokens)."""
        return self.tokens_per_rank / self.tensor_parallel / self.step_s if self.step_s else 0.0

    def bytes_by(self, where: str | None = None, inside_node: bool | None = None) -> int:
        return sum(
            c.bytes
            for c in self.collectives
            if (where is None or c.where == where) and (inside_node is None or c.inside_node == inside_node)
        )

    def to_dict(self) -> dict:
        """The result as JSON data, the collectives summed per kind and where they run."""
        totals: dict[str, dict] = {}
        for c in self.collectives:
            entry = totals.setdefault(
                f"{c.where} {c.kind}", {"count": 0, "bytes": 0, "across_nodes_bytes": 0, "seconds": 0.0}
            )
            entry["count"] += 1
            entry["bytes"] += c.bytes
            entry["across_nodes_bytes"] += 0 if c.inside_node else c.bytes
            entry["seconds"] += c.seconds
        return {
            **{k: v for k, v in asdict(self).items() if k != "collectives"},
            "collectives": totals,
            "per_rank_bytes": self.per_rank_bytes,
        }


def simulate(
    make_model: Callable[[], torch.nn.Module],
    example_batch: Any,
    *,
    world_size: int,
    node_size: int | None = None,
    options: ZeroConfig | dict | None = None,
    hardware: str | HardwareProfile = "h100-sxm",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    tensor_parallel: int = 1,
    parallelize: Callable[[torch.nn.Module, Any], Any] | None = None,
    extrapolate: bool = False,
) -> SimulationResult:
    """Compiles ``make_model()`` for ``world_size`` ranks without them and predicts memory and time (module doc).

    ``example_batch``: one rank's inputs (a tensor, a tuple of positional or a dict of keyword
    arguments); ``loss_fn(output)`` makes the scalar to differentiate (default: the output if it is
    a tensor, else its ``loss``); ``node_size``: ranks per node (default the profile's).
    ``tensor_parallel``: a tp degree > 1 makes the ``("dp", "tp")`` mesh of ``world_size / tp`` x
    ``tp`` ranks (tp consecutive ranks, inside a node), splits the model with ``parallelize(model,
    mesh["tp"])`` (default ``zcompile.apply_tp_plan``: a transformers model's declared plan) and
    shards its pieces over ``mesh["dp"]`` (option ``mesh``); with option ``shard_size`` S, over shard groups
    of S data-parallel ranks, replicated across them (the 3-D mesh ``(dp / S, S, tp)``).
    ``extrapolate``: simulate two shallow copies of the model (2 and 3 of its repeated blocks) and
    extrapolate to its depth (``predict.depth``: seconds instead of minutes for a deep model; the
    result's ``extrapolated_from`` says so); a model without a stack of ``predict.depth.MIN_DEPTH`` (8)
    blocks or more is simulated whole.
    """
    if extrapolate:
        return _extrapolated(
            make_model,
            example_batch,
            dict(
                world_size=world_size,
                node_size=node_size,
                options=options,
                hardware=hardware,
                loss_fn=loss_fn,
                tensor_parallel=tensor_parallel,
                parallelize=parallelize,
            ),
        )
    check_world(world_size, node_size)
    check_tensor_parallel(world_size, tensor_parallel, options)
    profile = hardware if isinstance(hardware, HardwareProfile) else load_profile(hardware)
    config = ZeroConfig.from_options(options)
    checks_ranks = config.check_ranks  # the user's: priced, though there are no ranks here to check
    # one process stands for every rank: nothing to check or to take from rank 0; the graphs run on
    # fake tensors, which the eager compiler handles without code generation
    config = config.replace(
        check_ranks=False, sync_module_states=False, compiler="eager" if config.compiler == "auto" else config.compiler
    )
    on_gloo = profile.device_type == "cpu"  # the fake group has no backend: the profile's device says which
    if config.reduce_scatter == "auto":
        config = config.replace(reduce_scatter="all_to_all" if on_gloo else "native")
    node_size = _node_size(node_size, config, profile)
    config = config.replace(node_size=node_size)
    # more ranks on a node than its host has cores (a CPU profile): each rank's figures, time-shared
    time_sharing = profile.time_sharing(world_size, node_size)
    profile = profile.shared_by(world_size, node_size)
    start = time.perf_counter()
    graphs: list = []
    user_hook = config.on_compile
    config = config.replace(on_compile=lambda g: (graphs.append(g), user_hook and user_hook(g)))
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_world(world_size, node_size):
        with fake_mode:
            model = make_model()
        if tensor_parallel > 1:
            model, config = _split_over_tensor_parallel(model, config, world_size, tensor_parallel, parallelize)
        args, kwargs = fake_call(example_batch, fake_mode)
        torch._dynamo.reset()
        try:
            output = torch.compile(model, backend="zero", options=config)(*args, **kwargs)
            # under the fake mode: the gradients AOTAutograd makes for outputs the loss does not use (a
            # causal LM's logits beside its loss) are zeros of their shape, real ones outside it
            with fake_mode:
                _loss(output, loss_fn).backward()
        finally:
            torch._dynamo.reset()
        if tensor_parallel > 1:
            _refuse_groups_of_another_world(graphs)
        exchanges = _store_exchanges(graphs, world_size) if checks_ranks else 0
        result = predict_compiled(
            graphs, model, config, world_size, node_size, profile, _tokens(args, kwargs), time_sharing, exchanges
        )
    result.simulate_s = time.perf_counter() - start
    log.info(
        "simulate: %d parameters on %d ranks (%s): %.1f MiB per rank, step %.3f s, MFU %.1f%%",
        result.num_params,
        world_size,
        profile.name,
        result.per_rank_bytes / 2**20,
        result.step_s,
        100 * result.mfu,
    )
    return result


def _extrapolated(make_model: Callable[[], torch.nn.Module], example_batch: Any, settings: dict) -> SimulationResult:
    """``simulate(..., extrapolate=True)``: the model's two shallow copies simulated, the result
    extrapolated to its depth (``predict.depth``); whole when it has no stack deeper than the copies."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = make_model()
    stack = depth.repeated_stack(model)
    if not depth.worth_extrapolating(stack):
        log.info(
            "zcompile.simulate: no stack of %d blocks or more to extrapolate from: simulated whole", depth.MIN_DEPTH
        )
        return simulate(make_model, example_batch, **settings)
    config = ZeroConfig.from_options(settings["options"])
    gathered_bytes = (
        sum(p.numel() for p in dict.fromkeys(model.parameters())) * (config.param_dtype or torch.float32).itemsize
    )

    def extrapolated(config: ZeroConfig) -> SimulationResult:
        copies = [
            simulate(
                depth.shallow_copy_builder(make_model, stack, blocks), example_batch, **{**settings, "options": config}
            )
            for blocks in depth.SHALLOW_BLOCKS
        ]
        return depth.extrapolated(*copies, stack.depth)

    keep_bytes = config.keep_gathered_mb * 2**20
    if 0 < keep_bytes < gathered_bytes:  # some weights kept: between none and all (predict.depth)
        every = extrapolated(config.replace(keep_gathered_mb=2 * gathered_bytes / 2**20))  # room for padding
        return depth.interpolated(extrapolated(config.replace(keep_gathered_mb=0.0)), every, keep_bytes)
    return extrapolated(config)


def check_world(world_size: int, node_size: int | None) -> None:
    """Refuses a world size or node size that is not a positive int, naming it."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"zcompile.simulate: world_size must be an int >= 1, got {world_size!r}")
    if node_size is not None and (isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1):
        raise ValueError(f"zcompile.simulate: node_size must be an int >= 1 or None (the profile's), got {node_size!r}")


def _refuse_groups_of_another_world(graphs: list) -> None:
    """The guard behind ``forget_dtensor_sharding_decisions``: collectives on groups this fake world
    does not have (an earlier world's, kept in a torch DTensor cache the function does not know of)
    would be priced on the wrong groups, silently. Refused."""
    known = group_ranks_by_name()
    stray = sorted(
        {
            c.group_name
            for g in graphs
            for gm in (g.forward, g.backward)
            if gm is not None
            for c in collective_nodes(gm)
            if c.group_name not in known
        }
    )
    if stray:
        raise RuntimeError(
            f"zcompile.simulate: the graphs' collectives run on process groups {stray} that this simulation's fake "
            "world does not have: an earlier tensor-parallel simulation in this process left them in a torch "
            "DTensor cache zcompile does not empty. Run each tensor-parallel simulation in a process of its own"
        )


def check_tensor_parallel(world_size: int, tensor_parallel: int, options) -> None:
    """Refuses a tp degree that is not a divisor of the world, or beside a ``mesh`` option, naming it."""
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ValueError(f"zcompile.simulate: tensor_parallel must be an int >= 1, got {tensor_parallel!r}")
    if world_size % tensor_parallel:
        raise ValueError(
            f"zcompile.simulate: tensor_parallel={tensor_parallel} does not divide world_size={world_size}; "
            "the mesh is (world_size / tp) x tp ranks"
        )
    mesh = options.get("mesh") if isinstance(options, dict) else getattr(options, "mesh", None)
    if tensor_parallel > 1 and mesh is not None:
        raise ValueError(
            "zcompile.simulate: give tensor_parallel=tp, not the option 'mesh': the simulation makes the "
            "(dp, tp) mesh in its own fake world"
        )


def _split_over_tensor_parallel(model, config: ZeroConfig, world_size: int, tp: int, parallelize):
    """``model`` split over the tp dim of a fake ``(dp, tp)`` mesh, and ``config`` with that mesh; with
    option ``shard_size`` S (data-parallel ranks per shard group; ``"node"``: a node's ranks over tp)
    the 3-D mesh ``(dp / S, S, tp)`` of hybrid sharding on top."""
    from torch.distributed.device_mesh import init_device_mesh

    from zcompile.integrations.hf_tp_plan import apply_tp_plan

    device_type = next(model.parameters()).device.type  # the fake tensors' device, not the profile's
    dp, shard = world_size // tp, config.shard_size
    if shard == "node":
        shard = max(1, config.node_size // tp)
    if shard is None or shard == dp:
        mesh = init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
    elif dp % shard:
        raise ValueError(
            f"zcompile.simulate: option 'shard_size' {shard} does not divide the {dp} data-parallel ranks "
            f"(world_size {world_size} / tensor_parallel {tp}); the shard groups are that many of them each"
        )
    else:
        names = ("replicate", "shard", "tp")
        mesh = init_device_mesh(device_type, (dp // shard, shard, tp), mesh_dim_names=names)
    (parallelize or apply_tp_plan)(model, mesh["tp"])
    return model, config.replace(mesh=mesh, shard_size=None)


def _node_size(node_size: int | None, config: ZeroConfig, profile: HardwareProfile) -> int:
    """Ranks per node: the argument, else the ``node_size`` option, else the profile's; the two must agree."""
    if node_size is not None and config.node_size is not None and node_size != config.node_size:
        raise ValueError(
            f"zcompile.simulate: node_size={node_size} and the option node_size={config.node_size} "
            "disagree; give one of them"
        )
    return node_size or config.node_size or profile.node_size


@contextlib.contextmanager
def fake_world(world_size: int, node_size: int):
    """torch's fake process group of ``world_size`` ranks, this process rank 0, for the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "zcompile.simulate: it starts a fake process group of its own; call it in a process "
            "that has not called init_process_group (not under torchrun)"
        )
    forget_dtensor_sharding_decisions()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_dtensor_sharding_decisions()


def forget_dtensor_sharding_decisions() -> None:
    """Empties torch's caches of DTensor sharding decisions. They are keyed by meshes that compare
    equal across worlds (same ranks, shape and names) but hold the mesh they were made on, with its
    process groups: a simulation after another would trace the model's tensor-parallel collectives
    on the earlier fake world's groups. (torch internals: ``DTensor._op_dispatcher``.)"""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's copy


def _loss(output: Any, loss_fn: Callable | None) -> torch.Tensor:
    if loss_fn is not None:
        return loss_fn(output)
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else output.float().sum()
    loss = getattr(output, "loss", None)
    if loss is None:
        raise ValueError(
            "zcompile.simulate: the model's output is neither a tensor nor has a .loss; "
            "pass loss_fn=lambda output: ... to make the scalar to differentiate"
        )
    return loss


def _tokens(args: tuple, kwargs: dict) -> int:
    """Tokens per rank and step: the element count of the first integer input (the token ids)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and not value.is_floating_point():
            return value.numel()
    return 0


def _graph_collectives(graphs: list, pricing: LinkCosts) -> list[SimulatedCollective]:
    """The graphs' collectives in the order a step runs them (``step_graphs``)."""
    out = []
    for graph in step_graphs(graphs):
        for collective in collective_nodes(graph.gm):
            size = pricing.group_size(collective)
            inside = not pricing.across_nodes(collective.group_name, size)
            out.append(
                SimulatedCollective(
                    graph.where,
                    collective.kind,
                    collective.bytes,
                    size,
                    inside,
                    graph=graph.name,
                    node=collective.node.name,
                )
            )
    return out


def _optimizer_collectives(
    model: torch.nn.Module, pricing: LinkCosts, by_all_to_all: bool, bucket_mb: float = OPTIMIZER_BUCKET_MB
) -> list[SimulatedCollective]:
    """Stages 1 and 2: what ``zcompile.optim``'s step moves, read from the shards the backend made and
    bucketed as the step buckets them (``optim.buckets``, its default 4 MiB of full parameter): at
    stage 1 the full gradients reduce-scattered in their reduce dtype (``plan_reduce_buckets``: half
    buckets where, as on the profile's CPU (gloo), they are exchanged by all-to-all), then the updated
    parameters all-gathered in the replicated dtype; one collective per bucket, padded."""
    members = _optimizer_members(model)
    bucket_bytes = int(bucket_mb * 2**20)
    moves = [
        (
            "reduce_scatter",
            lambda s: s.grad_reduce_dtype,
            plan_reduce_buckets([s for s in members if s.stage == 1], bucket_bytes, by_all_to_all),
        ),
        (
            "all_gather",
            lambda s: s.replicated_dtype,
            plan_optimizer_buckets(members, lambda s: s.replicated_dtype, bucket_bytes),
        ),
    ]
    out = []
    for kind, dtype_of, buckets in moves:
        for bucket in buckets:
            group = bucket[0].group
            across = pricing.across_nodes(group.name, group.world_size)
            nbytes = sum(s.padded_numel * dtype_of(s).itemsize for s in bucket)
            seconds = pricing.profile.group_cost(kind, group.world_size, across).seconds(nbytes)
            out.append(SimulatedCollective("optimizer", kind, nbytes, group.world_size, not across, seconds))
            replicate = group.replicate
            if kind == "reduce_scatter" and replicate is not None:  # hybrid: the reduced shard across replicas
                shard_bytes = nbytes // group.world_size
                across = pricing.across_nodes(replicate.name, replicate.world_size)
                seconds = pricing.profile.group_cost("all_reduce", replicate.world_size, across).seconds(shard_bytes)
                out.append(
                    SimulatedCollective(
                        "optimizer", "all_reduce", shard_bytes, replicate.world_size, not across, seconds
                    )
                )
    return out


def _optimizer_members(model: torch.nn.Module) -> list:
    """The shards whose parameters ``zcompile.optim``'s step all-gathers (stages 1 and 2, trained, ranks > 1)."""
    return [
        s
        for s in filter(None, map(shard_of, dict.fromkeys(model.parameters())))
        if s.stage in (1, 2) and s.group.world_size > 1 and s.param.requires_grad
    ]


def _store_exchanges(graphs: list, world_size: int) -> int:
    """The step's agreements through the store with the ranks checked: the step's own, and one before
    each training call of a graph that agrees on its calls, but the first after the step (every rank
    goes there from the step's agreement: ``ShardSwap.first_call_since_agreed_step``)."""
    if world_size == 1:
        return 0
    agreed_calls = sum(
        max(1, g.calls_since_step)
        for g in graphs
        if g.context is not None
        and agrees_on_each_call(
            g.context.config.replace(check_ranks=True),
            world_size,
            g.context.sharding,
            g.context.zeropp.active,
            grad_enabled=True,
        )
    )
    return 1 + max(0, agreed_calls - 1)


def _store_note(result: SimulationResult, profile: HardwareProfile) -> str:
    """What the store's share of the step is, why, and what lowers it."""
    each = result.store_s / result.store_exchanges
    said = (
        f"at {result.world_size} ranks the ranks' {result.store_exchanges} agreement(s) a step through the store "
        f"take {result.store_s * 1e3:.1f} ms of the {result.step_s * 1e3:.1f} ms step ({each * 1e3:.2f} ms each: "
        f"one store server answers {ANSWERED_REQUESTS_PER_EXCHANGE * result.world_size} requests an exchange at "
        f"the profile's store_requests_per_s, {profile.store_requests_per_s:,.0f}/s). "
    )
    if result.store_exchanges > 1:
        return said + (
            "Graphs called once per layer (blocks compiled one by one, a graph break in the layer loop) "
            "agree on every call: compile the whole model, or mark its blocks with zcompile.mark_repeated_blocks"
        )
    return said + (
        "That is the step's own agreement: more tokens per step (gradient accumulation) spread it; "
        "check_ranks=False removes it, and with it the error a rank that skips a step would raise (a hang instead)"
    )


def _optimizer_update_seconds(model: torch.nn.Module, profile: HardwareProfile, compute: ComputeCosts) -> float:
    """``zcompile.optim.AdamW``'s update of rank 0's shards: the fused AdamW kernel's one pass over
    each shard (the module docstring), one op's overhead per shard, plus on a CPU the passes torch's
    kernel needs beside it (``kernels.cpu_adamw``): stage 1's gradient scale into a copy (reads and
    writes 4 bytes an element) and the copy of the update into the low-precision replica (reads 4,
    writes its dtype's bytes), which the GPU kernel does in its one pass."""
    members = [s for s in filter(None, map(shard_of, dict.fromkeys(model.parameters()))) if s.param.requires_grad]
    total = 0.0
    for s in members:
        lowp = s.replicated_dtype.itemsize if s.replicated_dtype != s.shard.dtype else 0
        per_element = 7 * 4  # reads parameter, gradient and both moments; writes parameter and moments
        if profile.device_type == "cuda":
            per_element += lowp
        else:
            per_element += (8 if s.stage == 1 and s.group.world_size > 1 else 0) + (4 + lowp if lowp else 0)
        total += compute.op_seconds(0.0, per_element * s.shard.numel())
    return total


def _predict(
    result: SimulationResult, graphs: list, pricing: LinkCosts, compute: ComputeCosts, trained_parameters: int
) -> None:
    """Step, exposed communication and MFU from ``predict_step``; each graph collective's predicted
    seconds; the host's overhead for the step's graph calls and ``trained_parameters`` parameters."""
    prediction = predict_step(graphs, pricing, compute)
    seconds = {(c.graph, c.name): c.seconds for c in prediction.collectives}
    for c in result.collectives:
        c.seconds = seconds.get((c.graph, c.node), c.seconds)
    optimizer_comm = sum(c.seconds for c in result.collectives if c.where == "optimizer")
    result.graph_calls = len(step_graphs(graphs))
    result.host_overhead_s = pricing.profile.host_overhead_seconds(result.graph_calls, trained_parameters)
    result.compute_s = prediction.compute_s + result.optimizer_update_s
    result.exposed_comm_s = prediction.exposed_comm_s + optimizer_comm
    result.step_s = prediction.step_s + optimizer_comm + result.optimizer_update_s + result.host_overhead_s
    profile = pricing.profile
    result.store_s = result.store_exchanges * profile.store_seconds(ANSWERED_REQUESTS_PER_EXCHANGE, result.world_size)
    if profile.device_type == "cpu":  # the host runs the ops: its waits are the step's
        result.step_s += result.store_s
    else:  # the host runs ahead of the device: its waits show where they outlast the device's step
        result.step_s = max(result.step_s, result.store_s)
    if result.store_s > STORE_SHARE_WORTH_A_WARNING * result.step_s:
        log.warning("zcompile.simulate: %s", _store_note(result, profile))
    if result.step_s > 0:
        # against a rank's own peak, not its time-shared one; a tp group's ranks share its tokens' work
        peak = compute.flops_per_s * result.time_sharing
        work = 6 * result.num_params * result.tokens_per_rank / result.tensor_parallel
        result.mfu = work / result.step_s / peak


def predict_compiled(
    graphs: list,
    model: torch.nn.Module,
    config: ZeroConfig,
    world_size: int,
    node_size: int,
    profile: HardwareProfile,
    tokens: int,
    time_sharing: float = 1.0,
    store_exchanges: int = 0,
) -> SimulationResult:
    """Memory by parts, the step peak, the collectives and the predicted step of ``graphs`` (a step's
    compiled graphs, forward and backward run once on fake tensors) of ``model`` at ``world_size``
    ranks, on ``profile`` as the ranks share it. In the fake world (``simulate``) or beside the real
    one (a memory limit planned at compile time, ``tune.memory_limit``)."""
    on_gloo = profile.device_type == "cpu"
    states = estimate_memory(model, world_size, config)
    pricing = profile.link_costs(world_size, node_size, group_ranks_by_name())
    num_params = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    gathered, staging = gathered_peak_parts(
        [gm for g in graphs for gm in (g.forward, g.backward)], on_gloo and world_size > 1
    )
    # each graph as often as the step ran it, as step_report counts it: a graph break inside the layer
    # loop compiles one graph for a layer's frame, called once per layer
    stepped = [g for g in graphs for _ in range(max(1, g.calls_since_step))]
    result = SimulationResult(
        world_size,
        node_size,
        profile.name,
        num_params,
        tokens,
        memory={
            "model_states_bytes": states.model_states_bytes,
            "peak_gathered_bytes": gathered,
            "gather_staging_bytes": staging,  # gloo's copies of the gathers in flight (step_report's part)
            "kept_gathered_bytes": sum(g.keep_gathered.kept_bytes for g in stepped if g.keep_gathered),
            "saved_activation_bytes": sum(saved_activation_bytes(g.forward, g.backward) for g in stepped),
        },
    )
    peak = step_peak(
        stepped,
        states.params_bytes,
        states.grads_bytes,
        states.optimizer_bytes,
        gather_staging=on_gloo and world_size > 1,
        optimizer_buffers_bytes=replayed_step_buffer_peak(
            _optimizer_members(model),
            int(OPTIMIZER_BUCKET_MB * 2**20),
            whole_groups=profile.device_type == "cuda",
            gloo=on_gloo,
        ),
    )
    result.step_peak_bytes, result.step_peak_phase = peak.peak_bytes, peak.where
    result.collectives = _graph_collectives(stepped, pricing) + _optimizer_collectives(
        model, pricing, by_all_to_all=on_gloo
    )
    compute = profile.compute_costs(config.param_dtype or torch.float32)
    result.optimizer_update_s = _optimizer_update_seconds(model, profile, compute)
    result.time_sharing = time_sharing
    result.tensor_parallel = config.mesh["tp"].size() if config.tensor_parallel else 1
    result.store_exchanges = store_exchanges
    _predict(result, stepped, pricing, compute, sum(p.requires_grad for p in dict.fromkeys(model.parameters())))
    return result
