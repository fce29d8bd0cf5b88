"""User-facing options of the ``zero`` backend, validated once per compile."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

_DTYPE_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
}
_COMPILERS = ("auto", "eager", "inductor")
REDUCE_SCATTER_FORMS = ("auto", "native", "all_to_all")


# the dim names of option 'mesh': hybrid sharding's (FSDP2's convention) and a tensor-parallel model's
MESH_DIMS_HYBRID = ("replicate", "shard")
MESH_DIMS_TP = ("dp", "tp")
MESH_DIMS_HYBRID_TP = ("replicate", "shard", "tp")  # hybrid sharding of a tensor-parallel model's pieces


@dataclass(frozen=True)
class ZeroConfig:
    """Options of ``torch.compile(model, backend="zero", options={...})``.

    Attributes:
        stage: ZeRO stage. 1 shards optimizer state; 2 also shards gradients (reduce-scattered
            during backward); 3 also shards parameters (gathered in the graph before use and
            re-gathered in backward).
        param_dtype: dtype of gathered parameters and of the compute (e.g. ``"bf16"``); ``None``
            keeps the parameters' own dtype. Master weights and optimizer state stay fp32.
        reduce_dtype: dtype in which gradients are reduced across ranks; ``None`` means
            ``param_dtype`` (or the parameters' dtype).
        compiler: inner compiler for the forward and backward graphs: ``"eager"`` runs the
            AOTAutograd graphs without code generation, ``"inductor"`` generates kernels;
            ``"auto"`` (``for_graph``): inductor for graphs on CUDA, where eager's per-node Python
            leaves the GPU waiting, else eager (CPU, marked blocks, a budget in MiB).
        group: the data-parallel ``ProcessGroup``; ``None`` is the default (world) group, or a
            world of one when no process group is initialized.
        broadcast_buffers: registered module buffers that the graphs change (BatchNorm's running
            statistics in training mode) take rank 0's values at each optimizer step, as DDP's
            ``broadcast_buffers=True`` keeps them equal: each rank's buffers would otherwise follow
            its own data, and evaluation and checkpoints would differ by rank. ``False``: per rank.
        sync_module_states: the compile that shards a parameter first gives every rank rank 0's
            values of it, and of the graph's buffers (one bucketed broadcast), as DDP does when it
            wraps a model: ranks seeded apart start from rank 0's weights. ``False``: the ranks must
            build the same weights, and a ``RankDivergenceError`` names those that differ.
        check_ranks: compare, across ranks, the sequence of collectives each compiled graph will
            issue, and fail with a clear error instead of deadlocking when they differ.
        check_timeout_s: how long the rank check waits for the other ranks' graphs. A rank that does
            not come in that time (it took another code path) is named in a ``RankDivergenceError``;
            60 s covers the compile-time skew between ranks on a loaded machine and ends a real
            divergence long before the process group's own 30-minute timeout.
        on_compile: called with each ``CompiledGraphs`` (the plan and the Dynamo, forward and
            backward graphs, filled in as they compile) for inspection and tests.
        bucket_mb: per-rank size (MiB) up to which consecutive all-gathers, and consecutive
            reduce-scatters, are merged into one collective; ``0`` keeps one per parameter.
        overlap: re-order the compiled graphs so communication overlaps compute (prefetched
            all-gathers, reduce-scatters issued early and waited late); ``False`` keeps every
            collective next to its wait.
        prefetch: how many buckets ahead an all-gather is issued (with ``overlap``).
        memory_budget_mb: per-rank bytes (MiB) of gathered parameters alive at once that the
            schedule may use; prefetching is reduced to fit. ``None``: bounded by ``prefetch``.
        prefetch_calls: stage 3 (with ``overlap``, ``prefetch`` >= 1): a graph called several times
            in a row (blocks compiled one by one: one graph per layer) has each call issue the next
            call's first all-gather while it computes (``zcompile.backend.call_prefetch``; either inner
            compiler), holding that gather's bytes one call early; off where ``memory_budget_mb``
            cannot hold them.
        schedule_policy: the function that chooses each all-gather's prefetch depth (with
            ``overlap``): ``policy(problem: zcompile.passes.schedule.ScheduleProblem) -> depths``.
            ``None`` is ``greedy_prefetch`` (as deep as ``prefetch``, within ``memory_budget_mb``);
            ``zcompile.tune.policies.CostGuidedPrefetch`` picks per bucket the least depth that
            the cost model says hides the transfer. A policy must decide the same on every rank.
        keep_gathered_mb: stage 3: per-rank bytes (MiB) of gathered weights that each compiled
            graph may keep from forward to backward instead of re-gathering them; chosen by
            communication saved per byte kept, the last layers of forward first. ``0``: re-gather all.
            A graph that runs several times before backward (one block graph reused per layer)
            keeps that much per run.
        activation_memory_budget: activations the forward saves for backward, the rest recomputed
            in backward (AOTAutograd's memory-budget partitioner, stage-3 gathers re-gathered where
            recomputed): a fraction 0..1 of what the default partition saves (``0``: recompute
            everything, ``1``: the default), or ``"<n>MiB"`` per compiled graph and rank (eager
            inner compiler; turned into a fraction by a trial partition). ``None``: the default.
        reduce_scatter: how the graphs' gradient reduce-scatters run: ``"native"``, the process
            group's own; ``"all_to_all"``, an all-to-all of the same bytes and a sum of the rows
            received (``zcompile.passes.reduce_scatter_lowering``); ``"auto"`` (default): all-to-all
            on gloo, whose reduce-scatter all-reduces a clone of the input (twice the bytes, and slower:
            ``benchmarks/bench_gloo_collectives.py``), native elsewhere (NCCL).
        fuse_loss_backward: compute cross-entropy's backward (``nll_loss_backward`` then the
            log-softmax backward) into one logits-sized buffer instead of two
            (``zcompile.passes.loss_backward``): for a language model, nearly the size of its logits
            less at the backward's start, often the step's peak. The values are the two ops' (on a
            CPU bit for bit, on CUDA to an ulp); ``False`` keeps ATen's ops.
        dump: directory for per-pass graph dumps, ``passes.json``, the plan and the collectives of
            every compiled graph (``DIR/rank{R}/{graph_id}/``); ``None`` reads ``$ZCOMPILE_DUMP``.
            ``python -m zcompile inspect DIR`` summarizes it.
        quantize_weights: ZeRO++ qwZ (stage 3): forward all-gathers move int8 blocks plus one fp32
            scale per block instead of the parameters' dtype.
        quantize_grads: ZeRO++ qgZ (stages 2, 3): the gradient reduce-scatter becomes a hierarchical
            all-to-all moving int4 blocks, reduced in fp32 inside the node, then across nodes.
        quantize_block: elements per quantization block (a power of two); smaller collectives use
            one block of their own size.
        hpz_size: ZeRO++ hpZ (stage 3): ranks over which a secondary copy of the gathered weights
            is sharded (an int dividing the world size, or ``"node"`` for ``node_size``), so the
            backward re-gather stays inside that group. ``None``: off.
        shard_size: hybrid sharding (HSDP, MiCS): model states are sharded inside groups of this
            many consecutive ranks and replicated across the groups, whose gradient shards are
            all-reduced once per reduced bucket (``docs/hybrid-sharding.md``). An int >= 2 dividing
            the world size, or ``"node"`` for ``node_size``; ``None``: shard over every rank.
        mesh: a 2-D ``DeviceMesh`` the caller built. Dims ``("replicate", "shard")`` (FSDP2's
            convention): hybrid sharding, shards inside ``mesh["shard"]``, replicas across
            ``mesh["replicate"]``, instead of ``shard_size``. Dims ``("dp", "tp")``: a model whose
            parameters are DTensors on ``mesh["tp"]`` (tensor parallelism), each local piece sharded
            over ``mesh["dp"]`` (``docs/tensor-parallel.md``).
        node_size: ranks per node, for qgZ's hierarchy and ``hpz_size="node"``; ``None`` reads
            torchrun's ``$LOCAL_WORLD_SIZE`` (else the whole world is one node). On one machine
            a smaller value simulates several nodes.
        memory_limit_mb: memory per rank the step must fit in: MiB, a size (``"70GiB"``) or
            ``"auto"`` (the device's memory less 10%). The backend then plans, at its first compile,
            the options not set here (stage, shard_size, activation_memory_budget,
            keep_gathered_mb, bucket_mb, prefetch): the fastest predicted that fits
            (``docs/memory-limit.md``). ``None``: no planning.
        memory_plan: set by the ``memory_limit_mb`` planner, not by hand: the limit and its choice,
            which the compile check compares across ranks (a rank planning alone, or planning
            otherwise, is then a ``RankDivergenceError`` naming ``memory_limit_mb``).
    """

    stage: int = 3
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    compiler: str = "auto"
    group: Any = None
    broadcast_buffers: bool = True
    sync_module_states: bool = True
    check_ranks: bool = True
    check_timeout_s: float = 60.0
    on_compile: Callable[[Any], None] | None = None
    dump: str | None = None
    bucket_mb: float = 4.0
    overlap: bool = True
    prefetch: int = 1
    memory_budget_mb: float | None = None
    prefetch_calls: bool = True
    schedule_policy: Callable[[Any], Any] | None = None
    keep_gathered_mb: float = 0.0
    activation_memory_budget: float | str | None = None
    reduce_scatter: str = "auto"
    fuse_loss_backward: bool = True
    quantize_weights: bool = False
    quantize_grads: bool = False
    quantize_block: int = 128
    hpz_size: int | str | None = None
    node_size: int | None = None
    shard_size: int | str | None = None
    mesh: Any = None
    memory_limit_mb: float | str | None = None
    memory_plan: str | None = None

    def __post_init__(self) -> None:
        if self.dump is not None:
            if not isinstance(self.dump, (str, os.PathLike)):
                raise TypeError(f"zcompile: option 'dump' must be a directory path, got {self.dump!r}")
            object.__setattr__(self, "dump", os.fspath(self.dump))
        if self.on_compile is not None and not callable(self.on_compile):
            raise TypeError(f"zcompile: option 'on_compile' must be callable, got {self.on_compile!r}")
        if isinstance(self.stage, bool) or not isinstance(self.stage, int) or self.stage not in (1, 2, 3):
            raise ValueError(f"zcompile: option 'stage' must be 1, 2 or 3, got {self.stage!r}")
        for name in ("param_dtype", "reduce_dtype"):
            object.__setattr__(self, name, _parse_dtype(name, getattr(self, name)))
        if self.compiler not in _COMPILERS:
            raise ValueError(f"zcompile: option 'compiler' must be one of {_COMPILERS}, got {self.compiler!r}")
        if self.reduce_scatter not in REDUCE_SCATTER_FORMS:
            raise ValueError(
                f"zcompile: option 'reduce_scatter' must be one of {REDUCE_SCATTER_FORMS}, got {self.reduce_scatter!r}"
            )
        if self.group is not None and not isinstance(self.group, torch.distributed.ProcessGroup):
            raise TypeError(
                "zcompile: option 'group' must be a torch.distributed.ProcessGroup or None, "
                f"got {type(self.group).__name__}"
            )
        if not finite_number(self.bucket_mb) or self.bucket_mb < 0:
            raise ValueError(f"zcompile: option 'bucket_mb' must be a finite number >= 0 (MiB), got {self.bucket_mb!r}")
        if not isinstance(self.overlap, bool):
            raise TypeError(f"zcompile: option 'overlap' must be a bool, got {self.overlap!r}")
        if not isinstance(self.prefetch_calls, bool):
            raise TypeError(f"zcompile: option 'prefetch_calls' must be a bool, got {self.prefetch_calls!r}")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"zcompile: option 'prefetch' must be an int >= 0, got {self.prefetch!r}")
        if self.memory_budget_mb is not None and (
            not finite_number(self.memory_budget_mb) or self.memory_budget_mb <= 0
        ):
            raise ValueError(
                f"zcompile: option 'memory_budget_mb' must be a positive finite number (MiB) or None, got {self.memory_budget_mb!r}"
            )
        if self.schedule_policy is not None and not callable(self.schedule_policy):
            raise TypeError(
                f"zcompile: option 'schedule_policy' must be a callable policy(problem) -> depths "
                f"(passes/README.md) or None for greedy prefetch, got {self.schedule_policy!r}"
            )
        if not finite_number(self.keep_gathered_mb) or self.keep_gathered_mb < 0:
            raise ValueError(
                f"zcompile: option 'keep_gathered_mb' must be a finite number >= 0 (MiB), got {self.keep_gathered_mb!r}"
            )
        if self.stage != 3 and self.keep_gathered_mb:
            raise ValueError(
                f"zcompile: keep_gathered_mb keeps stage-3 gathered weights for backward; stage "
                f"{self.stage} keeps every weight already. Use stage 3, or drop keep_gathered_mb"
            )
        self._check_activation_memory_budget()
        for name in ("quantize_weights", "quantize_grads", "fuse_loss_backward"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"zcompile: option {name!r} must be a bool, got {getattr(self, name)!r}")
        block = self.quantize_block
        if isinstance(block, bool) or not isinstance(block, int) or block < 2 or block & (block - 1) or block > 2**16:
            raise ValueError(f"zcompile: option 'quantize_block' must be a power of two in [2, 65536], got {block!r}")
        if (
            self.hpz_size is not None
            and self.hpz_size != "node"
            and (isinstance(self.hpz_size, bool) or not isinstance(self.hpz_size, int) or self.hpz_size < 1)
        ):
            raise ValueError(
                f"zcompile: option 'hpz_size' must be an int >= 1, \"node\" or None, got {self.hpz_size!r}"
            )
        if self.node_size is not None and (
            isinstance(self.node_size, bool) or not isinstance(self.node_size, int) or self.node_size < 1
        ):
            raise ValueError(f"zcompile: option 'node_size' must be an int >= 1 or None, got {self.node_size!r}")
        if self.stage != 3 and (self.quantize_weights or self.hpz_size is not None):
            raise ValueError(
                f"zcompile: quantize_weights and hpz_size act on the stage-3 parameter all-gathers; "
                f"stage {self.stage} has none. Use stage 3, or drop those options"
            )
        if self.stage == 1 and self.quantize_grads:
            raise ValueError(
                "zcompile: quantize_grads acts on the in-graph gradient reduce-scatter of stages 2 "
                "and 3; stage 1 reduces in the optimizer. Use stage 2 or 3"
            )
        self._check_hybrid_sharding()
        if self.memory_limit_mb is not None:
            memory_limit_bytes(self.memory_limit_mb, device_bytes=1)  # the form checked; "auto" read later
        if not isinstance(self.broadcast_buffers, bool):
            raise TypeError(f"zcompile: option 'broadcast_buffers' must be a bool, got {self.broadcast_buffers!r}")
        if not isinstance(self.sync_module_states, bool):
            raise TypeError(f"zcompile: option 'sync_module_states' must be a bool, got {self.sync_module_states!r}")
        if not isinstance(self.check_ranks, bool):
            raise TypeError(f"zcompile: option 'check_ranks' must be a bool, got {self.check_ranks!r}")
        if not finite_number(self.check_timeout_s) or self.check_timeout_s <= 0:
            raise ValueError(
                f"zcompile: option 'check_timeout_s' must be a positive finite number, got {self.check_timeout_s!r}"
            )

    @property
    def mesh_dims(self) -> tuple[str, ...]:
        """The names of option ``mesh``'s dims (``()`` without a mesh)."""
        return tuple(getattr(self.mesh, "mesh_dim_names", None) or ()) if self.mesh is not None else ()

    @property
    def hybrid(self) -> bool:
        """Whether the states are sharded inside groups and replicated across them."""
        return self.shard_size is not None or self.mesh_dims in (MESH_DIMS_HYBRID, MESH_DIMS_HYBRID_TP)

    @property
    def tensor_parallel(self) -> bool:
        """Whether ``mesh`` has a ``"tp"`` dim: DTensor parameters on ``mesh["tp"]``, their pieces sharded
        over ``mesh["dp"]`` (or over ``mesh["shard"]`` and replicated across ``mesh["replicate"]``)."""
        return self.mesh_dims in (MESH_DIMS_TP, MESH_DIMS_HYBRID_TP)

    def shard_group_size(self, world_size: int) -> int:
        """How many ranks each state is sharded over in a world of ``world_size``: the shard group's size
        with hybrid sharding, else ``world_size``. ``ValueError`` when ``shard_size`` does not divide it."""
        if self.mesh is not None:
            return self.mesh["dp" if self.mesh_dims == MESH_DIMS_TP else "shard"].size()
        if self.shard_size is None:
            return world_size
        if self.shard_size == "node":
            local = os.environ.get("LOCAL_WORLD_SIZE")
            size = self.node_size or (int(local) if local and local.isdigit() and int(local) > 0 else world_size)
        else:
            size = self.shard_size
        if size < 2 <= world_size:
            raise ValueError(
                f"zcompile: option 'shard_size' {self.shard_size!r} is {size} rank here: nothing would be sharded "
                "(that is DDP). Use shard_size >= 2, or set node_size for 'node'"
            )
        if world_size % size:
            raise ValueError(
                f"zcompile: option 'shard_size' {size} does not divide the {world_size} ranks; use a divisor of "
                "the world size (the shard groups are that many consecutive ranks each)"
            )
        return min(size, world_size)

    def _check_hybrid_sharding(self) -> None:
        size = self.shard_size
        if size is not None and size != "node" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"zcompile: option 'shard_size' must be an int >= 2, \"node\" or None, got {size!r}")
        if size == 1:
            raise ValueError(
                "zcompile: option 'shard_size' 1 shards nothing: every rank would keep the whole model states, "
                "which is DDP. Use shard_size >= 2, or torch's DistributedDataParallel"
            )
        if self.mesh is not None:
            names = self.mesh_dims
            if names not in (MESH_DIMS_HYBRID, MESH_DIMS_TP, MESH_DIMS_HYBRID_TP) or getattr(
                self.mesh, "ndim", None
            ) != len(names):
                raise ValueError(
                    "zcompile: option 'mesh' must be a torch DeviceMesh with dims named ('replicate', 'shard') "
                    "(hybrid sharding: init_device_mesh(device, (replicas, shard_size), mesh_dim_names=('replicate', "
                    "'shard'))), ('dp', 'tp') (a tensor-parallel model: init_device_mesh(device, (dp, tp), "
                    "mesh_dim_names=('dp', 'tp'))) or ('replicate', 'shard', 'tp') (both), got "
                    f"{self.mesh!r}"
                )
            if self.tensor_parallel:
                self._check_tensor_parallel()
            if names == MESH_DIMS_TP:
                return
            if size is not None:
                raise ValueError("zcompile: options 'mesh' and 'shard_size' both set the shard group; pass one")
            if self.mesh.size(names.index("shard")) < 2:
                raise ValueError(
                    "zcompile: option 'mesh' has a 'shard' dim of 1: nothing would be sharded, every rank would "
                    "keep the whole model states (DDP). Give the 'shard' dim 2 or more ranks"
                )
        if not self.hybrid:
            return
        if self.group is not None:
            raise ValueError(
                "zcompile: option 'group' with hybrid sharding (shard_size / mesh): the shard and replicate groups "
                "are made from the whole world; pass a 'mesh' built over the ranks you want instead of 'group'"
            )
        if self.hpz_size is not None or self.quantize_grads:
            raise ValueError(
                "zcompile: hybrid sharding (shard_size / mesh) does not compose with ZeRO++'s hpz_size or "
                "quantize_grads yet: hybrid sharding already keeps every gather inside the shard group, which "
                "is what hpZ does, and qgZ's hierarchy spans the whole world. Drop those options"
            )

    def _check_tensor_parallel(self) -> None:
        if self.shard_size is not None:
            raise ValueError(
                "zcompile: options 'mesh' with a 'tp' dim and 'shard_size' together: the mesh sets the groups. For "
                "hybrid sharding of a tensor-parallel model pass a 3-D mesh ('replicate', 'shard', 'tp') and drop "
                "'shard_size'"
            )
        if self.group is not None:
            raise ValueError(
                "zcompile: options 'group' and 'mesh' both set the data-parallel group; pass the mesh alone (its 'dp' "
                "dim is the group)"
            )
        if self.hpz_size is not None or self.quantize_grads or self.quantize_weights:
            raise ValueError(
                "zcompile: ZeRO++ (quantize_weights, quantize_grads, hpz_size) with a tensor-parallel mesh is not "
                "supported yet; drop those options"
            )
        if self.memory_limit_mb is not None:
            raise ValueError(
                "zcompile: option 'memory_limit_mb' does not plan a tensor-parallel model yet (mesh ('dp', 'tp')); "
                "drop it and set 'stage' (and the other options) yourself: zcompile.plan(make_model, batch, "
                "world_size=..., memory_limit_mb=..., tensor_parallel=tp), run in a process without a process group, "
                "chooses them for this layout (docs/memory-limit.md)"
            )

    @property
    def effective_reduce_dtype(self) -> torch.dtype | None:
        return self.reduce_dtype if self.reduce_dtype is not None else self.param_dtype

    def _check_activation_memory_budget(self) -> None:
        budget = self.activation_memory_budget
        if budget is None:
            return
        if isinstance(budget, str):
            if activation_budget_bytes(budget) is None:
                raise ValueError(
                    f"zcompile: option 'activation_memory_budget' as a string is MiB per rank, like "
                    f"'256MiB', got {budget!r}"
                )
            if self.compiler == "inductor":
                raise ValueError(
                    "zcompile: option 'activation_memory_budget' in MiB needs compiler='eager' (a "
                    "trial partition turns it into a fraction); with inductor give a fraction 0..1"
                )
            return
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1:
            raise ValueError(
                f"zcompile: option 'activation_memory_budget' must be a fraction 0..1 of the saved "
                f"activations or a string like '256MiB', got {budget!r}"
            )

    def for_graph(self, device_type: str, has_marked_blocks: bool) -> ZeroConfig:
        """This config with ``compiler="auto"`` made concrete for one graph: ``"inductor"`` for a graph
        on CUDA, ``"eager"`` where inductor does not apply or does not pay (a CPU graph, blocks marked
        by ``mark_repeated_blocks``, an ``activation_memory_budget`` in MiB)."""
        if self.compiler != "auto":
            return self
        eager = device_type != "cuda" or has_marked_blocks or isinstance(self.activation_memory_budget, str)
        return dataclasses.replace(self, compiler="eager" if eager else "inductor")

    @classmethod
    def from_options(cls, options: ZeroConfig | dict[str, Any] | None) -> ZeroConfig:
        """Builds a config from ``torch.compile``'s ``options`` (a dict, a ZeroConfig or None)."""
        if options is None:
            return cls()
        if isinstance(options, ZeroConfig):
            return options
        if not isinstance(options, dict):
            raise TypeError(f"zcompile: options must be a dict or zcompile.ZeroConfig, got {type(options).__name__}")
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(f"zcompile: unknown option(s) {unknown}; valid options are {valid}")
        return cls(**options)

    def replace(self, **changes: Any) -> ZeroConfig:
        return dataclasses.replace(self, **changes)


