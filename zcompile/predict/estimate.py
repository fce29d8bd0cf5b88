"""``estimate_memory``: per-rank bytes of a zero-compiled model, predicted before anything runs.

DeepSpeed's ``estimate_zero3_model_states_mem_needs`` gives model states from a parameter count;
this gives every part zcompile's ``step_report().memory`` measures, for any options:

- **model states** (parameters and their replicas, fp32 master shards, gradients, optimizer
  moments), parameter by parameter, by the rules zcompile allocates with: each parameter cut into
  N equal chunks (``sharding.shards.FlatPiece``, so padding is included); stages 1 and 2 in fp32 keep
  the shard inside the replicated parameter, with ``param_dtype`` a low-precision replica and an
  fp32 shard; stage 3 the shard only. Frozen parameters have no gradient and no moments; tied
  parameters count once. These equal ``model_state_bytes`` after a step (tests check it exactly).
- **gathered peak** (stage 3): the parameters in registration order (the order most models use
  them in) bucketed as the bucketing pass does (consecutive, up to ``bucket_mb`` of gathered bytes),
  ``prefetch`` buckets in flight behind the one in use, plus the bucket whose pieces are being
  copied out of its buffer (the two coexist); capped by ``memory_budget_mb`` as the schedule caps
  prefetching (never below one bucket's buffer and pieces).
- **kept weights** (``keep_gathered_mb``): the budget, or every gathered weight if fewer.
- **saved activations** (with ``batch``): the model compiled once on fake tensors (a copy whose
  parameters have no storage: nothing allocated, no process group, autocast to ``param_dtype``
  applied as the backend applies it) through the min-cut partition zcompile uses, and the
  forward's saved values counted by ``passes.liveness.saved_activation_bytes``, with
  ``activation_memory_budget`` applied by the same partitioner, each graph as often as the forward
  ran it (a graph break inside a loop). Stage 3's weight re-gathers do not change what is saved.

Blocks compiled one by one (``block.compile(backend="zero")``, the rest of the model eager; call
the estimate after those compiles, before the first step) are estimated as they train: the blocks'
parameters by the options, every other trained parameter as stage 1 keeps a weight trained outside
every graph (replicated in its own dtype, its gradient reduced at the step); the gathered peak is
one block's graph's, plus the next block's first bucket that cross-call prefetch holds
(``prefetch_calls``); saved activations are the blocks' graphs', once per layer, as
``step_report`` counts them (the eager rest's are autograd's, in neither).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from zcompile.agreement.abort_note import leave_abort_note
from zcompile.backend.aot import activation_budget, activation_budget_fraction
from zcompile.config import ZeroConfig
from zcompile.passes.dtensor_params import local_piece
from zcompile.passes.liveness import saved_activation_bytes, saved_storages
from zcompile.passes.random_draws import save_random_draws_pass
from zcompile.passes.regions import subgraph_output_origin
from zcompile.sharding.shards import FlatPiece, shard_of

log = logging.getLogger(__name__)

MIB = 2**20
MOMENTS = {"adamw": 2, "adamw_amsgrad": 3, "sgd": 0, "sgd_momentum": 1}  # fp32 state tensors per shard element


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes per rank (the same parts as ``step_report().memory``)."""

    world_size: int
    stage: int
    params_bytes: int  # parameters, replicas and master shards
    grads_bytes: int  # after backward, before zero_grad
    optimizer_bytes: int
    gathered_peak_bytes: int
    kept_gathered_bytes: int
    saved_activation_bytes: int | None  # None: no batch was given
    shard_group_size: int | None = None  # ranks each state is sharded over (hybrid sharding's shard group)

    @property
    def model_states_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def peak_bytes(self) -> int:
        """Model states + gathered peak + kept weights + saved activations (0 when unknown)."""
        return (
            self.model_states_bytes
            + self.gathered_peak_bytes
            + self.kept_gathered_bytes
            + (self.saved_activation_bytes or 0)
        )

    def to_dict(self) -> dict:
        return {**asdict(self), "model_states_bytes": self.model_states_bytes, "peak_bytes": self.peak_bytes}


