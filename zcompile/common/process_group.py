"""The data-parallel process group and the eager collectives of the runtime (optimizer step, ``gathered``).

Graphs issue their collectives through ``zcompile.passes.collectives`` (functional ops, traced);
code that runs outside graphs uses the public ``torch.distributed`` API through the helpers here.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataParallelGroup:
    """The ranks that share one model replica's states: ``world_size == 1`` means no communication.

    With hybrid sharding these are the shard group's ranks, and ``replicate`` is the group of the
    ranks (one per shard group) that hold the same shards: gradients reduced inside the shard group
    are then all-reduced across it, and values every rank must share are broadcast through both."""

    rank: int
    world_size: int
    name: str | None
    process_group: dist.ProcessGroup | None
    replicate: DataParallelGroup | None = None
    mesh: Any = None  # option 'mesh': the 2-D DeviceMesh ("replicate", "shard") or ("dp", "tp") of every rank
    # a tensor-parallel model: the group its DTensor parameters are split over (mesh["tp"]); this group is
    # then the ranks holding the same pieces (mesh["dp"])
    tensor_parallel: DataParallelGroup | None = None

    @property
    def everyone(self) -> DataParallelGroup:
        """Every rank that trains the model: this group, or with hybrid sharding or tensor parallelism the
        whole world (what a checkpoint is saved and loaded over, each piece written once however many
        replicas hold it)."""
        return self if self.replicate is None and self.tensor_parallel is None else DataParallelGroup.resolve(None)

    @property
    def replicas(self) -> int:
        """How many shard groups hold the same shards (1 without hybrid sharding)."""
        return self.replicate.world_size if self.replicate is not None else 1

    @property
    def data_parallel_size(self) -> int:
        """Every rank that trains the model: the shard group times its replicas."""
        return self.world_size * self.replicas

    @classmethod
    def resolve(cls, group: dist.ProcessGroup | None = None) -> DataParallelGroup:
        if not (dist.is_available() and dist.is_initialized()):
            if group is not None:
                raise RuntimeError("zcompile: a group was given but torch.distributed is not initialized")
            return cls(rank=0, world_size=1, name=None, process_group=None)
        group = group if group is not None else dist.group.WORLD
        return cls(
            rank=dist.get_rank(group),
            world_size=dist.get_world_size(group),
            name=group.group_name,
            process_group=group,
        )


# torch 2.13 renamed the flat collectives (*_into_tensor / *_tensor -> *_single); 2.11 has the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_eager(
    out: torch.Tensor, shard: torch.Tensor, group: DataParallelGroup, async_op: bool = False
) -> dist.Work | None:
    """``out`` = every rank's ``shard`` concatenated; with ``async_op`` returns the work to wait on."""
    return _all_gather_flat(out, shard, group=group.process_group, async_op=async_op)


def reduce_scatter_eager(
    out: torch.Tensor, full: torch.Tensor, group: DataParallelGroup, async_op: bool = False
) -> dist.Work | None:
    """``out`` = this rank's slice of the sum of every rank's ``full``; ``async_op`` as above."""
    return _reduce_scatter_flat(out, full, op=dist.ReduceOp.SUM, group=group.process_group, async_op=async_op)


def gather_to_first_eager(out: torch.Tensor | None, shard: torch.Tensor, group: DataParallelGroup) -> None:
    """``out`` (on the group's rank 0; None elsewhere) = every rank's ``shard`` concatenated."""
    pieces = list(out.view(group.world_size, -1).unbind(0)) if group.rank == 0 else None
    dist.gather(shard, pieces, group_dst=0, group=group.process_group)


def all_reduce_eager(
    tensor: torch.Tensor, group: DataParallelGroup, op: dist.ReduceOp.RedOpType, async_op: bool = False
) -> dist.Work | None:
    """``tensor`` (in place) = ``op`` over every rank's ``tensor`` (a scalar for gradient clipping);
    ``async_op`` as above."""
    return dist.all_reduce(tensor, op=op, group=group.process_group, async_op=async_op)


def all_to_all_eager(
    out: torch.Tensor, rows: torch.Tensor, group: DataParallelGroup, async_op: bool = False
) -> dist.Work | None:
    """``out[r]`` = rank ``r``'s ``rows[this rank]`` (``[N, ...]`` each); ``async_op`` as above."""
    return dist.all_to_all_single(out, rows, group=group.process_group, async_op=async_op)


