"""Per-parameter shards: the flat 1/N slice of each parameter that a rank owns.

Each parameter is flattened, padded to a multiple of N and cut into N equal slices; rank r owns
slice r. The shard is an fp32 leaf tensor (the master weight): gradients of the compiled graphs
land on ``shard.grad`` and the optimizer updates the shard. At stages 1 and 2 with an fp32
parameter the shard is a view of the parameter's own (padded) storage, not a copy; with a
narrower ``param_dtype`` the graphs read a replica in that dtype instead (``ShardedParam.replica``).
The user's ``nn.Parameter`` keeps its shape and strides (so Dynamo's guards stay valid) and, at
stage 3 or beside a replica, its storage is freed.

The link from a parameter to its shard is stored on the parameter itself (``SHARD_ATTR``), so the
optimizer, ``gathered`` and later compiles of other graphs find the same shard without any
module-level registry.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from zcompile.agreement.initial_values import value_digest
from zcompile.common.dynamo_frame import graph_break_reasons
from zcompile.common.process_group import DataParallelGroup, all_gather_eager
from zcompile.passes.grad_hooks import new_hooks_token
from zcompile.passes.param_collectives import replica_dtype
from zcompile.sharding.sharded_parameter import SHARD_ATTR, grad_of, mark_sharded, set_grad, shard_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FlatPiece:
    """Rank ``rank``'s piece of a flat tensor of ``numel`` elements cut between ``world`` ranks: the
    layout of every shard (and, in ``zcompile.checkpoint``, of every saved tensor; it is DTensor's
    ``Shard(0)`` chunking, so DCP reshards it)."""

    numel: int
    world: int
    rank: int

    @property
    def chunk(self) -> int:
        """Elements per rank, the shard size (at least 1: a shard is never empty)."""
        return max(1, math.ceil(self.numel / self.world))

    @property
    def offset(self) -> int:
        """Index of this rank's first element in the flat, padded tensor."""
        return self.rank * self.chunk

    @property
    def owned(self) -> int:
        """Real (unpadded) elements of this rank's piece: ``chunk``, fewer or none on the last ranks."""
        return max(0, min(self.numel - self.offset, self.chunk))

    def is_shard(self, value) -> bool:
        """Whether ``value`` is a tensor laid out like this rank's shard (optimizer moments are)."""
        return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == self.chunk

    def padded(self, local: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
        """A new fp32 shard holding ``local`` (this rank's ``owned`` elements), zero past them."""
        shard = torch.zeros(self.chunk, dtype=torch.float32, device=device or local.device)
        shard[: local.numel()] = local
        return shard


@dataclass(eq=False)
class ShardedParam:
    """One parameter's sharding: its full geometry, the owned flat shard and the stage it runs."""

    param: torch.nn.Parameter
    name: str
    stage: int
    group: DataParallelGroup
    shard: torch.Tensor
    reduce_dtype: torch.dtype | None = None  # stage 1: dtype of the reduce-scatter at the step
    # stages 1 and 2 with param_dtype: the replicated parameter in that dtype, what the graphs read
    # and the step's all-gather refreshes; the fp32 parameter is then freed like a stage-3 one
    replica: torch.Tensor | None = None
    # stage 2 with a replica: this rank's slice of the replica's padded storage, a leaf whose .grad
    # receives the averaged gradient shard in the replica's dtype (ZeRO's 2 bytes, not fp32's 4)
    grad_carrier: torch.Tensor | None = None
    # collectives issued for this step's gradient before the step (stage 1's reduce-scatter and the
    # norm's all-reduce when gradients are clipped, see zcompile.optim.clip); the step reports and clears them
    pre_step_records: list = field(default_factory=list, repr=False)
    # compiled calls with gradients enabled since the ranks last agreed on a step (zcompile.agreement.step_agreement)
    training_calls: int = field(default=0, repr=False)
    # the zcompile.agreement.step_agreement.AgreedStep of the last step the ranks agreed on among this parameter's
    # optimizer (None: none yet): the first compiled call with collectives after it needs no agreement of its own
    agreed_step: object | None = field(default=None, repr=False)
    # the shard's gradient at the last optimizer step, until a zero_grad (zcompile.routes.zero_grad)
    stepped_grad: weakref.ref | None = field(default=None, repr=False)
    # stages 1 and 2 in fp32: the address of the padded storage the parameter was moved into, whose
    # chunk is the shard (_shard_in_replicated_storage); None otherwise
    home: int | None = field(default=None, repr=False)
    # the digest of the parameter's values when it was sharded, until the ranks compared theirs at a
    # step (zcompile.agreement.initial_values): ranks that start from different weights would train a mix of them
    initial_digest: int | None = field(default=None, repr=False)
    # the parameter got new storage since the ranks last agreed on a step (zcompile.agreement.step_agreement compares it)
    storage_replaced: bool = field(default=False, repr=False)
    # the zcompile.sharding.buffer_sync.BufferSync of the last graph that ran this parameter and changes module
    # buffers: the optimizer's step broadcasts them from rank 0
    buffer_sync: object | None = field(default=None, repr=False)
    # a tensor-parallel model's DTensor parameter split over mesh["tp"] (this is one rank's piece): gradient
    # norms sum it over the tensor-parallel ranks, where a replicated parameter counts once (zcompile.optim.clip)
    split_over_tensor_parallel: bool = field(default=False, repr=False)
    shape: torch.Size = field(init=False)
    numel: int = field(init=False)
    _replicated_alias: torch.Tensor | None = field(default=None, init=False, repr=False)
    _hooks_token: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.shape = self.param.shape
        self.numel = self.param.numel()

    @property
    def replicated_alias(self) -> torch.Tensor:
        """A detached view of the full parameter, or its low-precision replica (stage 2 graphs read
        it; its grad goes to the shard). Made once (ShardSwap reads it at every compiled call), and
        again after the parameter got new storage (``follow_replaced_storage``): a kept alias of the
        old storage would have the graphs read weights the step no longer refreshes."""
        if self._replicated_alias is None:
            self._replicated_alias = (self.replica if self.replica is not None else self.param).detach()
        return self._replicated_alias

    @property
    def hooks_token(self) -> torch.Tensor:
        """The tensor a graph that runs this parameter's gradient hooks takes to find them
        (``passes/grad_hooks.py``), made on first use."""
        if self._hooks_token is None:
            with _allocation_mode(self.param):  # a fake parameter's token is fake (zcompile.simulate)
                self._hooks_token = new_hooks_token(self.param)
        return self._hooks_token

    @property
    def replicated(self) -> torch.Tensor:
        """The full tensor a stage-1/2 step refreshes: the low-precision replica, else the parameter's data."""
        return self.replica if self.replica is not None else self.param.data

    @property
    def replicated_dtype(self) -> torch.dtype:
        """The dtype the step's all-gather moves at stages 1 and 2 (the replica's, else the parameter's)."""
        return self.replica.dtype if self.replica is not None else self.param.dtype

    @property
    def updates_replicated_in_place(self) -> bool:
        """Stages 1 and 2 at one rank in fp32: the shard is the parameter's whole storage, so the step's
        update writes the weight the graphs read and there is nothing to all-gather or copy back."""
        return (
            self.group.world_size == 1
            and self.stage in (1, 2)
            and self.replica is None
            and self.shard.data_ptr() == self.param.data_ptr()
        )

    def padded_replicated(self) -> torch.Tensor | None:
        """The replicated tensor's whole padded storage, flat (``padded_numel`` elements, rank r's chunk
        at ``r * shard_numel``), or None when it has none: exactly an all-gather's output, so the
        stage-1/2 step gathers straight into the parameter (fp32, ``_shard_in_replicated_storage``)
        or the low-precision replica, with no gathered buffer and no copy out of it."""
        full = self.replicated.detach()
        if (
            self.stage not in (1, 2)
            or not full.is_contiguous()
            or full.storage_offset() != 0
            or full.untyped_storage().nbytes() < self.padded_numel * full.element_size()
        ):
            return None
        return full.as_strided((self.padded_numel,), (1,), 0)

    @property
    def grad_target(self) -> torch.Tensor:
        """The leaf whose ``.grad`` is this rank's averaged gradient shard: the grad carrier, else the shard."""
        return self.grad_carrier if self.grad_carrier is not None else self.shard

    @property
    def shard_grad(self) -> torch.Tensor | None:
        """This rank's averaged gradient shard (stages 2 and 3 after backward; stage 1 once reduced)."""
        return self.grad_target.grad

    @shard_grad.setter
    def shard_grad(self, value: torch.Tensor | None) -> None:
        target = self.grad_target
        target.grad = None if value is None else value.to(target.dtype)

    @property
    def full_grad(self) -> torch.Tensor | None:
        """This rank's local, unreduced full gradient: stage 1's (on the replica when there is one),
        or one from eager code at stages 2 and 3."""
        if self.replica is not None and self.replica.grad is not None:
            return _dense_grad_of(self.replica)
        return _dense_grad_of(self.param)

    @property
    def has_full_grad(self) -> bool:
        """Whether ``full_grad`` is not None, without making a sparse gradient dense (a step's bookkeeping reads it)."""
        return (self.replica is not None and self.replica.grad is not None) or grad_of(self.param) is not None

    def clear_full_grad(self) -> None:
        if self.replica is not None:
            self.replica.grad = None
        set_grad(self.param, None)

    @property
    def freed_reason(self) -> str:
        """Why no rank holds this parameter's full fp32 value between steps (for error messages)."""
        if self.replica is None:
            return "ZeRO stage 3"
        return (
            f"ZeRO stage {self.stage} with param_dtype={self.replica.dtype}: the graphs read a "
            f"{self.replica.dtype} replica, the fp32 values live on the shards"
        )

    @property
    def piece(self) -> FlatPiece:
        return FlatPiece(self.numel, self.group.world_size, self.group.rank)

    @property
    def shard_numel(self) -> int:
        return self.shard.numel()

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.group.world_size

    @property
    def shard_offset(self) -> int:
        """Index of this rank's first element in the flat, padded parameter."""
        return self.piece.offset

    @property
    def owned_numel(self) -> int:
        """Elements of the real (unpadded) parameter that this rank's shard covers."""
        return self.piece.owned

    @property
    def grad_reduce_dtype(self) -> torch.dtype:
        """Stage 1: the dtype in which the full gradient is reduce-scattered (fp32 unless set)."""
        return self.reduce_dtype or torch.float32

    def take_pre_step_records(self) -> list:
        records, self.pre_step_records = self.pre_step_records, []
        return records

    @property
    def is_freed(self) -> bool:
        return self.param.untyped_storage().size() == 0

    @property
    def frees_full(self) -> bool:
        """Whether the parameter's full fp32 storage is freed at rest: stage 3, or a low-precision replica."""
        return self.stage == 3 or self.replica is not None

    def free_full(self) -> None:
        """Drops the full-size storage (stage 3 at rest); shape and strides are kept."""
        self.param.untyped_storage().resize_(0)

    def materialize_full(self) -> None:
        """Re-allocates the full storage and fills it from every rank's shard (collective)."""
        self.allocate_full()
        self.param.data.view(-1).copy_(self.all_gathered(self.shard.detach().to(self.param.dtype))[: self.numel])

    def allocate_full(self) -> None:
        """The full storage back where it was freed, its elements not yet written (a gather fills them)."""
        if self.is_freed:
            self.param.untyped_storage().resize_(self.numel * self.param.element_size())

    def all_gathered(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's ``shard`` (this parameter's shard layout: the shard, its gradient, a cast of
        either) concatenated: the flat padded ``[padded_numel]``, the full value in its first
        ``numel`` elements; ``shard`` itself in a world of one (collective otherwise)."""
        if self.group.world_size == 1:
            return shard
        gathered = torch.empty(self.padded_numel, dtype=shard.dtype, device=shard.device)
        all_gather_eager(gathered, shard.contiguous(), self.group)
        return gathered

    def padded_flat(self, full: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``full`` (the parameter's shape, e.g. its gradient) flat in ``dtype``, zero-padded to N shards."""
        flat = full.detach().reshape(-1).to(dtype)
        return F.pad(flat, (0, self.padded_numel - self.numel)) if self.padded_numel > self.numel else flat

    def follow_replaced_storage(self) -> None:
        """Stages 1 and 2 in fp32, after code gave the parameter new storage (``param.data = other``:
        weight loading, init helpers): its values become the master weight again, moved into a padded
        storage of their own whose chunk is the new shard (requires_grad and gradient carried over).
        Otherwise the optimizer would keep updating the old storage's slice and the next step would
        write it over the new values, silently."""
        if self.home is None or self.param.data_ptr() == self.home:
            return
        data = self.param.data
        if data.dtype != self.shard.dtype or data.device != self.shard.device or data.shape != self.shape:
            raise ValueError(
                f"zcompile: parameter {self.name!r} became {data.dtype} {tuple(data.shape)} on {data.device} after it "
                f"was sharded as {self.shard.dtype} {tuple(self.shape)} on {self.shard.device} (model.to(), .half() "
                "or `.data =` after the first compiled call). Convert the model before compiling it and creating "
                "the optimizer; for mixed precision use the option param_dtype"
            )
        old = self.shard
        new = _shard_in_replicated_storage(self.param, self.piece)
        new.requires_grad_(old.requires_grad)
        new.grad = old.grad
        self.shard, self.home, self._replicated_alias = new, self.param.data_ptr(), None
        self.storage_replaced = True
        if (
            self.group.world_size > 1
        ):  # the ranks compare the new values at the next step (zcompile.agreement.initial_values)
            self.initial_digest = value_digest(data)
        log.info("zcompile: parameter %s got new storage; its values are the master weight again", self.name)

    def write_shard_from_full(self) -> None:
        """Copies this rank's slice of the full parameter into the shard, and the whole of it into the
        low-precision replica if there is one (local, no collective)."""
        owned = self.owned_numel
        with torch.no_grad():
            if owned:
                self.shard[:owned].copy_(self.param.data.view(-1)[self.shard_offset : self.shard_offset + owned])
            if self.replica is not None:
                self.replica.copy_(self.param.data)

    def refresh_replicated(self) -> None:
        """Stages 1 and 2: the replicated parameter (or its replica) from every rank's shard (collective)."""
        if self.replica is None:
            self.materialize_full()
            return
        gathered = self.all_gathered(self.shard.detach().to(self.replica.dtype))
        with torch.no_grad():
            self.replica.view(-1).copy_(gathered[: self.numel])


def shard_parameter(
    param: torch.nn.Parameter,
    name: str,
    stage: int,
    group: DataParallelGroup,
    reduce_dtype: torch.dtype | None = None,
    param_dtype: torch.dtype | None = None,
    mark: bool = True,
) -> ShardedParam:
    """Creates (or returns the existing) shard of ``param``; frees the full storage at stage 3.

    ``mark=False`` leaves the parameter's class alone (``mark_refusing_parameter`` later): the backend
    marks only once its compile succeeded, because Dynamo may restart the frame's analysis from
    inside the compile (``dynamic=True``: its scalar tensorification) and must then trace the same
    parameter classes as the first time (a class changed in between is a SpeculationLogDivergence).

    Stages 1 and 2 with a ``param_dtype`` other than the parameter's keep the replicated parameter
    in ``param_dtype`` (``ShardedParam.replica``): ZeRO's mixed-precision scheme, 2 bytes per
    replicated element with the fp32 master on the shard only. The fp32 parameter is freed then.

    A parameter already sharded by an earlier compile (another graph of the same model, or a
    recompile) keeps its shard; asking for a different stage or group is an error because the
    optimizer state and the other graphs were built for the first one.
    """
    existing = shard_of(param)
    lowp_dtype = replica_dtype(stage, param_dtype, param.dtype, param.requires_grad)
    if existing is not None:
        existing_dtype = None if existing.replica is None else existing.replica.dtype
        if (
            existing.stage != stage
            or existing.group.name != group.name
            or (existing.stage in (1, 2) and existing.param.requires_grad and existing_dtype != lowp_dtype)
        ):
            raise ValueError(
                f"zcompile: parameter {name!r} is already sharded with stage {existing.stage} on group "
                f"{existing.group.name!r} (replicated in {existing_dtype or existing.param.dtype}); it cannot be "
                f"compiled again with stage {stage} on group {group.name!r} (replicated in "
                f"{lowp_dtype or param.dtype}). Use one ZeroConfig for every torch.compile of the same model."
                + (_EAGER_FIRST if existing.stage == 1 and stage != 1 else "")
            )
        return existing
    with _allocation_mode(param):
        return _new_shard(param, name, stage, group, reduce_dtype, lowp_dtype, mark)


# the other way a weight has a stage-1 shard that no compile asked for (shard_eager_parameter)
_EAGER_FIRST = (
    " If the model has one config, this weight trained outside the compiled graphs first (the warning "
    "'got a gradient outside the compiled graphs' named it): eager code, or a frame Dynamo ran uncompiled, "
    "gave it a stage-1 shard. Make that code compile from the first step, or train with stage 1 or 2."
)


def _is_fake(param: torch.nn.Parameter) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(param, FakeTensor)


def _allocation_mode(param: torch.nn.Parameter):
    """The fake-tensor mode of a fake parameter (``zcompile.simulate``: its shards are fake too, so a
    model of any size is sharded without memory), else nothing."""
    return param.fake_mode if _is_fake(param) else contextlib.nullcontext()


def _new_shard(
    param: torch.nn.Parameter,
    name: str,
    stage: int,
    group: DataParallelGroup,
    reduce_dtype: torch.dtype | None,
    lowp_dtype: torch.dtype | None,
    mark: bool,
) -> ShardedParam:
    _check_shardable(param, name)
    piece = FlatPiece(param.numel(), group.world_size, group.rank)
    shard_numel = piece.chunk
    in_replicated_storage = stage in (1, 2) and param.dtype == torch.float32 and lowp_dtype is None
    if in_replicated_storage:
        shard = _shard_in_replicated_storage(param, piece)  # the master weight is the replica's own slice
    else:
        shard = torch.zeros(shard_numel, dtype=torch.float32, device=param.device)
    sharded = ShardedParam(param=param, name=name, stage=stage, group=group, shard=shard, reduce_dtype=reduce_dtype)
    if group.world_size > 1 and not _is_fake(param) and param.device.type != "meta":
        sharded.initial_digest = value_digest(
            param
        )  # before the full value is freed (zcompile.agreement.initial_values)
    if in_replicated_storage and not _is_fake(param):
        sharded.home = param.data_ptr()
    if lowp_dtype is not None:
        padded = torch.zeros(piece.chunk * piece.world, dtype=lowp_dtype, device=param.device)
        sharded.replica = padded[: piece.numel].view(param.shape)
        if stage == 1:  # the graphs take the replica as the parameter: its gradient is the full local one
            sharded.replica.requires_grad_(True)
        else:  # the graphs route the gradient, reduce-scattered, to this rank's slice of the replica
            sharded.grad_carrier = padded[piece.offset : piece.offset + piece.chunk].requires_grad_(True)
    sharded.write_shard_from_full()
    shard.requires_grad_(param.requires_grad)
    setattr(param, SHARD_ATTR, sharded)
    if sharded.frees_full:
        if mark:
            mark_refusing_parameter(sharded)
        sharded.free_full()
    log.debug("sharded %s %s -> %d elements on rank %d", name, tuple(param.shape), shard_numel, group.rank)
    return sharded


def mark_refusing_parameter(sharded: ShardedParam) -> None:
    """Eager use of a parameter whose full storage is freed raises a clear error from now on
    (``zcompile.sharding.sharded_parameter``); nothing for one that keeps its full value."""
    if sharded.frees_full:
        mark_sharded(sharded.param)


def mark_like_siblings(
    shards: list[ShardedParam], frame_modules: list[torch.nn.Module], roots: list[torch.nn.Module]
) -> None:
    """Gives the not yet sharded parameters of the siblings of ``frame_modules`` (the modules of the
    compiled frame: the modules of their classes inside ``roots``, the model whose forward called this
    graph) the class ``mark_refusing_parameter`` gave ``shards`` of their dtype, before Dynamo builds
    the graph's guards.

    Dynamo guards a graph's parameters by type, and reuses the graph for every instance of a module
    class: a block whose forward has a graph break (Dynamo then runs the model's loop over its blocks
    eagerly) is one graph for all layers, each layer's weights sharded at its first call. A layer
    still plain would fail the guard its sharded sibling set, so each layer would recompile until
    Dynamo's ``recompile_limit``, past which the layers run eagerly with their weights replicated.
    Marked ahead, a weight behaves as a plain one until it is sharded (the class refuses only freed
    storages). Only the siblings: a weight that eager code uses (the embedding of a model whose
    forward runs eagerly) stays plain, since an eager operation on a marked one, under a compiled
    call, runs the class's Python hook as a frame of its own, which Dynamo compiles."""
    dtypes = {sharded.param.dtype for sharded in shards if sharded.frees_full}
    # a torch class (Sequential, Linear) is nobody's block: its instances may be anywhere, eager code too
    classes = {type(module) for module in frame_modules if not type(module).__module__.startswith("torch.")}
    if not dtypes or not classes:
        return
    for root in roots:
        for module in root.modules():
            if type(module) not in classes:
                continue
            for param in module.parameters():
                if param.dtype in dtypes and shard_of(param) is None:
                    mark_sharded(param)


def _shard_in_replicated_storage(param: torch.nn.Parameter, piece: FlatPiece) -> torch.Tensor:
    """Stages 1 and 2 in fp32: moves ``param`` into a flat storage padded to ``world`` whole chunks
    and returns this rank's chunk of it as the shard (a view, no copy of its own).

    ZeRO's fp32 accounting (``../shared/ZERO.md``) has no separate master weight: the replicated
    fp32 parameter already holds this rank's slice, so a shard of its own would hold those 4Psi/N
    bytes twice. The optimizer updates the slice in place and the step's all-gather fills the
    others. The parameter keeps its object, shape, strides and dtype (Dynamo's guards hold); its
    storage grows by the padding only (fewer than ``world`` elements).
    """
    padded = torch.zeros(piece.chunk * piece.world, dtype=param.dtype, device=param.device)
    with torch.no_grad():
        padded[: piece.numel].copy_(param.data.reshape(-1))
    param.data = padded[: piece.numel].view(param.shape)
    return padded[piece.offset : piece.offset + piece.chunk]


def shard_eager_parameter(
    param: torch.nn.Parameter,
    name: str,
    group: DataParallelGroup,
    shown: list[str] | None = None,
    label: str | None = None,
) -> ShardedParam:
    """The shard of a parameter that got a full gradient outside every compiled graph.

    Dynamo runs some code eagerly (a graph break inside a loop skips the whole frame), so a
    parameter can get a full ``.grad`` without ever reaching the backend. It is then trained with
    stage-1 semantics (gradient reduce-scattered at the step or when clipping, all-gathered after),
    which keeps data parallelism exact; its memory is not reduced. ``name`` names the shard (the
    same on every rank). The caller says so once for all it shards in one pass
    (``warn_eager_sharded``): a module left uncompiled has dozens of parameters, and a line each
    would bury the log. ``shown``, when given, gets how
    this parameter reads in that warning: ``label`` (default ``name``) and its shape.
    """
    if shown is not None:
        shown.append(f"{label or name} of shape {tuple(param.shape)}")
    return shard_parameter(param, name, stage=1, group=group)


def warn_eager_sharded(shown: list[str], where: str, members: list[ShardedParam]) -> None:
    """One warning for the parameters ``shard_eager_parameter`` just sharded (``shown``) at ``where``,
    among ``members`` (the shards stepped or clipped there, theirs included). Where every member is
    stage 1 in its own dtype the eager ones train and hold what the compiled ones do, so there is
    nothing to fix: said at info level only (a low-precision replica is what an eager one lacks). With
    no compiled member beside them the warning stays: a graph compiled later at stage 2 or 3 that takes
    them is refused, and its error points back to this line."""
    if not shown:
        return
    listed = ", ".join(shown[:3]) + (f" and {len(shown) - 3} more" if len(shown) > 3 else "")
    if len(members) > len(shown) and all(member.stage == 1 and member.replica is None for member in members):
        log.info(
            "zcompile: %d parameters got a gradient outside the compiled graphs at %s: %s; stage 1, as the "
            "compiled ones",
            len(shown),
            where,
            listed,
        )
        return
    # a frame Dynamo could not trace keeps its weights out of every graph: its reason (and hint) is the fix
    reasons = graph_break_reasons()
    named = f". Dynamo left code out of its graphs in this process for: {'; '.join(reasons)}" if reasons else ""
    log.warning(
        "zcompile: %d parameters got a gradient outside the compiled graphs at %s (eager code, a module left "
        "uncompiled, or a skipped frame): %s. They are kept replicated and their gradients reduce-scattered like "
        "stage 1's, so training stays exact but their memory is not reduced%s",
        len(shown),
        where,
        listed,
        named,
    )


def _dense_grad_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor``'s gradient, made dense in place where it is sparse (``nn.Embedding(sparse=True)``:
    the reduce-scatter, the norm and the update read the dense layout shards are cut from)."""
    grad = grad_of(tensor)
    if grad is not None and grad.layout != torch.strided:
        grad = grad.to_dense()
        set_grad(tensor, grad)
    return grad


# by a weight's dimensions: the channels-last layout model.to(memory_format=...) gives it
_CHANNELS_LAST = {4: (torch.channels_last, "channels_last"), 5: (torch.channels_last_3d, "channels_last_3d")}


def _check_shardable(param: torch.Tensor, name: str) -> None:
    if not param.dtype.is_floating_point:
        raise TypeError(
            f"zcompile: parameter {name!r} has dtype {param.dtype}; only floating parameters can be sharded"
        )
    layout, name_in_torch = _CHANNELS_LAST.get(param.dim(), (None, None))
    if layout is not None and not param.is_contiguous() and param.is_contiguous(memory_format=layout):
        # model.to(memory_format=torch.channels_last), the CNN recipe: the weights' strides are permuted
        raise ValueError(
            f"zcompile: parameter {name!r} is in {name_in_torch} memory format (strides {tuple(param.stride())}); "
            "zcompile shards parameters in their contiguous layout. Keep the parameters contiguous "
            "(`model.to(memory_format=torch.contiguous_format)` before torch.compile) and convert only the "
            f"inputs (`x.to(memory_format=torch.{name_in_torch})`): a convolution runs {name_in_torch} when its "
            "input is"
        )
    if not param.is_contiguous() or param.storage_offset() != 0:
        raise ValueError(
            f"zcompile: parameter {name!r} is not a contiguous tensor that owns its storage "
            "(a view or transposed tensor); make it one with `module.weight = nn.Parameter(w.contiguous().clone())` "
            "before torch.compile"
        )
    if param.untyped_storage().size() != param.numel() * param.element_size():
        raise ValueError(
            f"zcompile: parameter {name!r} shares its storage with other tensors; "
            "give it its own storage (clone it) before torch.compile"
        )