def estimate_memory(
    model: torch.nn.Module,
    world_size: int,
    options: ZeroConfig | dict | None = None,
    batch: Any = None,
    optimizer: str = "adamw",
) -> MemoryEstimate:
    """Per-rank bytes of ``model`` trained with the zero backend on ``world_size`` ranks (module doc).

    ``options``: the backend's options; ``batch``: one rank's inputs (a tensor, a tuple of
    positional arguments or a dict of keyword arguments of ``model``) to estimate saved activations;
    ``optimizer``: ``"adamw"`` (2 moments), ``"adamw_amsgrad"`` (3: the moments' running maximum too),
    ``"sgd_momentum"`` (1) or ``"sgd"`` (0). Call it on the
    model before ``torch.compile`` shards it; with ``batch``, after its first step is a ``ValueError``
    (the saved activations' compile resets Dynamo, on this rank alone if only it asks).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"zcompile.estimate_memory: world_size must be an int >= 1, got {world_size!r}")
    if optimizer not in MOMENTS:
        raise ValueError(f"zcompile.estimate_memory: optimizer must be one of {sorted(MOMENTS)}, got {optimizer!r}")
    config = ZeroConfig.from_options(options)
    data_parallel, world_size = world_size, config.shard_group_size(world_size)  # states shard over the shard group
    params = [local_piece(p) for p in dict.fromkeys(model.parameters())]  # a tensor-parallel model: its pieces
    blocks = compiled_apart(model)
    if blocks:  # the weights no compiled block holds train outside every graph: stage 1's rules, their own dtype
        in_blocks = {id(local_piece(p)) for block in blocks for p in block.parameters()}
        outside = replace(config, stage=1, param_dtype=None)
        states = [
            _param_states(p, config if id(p) in in_blocks else outside, world_size, MOMENTS[optimizer]) for p in params
        ]
        gathered = _blocks_gathered_peak(blocks, config, world_size)
        compiled = [p for p in params if id(p) in in_blocks]
    else:
        states = [_param_states(p, config, world_size, MOMENTS[optimizer]) for p in params]
        gathered = _gathered_peak(params, config, world_size)
        compiled = params
    kept = 0
    if config.stage == 3 and config.keep_gathered_mb > 0:
        kept = min(int(config.keep_gathered_mb * MIB), sum(_gathered_bytes(p, config, world_size) for p in compiled))
    sharded = [shard for p in params if (shard := shard_of(p)) is not None]
    if batch is not None and sharded:
        # the estimate compiles a copy between two torch._dynamo.reset(): this process would then compile
        # its graphs again alone (a RankDivergenceError on every rank, blaming the compile paths)
        message = (
            "zcompile.estimate_memory(batch=...): the model has trained already (its parameters are "
            "sharded); estimating saved activations resets Dynamo, and this rank would then recompile its "
            "graphs without the others. Call it before the first step, or read the measured figures from "
            "zcompile.step_report(model, optimizer)"
        )
        leave_abort_note(sharded[0].group, message)  # the others, in collectives with this rank, quote it
        raise ValueError(message)
    saved = None if batch is None else _saved_activations(model, batch, config, blocks)
    return MemoryEstimate(
        data_parallel,
        config.stage,
        sum(s[0] for s in states),
        sum(s[1] for s in states),
        sum(s[2] for s in states),
        gathered,
        kept,
        saved,
        world_size,
    )


def _param_states(param: torch.nn.Parameter, config: ZeroConfig, world: int, moments: int) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes this rank holds for ``param`` after a step."""
    piece = FlatPiece(param.numel(), world, 0)
    numel, chunk, size = param.numel(), piece.chunk, param.element_size()
    trained = param.requires_grad
    shard = 4 * chunk  # the fp32 master
    low = config.param_dtype
    replica = config.stage in (1, 2) and trained and low is not None and low.itemsize < size
    grad_shard = 4 * chunk  # the averaged gradient shard, fp32 on the master
    if config.stage == 3:
        params = shard
    elif replica:  # padded like the fp32 case; stage 2's gradient shard is a low-precision slice of it
        size = low.itemsize
        params, grad_shard = chunk * world * size + shard, chunk * size
    elif param.dtype == torch.float32:
        params = 4 * chunk * world  # the shard is a slice of it
    else:
        params = numel * size + shard
    if not trained:
        return params, 0, 0
    grads = numel * size if config.stage == 1 else grad_shard  # stage 1: the full local gradient
    return params, grads, moments * 4 * chunk