def broadcast_from_first(
    tensors: list[torch.Tensor], group: DataParallelGroup, bucket_bytes: int | None = None
) -> None:
    """Every rank's ``tensors`` = the group's rank 0's, in one flat broadcast per dtype and device, or
    per ``bucket_bytes`` of them (a whole model's copy would double its memory for a moment)."""
    buckets: list[list[torch.Tensor]] = []
    open_bucket: dict[tuple, tuple[list[torch.Tensor], list[int]]] = {}  # (dtype, device) -> (bucket, [its bytes])
    for tensor in tensors:
        kind = (tensor.dtype, tensor.device)
        bucket, size = open_bucket.get(kind, (None, [0]))
        if bucket is None or (bucket_bytes is not None and size[0] + tensor.nbytes > bucket_bytes):
            bucket, size = [], [0]
            buckets.append(bucket)
            open_bucket[kind] = (bucket, size)
        bucket.append(tensor)
        size[0] += tensor.nbytes
    for bucket in buckets:
        flat = torch.cat([t.detach().reshape(-1) for t in bucket])
        dist.broadcast(flat, group_src=0, group=group.process_group)
        with torch.no_grad():
            for tensor, value in zip(bucket, flat.split([t.numel() for t in bucket])):
                tensor.copy_(value.view_as(tensor))


def reduce_scatter_by_all_to_all(form: str, group: DataParallelGroup) -> bool:
    """Whether ``group``'s in-graph reduce-scatters run as an all-to-all and a sum (the option
    ``reduce_scatter``: ``"native"``, ``"all_to_all"`` or ``"auto"``, all-to-all on gloo). Gloo's
    reduce-scatter all-reduces a clone of its input: twice a reduce-scatter's bytes, and slower than an
    all-to-all and a sum of the same input (``benchmarks/bench_gloo_collectives.py``)."""
    if form != "auto":
        return form == "all_to_all"
    return on_gloo(group)


def on_gloo(group: DataParallelGroup) -> bool:
    """Whether ``group`` communicates through gloo."""
    return group.process_group is not None and "gloo" in str(dist.get_backend(group.process_group))


def gathers_into_buffers(group: DataParallelGroup) -> bool:
    """Whether ``group``'s in-graph all-gathers run into buffers the graph allocates
    (``passes/all_gather_lowering.py``): on gloo, whose own form of the functional all-gather
    corrupts the heap when two are in flight (torch 2.11 and 2.13)."""
    return group.world_size > 1 and on_gloo(group)


def all_gather_coalesced_into(
    outputs: list[torch.Tensor], shards: list[torch.Tensor], group: DataParallelGroup
) -> dist.Work:
    """Each ``outputs[i]`` (a member's flat padded storage, ``[N * s_i]``) = every rank's ``shards[i]``,
    as one collective; async. ``shards[i]`` may be this rank's chunk of ``outputs[i]`` (fp32 stages 1
    and 2: the shard is a view of the parameter's storage), which torch's all-gathers allow.

    Through the process group's coalesced all-gather (a method of the c10d process group, kept here:
    ``torch.distributed`` has no public form of it that writes into given outputs, and
    ``all_gather_coalesced`` is deprecated), for one member too: gloo gathers into a flat buffer of
    its own and copies each member's piece into its storage (instead of into a gathered bucket copied
    again), and when it enqueues the work it sizes a transient ``[members, first shard]`` tensor
    (``AsyncAllgatherCoalescedWork::getOutputTensors``; the flat all-gather's is the whole output).
    The smallest shard first keeps that within the bucket's shard bytes (a large shard first, an
    embedding's, would make it members times that shard); the order is the same on every rank, as the
    buckets are."""
    if isinstance(shards[0], FakeTensor):  # zcompile.simulate's fake world: no fake kernel for the coalesced op
        works = [all_gather_eager(out, shard, group, async_op=True) for out, shard in zip(outputs, shards)]
        return works[-1]
    order = sorted(range(len(outputs)), key=lambda i: shards[i].numel())
    process_group = group.process_group
    # torch 2.13 renamed it (as the flat collectives above); 2.11 has the old name
    coalesced = (
        getattr(process_group, "all_gather_single_coalesced", None) or process_group.allgather_into_tensor_coalesced
    )
    try:
        return coalesced([outputs[i] for i in order], [shards[i] for i in order])
    except RuntimeError as error:
        # torch 2.11's gloo has no coalesced all-gather ("Backend gloo does not support
        # allgather_into_tensor_coalesced"); it refuses before enqueuing anything, on every rank alike
        if "does not support" not in str(error):
            raise
    return _AllWorks([all_gather_eager(outputs[i], shards[i], group, async_op=True) for i in order])


