"""The sharded optimizer's eager collectives, bucketed and overlapped with its updates.

At stages 1 and 2 the optimizer all-gathers every updated shard back into the replicated
parameter, and at stage 1 it first reduce-scatters every full gradient. One blocking collective
per parameter pays the collective latency once per parameter and leaves the network idle while
the rank updates. Here consecutive parameters (same process group, dtype and device) are grouped
into buckets of up to ``bucket_bytes`` of full (gathered) parameter, each moved by one collective
over a flat buffer, and the collectives run asynchronously:

- ``BucketedGradReduce`` (stage 1): the reduce-scatter of bucket ``i + 1`` is in flight while the
  optimizer updates the parameters of bucket ``i``; it starts once bucket ``i``'s has arrived, so one
  is in flight at a time (started before that wait, two would be, each with gloo's copy of its input);
- ``reduce_grads_onto_shards`` (stage 1, when gradients are clipped): the same reduce-scatters
  issued before the step, leaving the averaged gradient shard on ``shard.grad`` (``zcompile.optim.clip``);
- ``BucketedParamRefresh`` (stages 1 and 2): the all-gather of a bucket starts as soon as its last
  parameter is updated, moves while the next bucket updates, and is waited just before the next
  bucket's starts, so one is in flight at a time: landing it after the next one started would hold
  two, each with gloo's copy, and gain no step time.

What a bucket holds, and nothing longer than it must (the optimizer's own buffers are the part of a
step's peak that ``bucket_mb`` sizes; ``BufferLedger``):

- the all-gather writes straight into each member's padded replicated storage, which is the
  gathered ``[N, s_i]`` layout (``ShardedParam.padded_replicated``): no gathered bucket beside
  gloo's flat buffer and no copy out of it. The bf16 inputs are written by the update into this
  rank's chunk of that storage (``ShardedOptimizer._prepare_update``), as the fp32 shard already is;
- the reduce-scatter's input is one ``[N, S]`` buffer each member's gradient is cast and padded
  into (no per-member padded copy, no concatenation); on gloo it is exchanged by an all-to-all into
  a second buffer and the rows received summed (``BucketedGradReduce``; the two in half-size buckets,
  ``plan_reduce_buckets``), both freed once summed (``release_storage``);
- a batch's reduced gradient shards go once the batch is updated, before the next bucket's
  reduce-scatter input is built.

Flat layouts match the in-graph buckets: rank ``r``'s all-gather input is the concatenation of the
members' shards and its output ``[N, S]`` rank-major (each member's columns its padded storage);
reduce-scatter input is each member's padded gradient viewed ``[N, s_i]``, side by side along dim
1, so rank ``r`` receives the concatenation of its shards. Every rank builds the same buckets from
the same parameter order, so the collectives match across ranks.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zcompile.common.comm_volume import CollectiveRecord
from zcompile.common.process_group import (
    DataParallelGroup,
    all_gather_coalesced_into,
    all_gather_eager,
    all_reduce_eager,
    all_to_all_eager,
    holders_of,
    on_gloo,
    reduce_scatter_by_all_to_all,
    reduce_scatter_eager,
    wait_until_released,
)
from zcompile.passes.liveness import tensor_bytes
from zcompile.passes.reduce_scatter_lowering import release_storage, sum_received_rows
from zcompile.sharding.shards import ShardedParam


@dataclass
class BufferLedger:
    """The bytes of the optimizer's own buffers alive during a step, and their peak: the bucket
    inputs, the rows received, the reduced gradient shards, and gloo's staging of an all-gather in
    flight (gloo gathers into a flat buffer of its own, then copies out; NCCL writes in place). It is
    the part of a step's peak that ``optim.AdamW(bucket_mb=...)`` sizes, reported as
    ``step_report().memory["optimizer_buffers_bytes"]``. Counted where the code makes and drops the
    buffers, so it is the same in every run (the allocator's own peak moves with gloo's thread timing)."""

    live: int = 0
    peak: int = 0

    def take(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def give(self, nbytes: int) -> None:
        self.live -= nbytes

    def until_freed(self, tensor: torch.Tensor) -> torch.Tensor:
        """Counts ``tensor`` until it and every view of it are gone (a reduced bucket's shards live
        as views until their update)."""
        nbytes = tensor_bytes(tensor)
        self.take(nbytes)
        weakref.finalize(tensor, self.give, nbytes)
        return tensor


def plan_optimizer_buckets(
    members: list[ShardedParam], dtype_of: Callable[[ShardedParam], torch.dtype], bucket_bytes: int
) -> list[list[ShardedParam]]:
    """Consecutive ``members`` grouped while they share group, dtype (``dtype_of(member)``) and
    device, up to ``bucket_bytes`` of full parameter (a larger member is a bucket of its own).

    Full bytes, as the backend's ``bucket_mb`` counts them: a bucket's gathered buffer (and gloo's
    copies of it) then stays ``bucket_bytes`` whatever the number of ranks; counted in shard bytes it
    would grow N-fold with the number of ranks."""
    buckets: list[list[ShardedParam]] = []
    key = None
    size = 0
    for member in members:
        member_key = (member.group.name, dtype_of(member), member.shard.device)
        nbytes = member.padded_numel * dtype_of(member).itemsize
        if not buckets or member_key != key or size + nbytes > bucket_bytes:
            buckets.append([])
            key, size = member_key, 0
        buckets[-1].append(member)
        size += nbytes
    return buckets


def plan_reduce_buckets(
    members: list[ShardedParam], bucket_bytes: int, by_all_to_all: bool | None = None
) -> list[list[ShardedParam]]:
    """Stage 1's reduce-scatter buckets (in each member's ``grad_reduce_dtype``). Exchanged by an
    all-to-all (``by_all_to_all``; None: as ``process_group.reduce_scatter_by_all_to_all`` says for
    the members' group, gloo), a bucket needs a buffer of the rows received beside its input, so it
    holds half of ``bucket_bytes``: the two together then take what the input alone would. At full
    size the step's peak would grow by one bucket."""
    if by_all_to_all is None:
        by_all_to_all = bool(members) and reduce_scatter_by_all_to_all("auto", members[0].group)
    return plan_optimizer_buckets(members, _grad_reduce_dtype, bucket_bytes // 2 if by_all_to_all else bucket_bytes)


def replayed_step_buffer_peak(
    members: list[ShardedParam], bucket_bytes: int, whole_groups: bool = False, gloo: bool | None = None
) -> int:
    """The peak of the ledger (``BufferLedger``) of one optimizer step over ``members`` (in the step's
    order, one param group), replayed from the sizes alone in the order the step makes and drops its
    buffers: each stage-1 bucket's reduce started when its first member is updated, its reduced
    shards alive until the batch updating their last member is done, the next bucket's reduce
    started once this one is summed; each refresh bucket's all-gather launched when its members are
    updated, after the one in flight lands. ``whole_groups``: the step updates a param group in one
    batch (a GPU: ``ShardedOptimizer._multi_tensor_launch``), else a refresh bucket at a time. ``gloo``:
    the collectives run on gloo (its reduce as an all-to-all, its gathers staged), None: as the
    members' group says (a plan's fake world says nothing). For a plan, before any step ran;
    ``tests/test_optim_buckets.py`` holds it to the ledger of real steps."""
    reduced = [m for m in members if m.stage == 1 and m.group.world_size > 1]
    if gloo is None:
        gloo = bool(members) and on_gloo(members[0].group)
    by_all_to_all = gloo  # the optimizer's reduce, as process_group.reduce_scatter_by_all_to_all("auto") chooses
    reduce_buckets = plan_reduce_buckets(reduced, bucket_bytes, by_all_to_all)
    refreshed = [m for m in members if m.stage in (1, 2) and not m.updates_replicated_in_place]
    refresh_buckets = plan_optimizer_buckets(refreshed, lambda m: m.replicated_dtype, bucket_bytes)
    reduce_of, refresh_of = _bucket_index(reduce_buckets), _bucket_index(refresh_buckets)
    ledger = BufferLedger()
    summed: set[int] = set()
    rows_bytes: dict[int, int] = {}  # reduce bucket -> its [N, S] input's bytes
    out_bytes: dict[int, int] = {}  # reduce bucket -> its reduced shards' bytes
    views_left = {i: len(bucket) for i, bucket in enumerate(reduce_buckets)}
    waiting = [len(bucket) for bucket in refresh_buckets]
    in_flight = 0

    def start(index: int) -> None:
        if index >= len(reduce_buckets) or index in rows_bytes:  # past the last, or started
            return
        bucket = reduce_buckets[index]
        rows_bytes[index] = sum(m.padded_numel for m in bucket) * bucket[0].grad_reduce_dtype.itemsize
        out_bytes[index] = sum(m.shard_numel for m in bucket) * bucket[0].grad_reduce_dtype.itemsize
        ledger.take(2 * rows_bytes[index] if by_all_to_all else rows_bytes[index] + out_bytes[index])

    def reduce(index: int) -> None:  # BucketedGradReduce.grad at the bucket's first member asked for
        if index in summed:
            return
        start(index)
        if by_all_to_all:
            ledger.take(out_bytes[index])
            ledger.give(2 * rows_bytes[index])
        else:
            ledger.give(rows_bytes[index])
        summed.add(index)
        start(index + 1)

    def launch(bucket: list[ShardedParam]) -> None:  # BucketedParamRefresh._launch
        nonlocal in_flight
        ledger.give(in_flight)
        dtype = bucket[0].replicated_dtype
        outputs = sum(m.padded_numel for m in bucket) * dtype.itemsize
        shards = sum(m.shard_numel for m in bucket) * dtype.itemsize
        if all(m.padded_replicated() is not None for m in bucket):
            in_flight = outputs + shards if gloo else 0
        else:
            in_flight = (shards if len(bucket) > 1 else 0) + outputs * (2 if gloo else 1)
        ledger.take(in_flight)

    batches: list[list[ShardedParam]] = []
    key = None
    for member in members:
        member_key = None if whole_groups else refresh_of.get(id(member))
        if not batches or member_key != key:
            batches.append([])
        key = member_key
        batches[-1].append(member)
    for batch in batches:
        for member in batch:
            if id(member) in reduce_of:
                reduce(reduce_of[id(member)])
        for member in batch:
            index = refresh_of.get(id(member))
            if index is not None:
                waiting[index] -= 1
                if waiting[index] == 0 and refresh_buckets[index][0].group.world_size > 1:
                    launch(refresh_buckets[index])
        for member in batch:  # the batch's gradients (views of their reduced shards) go with it
            if id(member) in reduce_of:
                index = reduce_of[id(member)]
                views_left[index] -= 1
                if views_left[index] == 0:
                    ledger.give(out_bytes[index])
    ledger.give(in_flight)
    return ledger.peak


def _bucket_index(buckets: list[list[ShardedParam]]) -> dict[int, int]:
    """id(member) -> index of its bucket."""
    return {id(m): i for i, bucket in enumerate(buckets) for m in bucket}


def _record(
    kind: str, bucket: list[ShardedParam], dtype: torch.dtype, group: DataParallelGroup | None = None
) -> CollectiveRecord:
    group = group or bucket[0].group
    return CollectiveRecord(
        kind,
        sum(m.padded_numel for m in bucket),
        dtype,
        "optimizer",
        tuple(m.name for m in bucket),
        group.name or "",
        group.world_size,
    )


@dataclass
class BucketedGradReduce:
    """Stage 1: each member's averaged gradient shard, reduce-scattered one bucket ahead.

    A bucket's input is one ``[N, S]`` buffer that each member's gradient is written into (cast and
    padded in the copy: no per-member padded or cast copy, no concatenation). On gloo it is
    exchanged by an all-to-all and the ``N`` rows received are summed, as the graphs' reduce-scatters
    run there (``process_group.reduce_scatter_by_all_to_all``; gloo's own all-reduces a copy of its
    input: twice the bytes. An all-reduce of the buffer in place would save the bucket-sized buffer
    of rows received but takes longer); elsewhere reduce-scattered.
    ``free_full_grads``: each member's full gradient is dropped once it is in its bucket's input
    (``reduce_grads_onto_shards`` clears them anyway; the step keeps stage 1's full gradients)."""

    buckets: list[list[ShardedParam]]
    free_full_grads: bool = False
    records: list[CollectiveRecord] = field(default_factory=list)
    ledger: BufferLedger = field(default_factory=BufferLedger)
    _bucket_of: dict = field(default_factory=dict, init=False)
    # bucket index -> (work, (the [N, S] input, the rows received) when exchanged else None, the output
    # else None, the bytes of the input the backend holds until the wait)
    _pending: dict = field(default_factory=dict, init=False)
    _started: set = field(default_factory=set, init=False)
    _ready: dict = field(default_factory=dict, init=False)  # ShardedParam -> grad shard

    def __post_init__(self) -> None:
        self._bucket_of = _bucket_index(self.buckets)

    def grad(self, member: ShardedParam) -> torch.Tensor:
        """``member``'s reduced (summed) gradient shard; waits for its bucket, then starts the next one."""
        index = self._bucket_of[id(member)]
        if id(member) not in self._ready:
            self._start(index)
            work, rows, out, held = self._pending.pop(index)
            work.wait()
            del work  # the work holds the bucket's input (full size: ours, or the backend's copy) until released
            self.ledger.give(held)
            if rows is not None:  # exchanged: the sum of the rows received, and both [N, S] buffers go now
                sent, received = rows
                # as the graphs sum theirs (the same adds in rank order; faster than aten's outer sum)
                out = self.ledger.until_freed(sum_received_rows(received.view(-1), received.shape[0]))
                release_storage(sent)
                release_storage(received)
                self.ledger.give(tensor_bytes(rows))
            self._start(index + 1)  # moves while this bucket updates
            replicate = self.buckets[index][0].group.replicate
            if replicate is not None:  # hybrid sharding: the shard group's sum averaged over its replicas
                all_reduce_eager(out, replicate, dist.ReduceOp.SUM)
                out.div_(replicate.world_size)
                self.records.append(_record("all_reduce", self.buckets[index], out.dtype, replicate))
            offset = 0
            for m in self.buckets[index]:
                self._ready[id(m)] = out[offset : offset + m.shard_numel]
                offset += m.shard_numel
        return self._ready.pop(id(member))

    def _start(self, index: int) -> None:
        if index >= len(self.buckets) or index in self._started:
            return
        self._started.add(index)
        bucket = self.buckets[index]
        group, dtype = bucket[0].group, bucket[0].grad_reduce_dtype
        width = sum(m.shard_numel for m in bucket)
        rows = torch.empty(group.world_size, width, dtype=dtype, device=bucket[0].shard.device)
        # members with no padding (each row of theirs whole) in one foreach copy: one call from Python, not
        # one per member; unless each full gradient goes once copied, which must wait for its copy
        whole_rows, whole_grads = [], []
        offset = 0
        for m in bucket:
            columns, flat = rows[:, offset : offset + m.shard_numel], m.full_grad.detach().reshape(-1)
            if m.numel == rows.shape[0] * m.shard_numel and not self.free_full_grads:
                whole_rows.append(columns)
                whole_grads.append(flat.view(rows.shape[0], m.shard_numel))
            else:
                _write_rows(columns, flat, m.numel)
            offset += m.shard_numel
            if self.free_full_grads:
                m.clear_full_grad()
        if whole_rows:
            torch._foreach_copy_(whole_rows, whole_grads)  # cast in the copy, as copy_ does
        del whole_grads, columns, flat  # no gradient kept alive by a name of ours while the bucket moves
        if reduce_scatter_by_all_to_all("auto", group):  # gloo: as the graphs run it (option reduce_scatter)
            received = torch.empty_like(rows)
            work, out, held = all_to_all_eager(received, rows, group, async_op=True), None, 0
            rows = (rows, received)
            self.ledger.take(tensor_bytes(rows))
        else:  # the backend keeps the input alive while it needs it
            out = self.ledger.until_freed(torch.empty(width, dtype=dtype, device=rows.device))
            held = tensor_bytes(rows)
            self.ledger.take(held)
            work, rows = reduce_scatter_eager(out, rows.view(-1), group, async_op=True), None
        self._pending[index] = (work, rows, out, held)
        self.records.append(_record("reduce_scatter", bucket, dtype))


def _grad_reduce_dtype(member: ShardedParam) -> torch.dtype:
    return member.grad_reduce_dtype


def reduce_grads_onto_shards(
    members: list[ShardedParam], bucket_bytes: int, ledger: BufferLedger | None = None
) -> list[CollectiveRecord]:
    """Stage 1 ahead of the step: each member's local full gradient, reduce-scattered (bucketed) and
    averaged, added to ``shard.grad``; ``param.grad`` is freed. Returns the collectives issued.

    The member then looks like a stage-2 parameter, and ``step()`` updates from ``shard.grad``
    without reducing again. The average is taken as the step takes it (the fp32 sum times 1/N,
    as the fused update's ``grad_scale`` does), so an unclipped step is bitwise the same.
    """
    distributed = [m for m in members if m.group.world_size > 1]
    reducer = BucketedGradReduce(
        plan_reduce_buckets(distributed, bucket_bytes), free_full_grads=True, ledger=ledger or BufferLedger()
    )
    for member in members:
        world = member.group.world_size
        if world > 1:
            grad = reducer.grad(member).to(torch.float32) * (1.0 / world)
        else:
            # a tensor of its own: padded_flat may return a view of param.grad, and zero_grad's
            # in-place detach_ refuses views
            grad = member.padded_flat(member.full_grad, torch.float32).clone()
        if member.shard_grad is None:
            member.shard_grad = grad
        else:  # a backward after an earlier clip, or zero_grad(set_to_none=False)
            member.shard_grad.add_(grad)
        member.clear_full_grad()
    return reducer.records


@dataclass
class BucketedParamRefresh:
    """Stages 1 and 2: updated shards all-gathered into the replicated parameters, per bucket."""

    buckets: list[list[ShardedParam]]
    records: list[CollectiveRecord] = field(default_factory=list)
    ledger: BufferLedger = field(default_factory=BufferLedger)
    _bucket_of: dict = field(default_factory=dict, init=False)
    _updated: dict = field(default_factory=dict, init=False)  # id(member) -> shard in the param dtype
    _waiting: list = field(default_factory=list, init=False)  # per bucket: members not updated yet
    # (bucket, work, gathered, bytes held until landed, the tensors handed to the collective, their holders then)
    _in_flight: tuple | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._bucket_of = _bucket_index(self.buckets)
        self._waiting = [len(bucket) for bucket in self.buckets]

    def bucket_of(self, member: ShardedParam) -> int | None:
        """The index of ``member``'s bucket; None when it is not refreshed here (stage 3)."""
        return self._bucket_of.get(id(member))

    def updated(self, member: ShardedParam, shard_in_param_dtype: torch.Tensor | None) -> None:
        """``member``'s shard is final (``shard_in_param_dtype``: already cast, or None to cast here)."""
        shard = (
            shard_in_param_dtype
            if shard_in_param_dtype is not None
            else member.shard.detach().to(member.replicated_dtype)
        )
        index = self._bucket_of[id(member)]
        if id(member) not in self._updated:
            self._waiting[index] -= 1  # a count, not a scan of the bucket: linear in the parameters
        self._updated[id(member)] = shard
        if self._waiting[index] == 0:
            self._launch(self.buckets[index])

    def finish(self) -> None:
        """Waits for the last bucket in flight and writes it into its parameters."""
        self._land()

    def _launch(self, bucket: list[ShardedParam]) -> None:
        shards = [self._updated.pop(id(m)) for m in bucket]
        group = bucket[0].group
        if group.world_size == 1:
            for m, shard in zip(bucket, shards):
                replicated = m.replicated.view(-1)
                if shard.data_ptr() != replicated.data_ptr():  # fp32 stage 1/2: the shard is that storage
                    replicated.copy_(shard[: m.numel])
            return
        self._land()  # the previous bucket moved while this one was being updated; its buffers go first
        outputs = [m.padded_replicated() for m in bucket]
        if all(out is not None for out in outputs):  # straight into the parameters (or replicas)
            handed = [*outputs, *shards]
            holders = holders_of(handed)
            work = all_gather_coalesced_into(outputs, shards, group)
            self.records.append(_record("all_gather", bucket, shards[0].dtype))
            # gloo's flat buffers: the inputs concatenated, and the output it copies out of
            staged = tensor_bytes(outputs) + tensor_bytes(shards) if on_gloo(group) else 0
            self.ledger.take(staged)
            self._in_flight = (bucket, work, None, staged, handed, holders)
            return
        flat = torch.cat(shards) if len(shards) > 1 else shards[0]
        gathered = torch.empty(flat.numel() * group.world_size, dtype=flat.dtype, device=flat.device)
        handed = [gathered, flat]
        holders = holders_of(handed)
        work = all_gather_eager(gathered, flat, group, async_op=True)
        self.records.append(_record("all_gather", bucket, flat.dtype))
        held = (tensor_bytes(flat) if len(shards) > 1 else 0) + tensor_bytes(gathered) * (2 if on_gloo(group) else 1)
        self.ledger.take(held)
        self._in_flight = (bucket, work, gathered, held, handed, holders)

    def _land(self) -> None:
        if self._in_flight is None:
            return
        bucket, work, gathered, held, handed, holders = self._in_flight
        self._in_flight = None
        work.wait()
        del work
        if on_gloo(bucket[0].group):  # ours last: never freed on gloo's thread (process_group)
            wait_until_released(handed, holders)
        if gathered is None:  # landed in the parameters' own storages
            self.ledger.give(held)
            return
        rows = gathered.view(bucket[0].group.world_size, -1)
        offset = 0
        for m in bucket:
            copy_rows(m.replicated.view(-1), rows[:, offset : offset + m.shard_numel], m.numel)
            offset += m.shard_numel
        release_storage(gathered)
        self.ledger.give(held)


def _write_rows(rows: torch.Tensor, flat: torch.Tensor, numel: int) -> None:
    """``rows`` (``[N, s]``, strided: one member's columns of a bucket) = ``flat[:numel]`` zero-padded to
    ``N * s`` elements and read rank-major, cast in the copy: ``copy_rows`` the other way."""
    width = rows.shape[1]
    whole = min(numel // width, rows.shape[0]) if width else 0
    if whole:
        rows[:whole].copy_(flat[: whole * width].view(whole, width))
    if whole < rows.shape[0]:
        rest = numel - whole * width
        rows[whole, :rest].copy_(flat[whole * width : numel])
        rows[whole, rest:].zero_()
        rows[whole + 1 :].zero_()


def copy_rows(dst: torch.Tensor, rows: torch.Tensor, numel: int) -> None:
    """``dst[:numel]`` = ``rows`` (``[N, s]``, strided: one member's columns of a bucket) read rank-major,
    with no contiguous copy of them first (``reshape(-1)`` would make one, the member's full size): whole
    rows into a ``[k, s]`` view of ``dst``, then the last rank's partial row (the padding left out)."""
    width = rows.shape[1]
    whole = min(numel // width, rows.shape[0]) if width else 0
    if whole:
        dst[: whole * width].view(whole, width).copy_(rows[:whole])
    if whole * width < numel:
        dst[whole * width : numel].copy_(rows[whole, : numel - whole * width])