def _gathered_bytes(param: torch.nn.Parameter, config: ZeroConfig, world: int) -> int:
    dtype = config.param_dtype or param.dtype
    return FlatPiece(param.numel(), world, 0).chunk * world * dtype.itemsize


def compiled_apart(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost submodules of ``model`` compiled on their own (``module.compile(...)``: blocks
    compiled one by one), in registration order; none where ``model`` itself is compiled (a
    ``torch.compile`` wrapper, or ``model.compile()``), which compiles them with it."""
    # nn.Module.compile keeps its compiled call in _compiled_call_impl (torch-internal, read here only)
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) or getattr(model, "_compiled_call_impl", None):
        return []
    found: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            (found.append if getattr(child, "_compiled_call_impl", None) is not None else visit)(child)

    visit(model)
    return found


def _buckets(params: list[torch.nn.Parameter], config: ZeroConfig, world: int) -> list[int]:
    """Gathered bytes of each bucket, as the bucketing pass makes them of ``params`` in order."""
    bucket_bytes = int(config.bucket_mb * MIB)
    buckets: list[int] = []
    for nbytes in (_gathered_bytes(p, config, world) for p in params):
        if buckets and bucket_bytes and buckets[-1] + nbytes <= bucket_bytes:
            buckets[-1] += nbytes
        else:
            buckets.append(nbytes)
    return buckets


def _blocks_gathered_peak(blocks: list[torch.nn.Module], config: ZeroConfig, world: int) -> int:
    """Stage 3 with blocks compiled apart: the largest block's own schedule peak, plus, where each
    call prefetches the next one's first gather (``prefetch_calls``), the largest such gather."""
    prefetching = config.prefetch_calls and config.overlap and config.prefetch >= 1 and len(blocks) > 1
    peak = held = 0
    for block in blocks:
        params = list(dict.fromkeys(block.parameters()))
        peak = max(peak, _gathered_peak(params, config, world))
        if prefetching:
            # a forward's first gather is the block's first bucket; a backward re-gathers, in reverse,
            # the weights its input gradients read: the matrices (a bias's gradient reads no weight)
            forward = _buckets(params, config, world)
            backward = _buckets([p for p in reversed(params) if p.dim() >= 2], config, world)
            held = max(held, forward[0] if forward else 0, backward[0] if backward else 0)
    return peak + held if peak else 0


def _gathered_peak(params: list[torch.nn.Parameter], config: ZeroConfig, world: int) -> int:
    if config.stage != 3 or world == 1 or not params:
        return 0
    buckets = _buckets(params, config, world)
    depth = config.prefetch if config.overlap else 0
    in_flight = [sum(buckets[j : j + depth + 1]) for j in range(len(buckets))]
    # the next bucket's buffer and its copied-out pieces coexist once it lands; the last bucket's own
    # (a graph of one bucket, as a block compiled apart often is: twice its bucket)
    peak = max(in_flight[j] + buckets[min(j + 1, len(buckets) - 1)] for j in range(len(buckets)))
    if config.memory_budget_mb is not None:
        floor = max(2 * b for b in buckets)  # one bucket's buffer and pieces: no prefetch at all
        peak = max(min(peak, int(config.memory_budget_mb * MIB)), floor)
    return peak


def _saved_activations(
    model: torch.nn.Module, batch: Any, config: ZeroConfig, blocks: list[torch.nn.Module] = ()
) -> int:
    """What the forwards save for backward, from one forward on fake tensors (module doc): the min-cut
    partition zcompile uses, with the same activation budget, each Dynamo graph's times the calls of
    it that forward made. ``blocks`` (``compiled_apart``): those compiled, the rest run eagerly."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._subclasses.fake_tensor import FakeTensorMode

    saved: dict[int, int] = {}  # per Dynamo graph: its partition's (a block subgraph's is made first)
    calls: dict[int, int] = {}  # per Dynamo graph: its forward's calls

    def run(gm, example_inputs):
        return make_boxed_func(gm.forward)

    def backend(gm: torch.fx.GraphModule, example_inputs: list):
        # AOTAutograd names the Dynamo graph's inputs primals_1, primals_2, ... in order
        params = {f"primals_{i + 1}" for i, v in enumerate(example_inputs) if isinstance(v, torch.nn.Parameter)}

        def partition(joint, joint_inputs, **kwargs):
            save_random_draws_pass(joint)  # as the backend's joint passes do: a dropout's mask is saved
            fraction = activation_budget_fraction(config.activation_memory_budget, joint, joint_inputs, kwargs)
            with activation_budget(fraction, config.tensor_parallel):
                forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
            saved[id(gm)] = saved_activation_bytes(forward, backward) - _saved_weight_bytes(forward, backward, params)
            return forward, backward

        def counted(forward_graph, forward_inputs):
            forward = make_boxed_func(forward_graph.forward)

            def call(args):
                calls[id(gm)] = calls.get(id(gm), 0) + 1
                return forward(args)

            call._boxed_call = True
            return call

        return aot_autograd(fw_compiler=counted, bw_compiler=run, partition_fn=partition)(gm, example_inputs)

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    args, kwargs = fake_call(batch, fake_mode)
    device_type = next((v.device.type for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), "cpu")
    faked = _faked(model, fake_mode)
    if blocks:  # the copy's blocks compiled as the model's are, with this backend; the rest runs eagerly
        names = {id(module): name for name, module in model.named_modules()}
        for block in blocks:
            copied = faked.get_submodule(names[id(block)])
            copied._compiled_call_impl = None  # the model's compiled call, which the copy shares
            copied.compile(backend=backend)
    torch._dynamo.reset()
    try:
        with torch.autocast(device_type, dtype=config.param_dtype, enabled=config.param_dtype is not None):
            (faked if blocks else torch.compile(faked, backend=backend))(*args, **kwargs)
    finally:
        torch._dynamo.reset()
    return sum(nbytes * calls.get(key, 1) for key, nbytes in saved.items())


def _saved_weight_bytes(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, params: set[str]) -> int:
    """Saved values made from parameters alone (autocast's low-precision copies of the weights):
    zcompile's graphs do not save those (stage 3 re-gathers them in ``param_dtype``, stages 1 and
    2 read a replica already in it), and ``step_report`` does not count them as activations."""
    total = 0
    for node, (_, nbytes) in saved_storages(forward, backward).items():  # each storage once, as liveness counts
        # a block's input handed back by its subgraph call (mark_repeated_blocks) is judged by the
        # operand it is (an input: liveness does not count it either)
        origin = subgraph_output_origin(forward, node)
        start = origin[0] if origin is not None else node
        if start.op == "placeholder":
            continue
        sources, stack, seen = set(), [start], {start}
        while stack:
            for source in stack.pop().all_input_nodes:
                if source not in seen:
                    seen.add(source)
                    (sources.add(source.name) if source.op == "placeholder" else stack.append(source))
        if sources and sources <= params:
            total += nbytes
    return total


def _faked(model: torch.nn.Module, fake_mode) -> torch.nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake tensors: same device, dtype and shape,
    no storage (tied ones stay tied; ``model`` is not touched)."""
    memo: dict[int, torch.Tensor] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in memo:
            fake = fake_mode.from_tensor(tensor.detach())
            memo[id(tensor)] = (
                torch.nn.Parameter(fake, tensor.requires_grad) if isinstance(tensor, torch.nn.Parameter) else fake
            )
    return copy.deepcopy(model, memo)


def fake_call(batch: Any, fake_mode) -> tuple[tuple, dict]:
    """``batch`` (a tensor, a tuple of positional or a dict of keyword arguments) as the positional
    and keyword arguments of a call, its tensors made fake in ``fake_mode``."""
    fake = lambda v: fake_mode.from_tensor(v) if isinstance(v, torch.Tensor) else v  # noqa: E731
    if isinstance(batch, dict):
        return (), {k: fake(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return tuple(map(fake, batch)), {}
    return (fake(batch),), {}