def activation_budget_bytes(budget: str) -> int | None:
    """``"256MiB"`` (or ``"256 MiB"``) -> bytes; None when the string is not of that form."""
    number = budget.strip().removesuffix("MiB").strip()
    try:
        value = float(number)
    except ValueError:
        return None
    return int(value * 2**20) if budget.strip().endswith("MiB") and math.isfinite(value) and value >= 0 else None


def finite_number(value: Any) -> bool:
    """An int or float that is not a bool, NaN or infinite: NaN passes every range check (``nan < 0`` is
    False) and would be taken silently, infinity would fail later in an int conversion that names no option."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _parse_dtype(option: str, value: Any) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        if value is not None and not value.is_floating_point:
            raise ValueError(f"zcompile: option {option!r} must be a floating dtype, got {value}")
        return value
    if isinstance(value, str) and value.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[value.lower()]
    raise ValueError(
        f"zcompile: option {option!r} must be a torch dtype or one of {sorted(_DTYPE_NAMES)}, got {value!r}"
    )


MIB = 2**20
MEMORY_PLAN_ATTR = "_zcompile_memory_plan"  # on a model: the plan memory_limit_mb made at its first compile
AUTO_MEMORY_MARGIN = 0.10  # memory_limit_mb="auto": less 10% (allocator fragmentation, CUDA context, NCCL buffers)
_SIZE_UNITS = {"KiB": 2**10, "MiB": MIB, "GiB": 2**30, "TiB": 2**40, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}


def memory_limit_bytes(limit: float | str, device_bytes: float | None = None) -> int:
    """Option ``memory_limit_mb`` as bytes: a number of MiB, a size (``"80GiB"``, ``"70GB"``, ``"512MiB"``)
    or ``"auto"``: ``device_bytes`` less ``AUTO_MEMORY_MARGIN``."""
    if isinstance(limit, str):
        text = limit.strip()
        if text == "auto":
            if device_bytes is None:
                raise ValueError("zcompile: option 'memory_limit_mb' 'auto' needs the device's memory to read")
            return int(device_bytes * (1 - AUTO_MEMORY_MARGIN))
        match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(KiB|MiB|GiB|TiB|KB|MB|GB|TB)?", text)
        if match is None:
            raise ValueError(
                f"zcompile: option 'memory_limit_mb' must be MiB (a number), a size like '80GiB' or 'auto', got {limit!r}"
            )
        return int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or "MiB"])
    if not finite_number(limit) or limit <= 0:
        raise ValueError(
            f"zcompile: option 'memory_limit_mb' must be a positive number of MiB, a size or 'auto', got {limit!r}"
        )
    return int(limit * MIB)