def holders_of(tensors: list[torch.Tensor]) -> list[int]:
    """How many references each of ``tensors`` has now (``Tensor._use_count``: torch's, semi-private), before
    an async collective takes its own (``wait_until_released``)."""
    return [tensor._use_count() for tensor in tensors]


def wait_until_released(tensors: list[torch.Tensor], holders: list[int], limit_s: float = 0.05) -> None:
    """After an async collective's ``wait()``: waits (briefly, yielding) until the backend's worker thread has
    dropped its references to ``tensors`` (back to ``holders``), so that ours are the last.

    Gloo's worker drops them a moment after the work completes. A tensor whose Python object goes first
    is then freed on that thread, which must take the GIL to free the Python object torch kept for it:
    while the interpreter shuts down that ends the process in ``std::terminate`` ("terminate called
    without an active exception") after a run that trained correctly. ``limit_s`` bounds the wait."""
    if any(isinstance(t, FakeTensor) for t in tensors):  # zcompile.simulate's fake world: no thread holds them
        return
    deadline = time.monotonic() + limit_s
    while any(t._use_count() > held for t, held in zip(tensors, holders)) and time.monotonic() < deadline:
        time.sleep(0)  # lets the worker thread run


class _AllWorks:
    """Several collectives' works waited on as one (gloo may finish them out of order)."""

    def __init__(self, works: list[dist.Work]):
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def find_group(ranks: list[int]) -> dist.ProcessGroup | None:
    """A process group already made with exactly ``ranks`` (global ranks, in group-rank order), or None.

    Reads torch's registry of groups (``_world.pg_group_ranks``, semi-private; kept here).
    """
    for group, members in dist.distributed_c10d._world.pg_group_ranks.items():
        if group is dist.GroupMember.NON_GROUP_MEMBER or len(members) != len(ranks):
            continue
        if sorted(members, key=members.__getitem__) == list(ranks):
            return group
    return None


def group_ranks_by_name() -> dict[str, tuple[int, ...]]:
    """The global ranks (in group-rank order) of every process group this rank is in, by group name:
    what the ``group_name`` argument of a graph's collective stands for. Reads the registry
    ``find_group`` reads."""
    return {
        group.group_name: tuple(sorted(members, key=members.__getitem__))
        for group, members in dist.distributed_c10d._world.pg_group_ranks.items()
        if group is not dist.GroupMember.NON_GROUP_MEMBER
    }


def process_group_timeout_s(group: DataParallelGroup) -> float:
    """The timeout ``init_process_group`` (or ``new_group``) gave ``group``'s collectives: how long a
    collective of DDP's would wait for a missing rank; torch's default where it cannot be read."""
    default = dist.default_pg_timeout.total_seconds()
    if group.process_group is None:
        return default
    for device in ("cuda", "cpu"):
        try:  # semi-private, stable since torch 2.2: the backend's options hold the timeout
            return group.process_group._get_backend(torch.device(device)).options._timeout.total_seconds()
        except Exception:
            continue
    return default


@functools.cache  # once per process: a restart's workers are new processes, and say it again
def warn_if_restarts_share_the_agent_store() -> None:
    """A warning when torchrun may restart the workers (``--max-restarts`` > 0) and hands them its
    agent's store: restarted workers then can wait forever in ``init_process_group`` on addresses
    of the failed attempt (torch's, pytorch/pytorch#135712); an unshared store avoids it."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0 and (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    ):
        log.warning(
            "zcompile: torchrun may restart these workers (max restarts %s) and shares its rendezvous store "
            "with them: restarted workers can then wait without end in init_process_group (torch's, "
            "pytorch/pytorch#135712). Launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the environment, "
            "and resume from zcompile.checkpoint (docs/failure-modes.md, elastic restarts).",
            os.environ["TORCHELASTIC_MAX_RESTARTS"],
        )


def default_store() -> dist.Store:
    """The key-value store of the default process group (used for rank checks, never for data), its
    keys scoped to torchrun's restart attempt: a store that outlives an attempt (torchrun's agent
    store) would otherwise hand the restarted workers the counters and values of the failed one."""
    store = dist.distributed_c10d._get_default_store()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return store if attempt is None else dist.PrefixStore(f"zcompile-attempt{attempt}", store)
