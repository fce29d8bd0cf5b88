"""Gradient clipping of zcompile parameters: the global norm of the averaged gradient, and its clip.

What is clipped is the gradient every rank's update uses: the gradient averaged over the ranks,
which is what DDP, or one process on the global batch, sees. Where it lives depends on the stage:

- stages 2 and 3: on ``shard.grad``, averaged by the backward graph's reduce-scatter; the ranks'
  shards are disjoint (zero padding past ``numel`` on the last). So norm^p = the sum over ranks of
  each rank's sum of ``|g|^p`` over its shards (the max for the inf-norm): one scalar all-reduce
  (for the inf-norm, two elements: the max and a NaN flag, as a backend's MAX may drop a NaN).
- stage 1, and parameters trained outside any graph (given stage-1 shards, as the optimizer
  does): ``param.grad`` is this rank's local, unreduced gradient; the averaged one only exists
  after the step's reduce-scatter. Clipping performs that reduce-scatter early
  (``optim.buckets.reduce_grads_onto_shards``): the averaged shard lands on ``shard.grad`` and
  ``param.grad`` is freed, so the parameter looks like a stage-2 one and ``step()`` does not
  reduce it again. The same elements cross the ranks as without clipping; what is lost is the
  overlap of those reduce-scatters with the update (the norm needs every gradient first).
  All-reducing the full gradients instead would move 2Ψ more.

The norm is each shard's fp32 norm, their p-th powers summed in float64 across shards and ranks,
returned in fp32 before clipping. The clip is torch's: coefficient ``max_norm / (norm + 1e-6)``
clamped to 1, multiplied into the gradients in place.

The torch functions that reach here are patched in ``zcompile.routes.clip_grad``.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from zcompile.common.comm_volume import CollectiveRecord
from zcompile.common.process_group import DataParallelGroup, all_reduce_eager
from zcompile.optim.buckets import reduce_grads_onto_shards
from zcompile.sharding.shards import ShardedParam

log = logging.getLogger(__name__)

# bucket of the early stage-1 reduce-scatter on the torch.nn.utils route (the optimizer's default
# bucket_mb; the bucket layout changes which collective moves an element, not its sum)
TORCH_ROUTE_BUCKET_BYTES = 4 * 2**20


def clip_grad_norm_of_shards(
    members: list[ShardedParam],
    max_norm: float,
    norm_type: float = 2.0,
    bucket_bytes: int = TORCH_ROUTE_BUCKET_BYTES,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clips the averaged gradient of ``members`` to a global ``norm_type``-norm of ``max_norm``.

    Collective: every rank of the members' group calls it with the same members. Returns the
    total norm before clipping (fp32, 0-dim, on the shards' device).
    """
    norm_type = _check_norm_type(norm_type)
    with_grad, records = averaged_grad_shards(members, bucket_bytes)
    total, record = global_grad_norm(with_grad, norm_type, _common_group(members), _device_of(members))
    records += [record] if record is not None else []
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"zcompile: the total norm of order {norm_type} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    clip_coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)  # torch's rule, in fp32
    for member in with_grad:
        member.shard_grad.detach().mul_(clip_coef.to(member.shard_grad.device))
    keep_records_for_step(with_grad, records)
    return total


def clip_grad_value_of_shards(
    members: list[ShardedParam], clip_value: float, bucket_bytes: int = TORCH_ROUTE_BUCKET_BYTES
) -> None:
    """Clamps the averaged gradient of ``members`` to ``[-clip_value, clip_value]`` (collective at stage 1)."""
    with_grad, records = averaged_grad_shards(members, bucket_bytes)
    for member in with_grad:
        member.shard_grad.detach().clamp_(min=-float(clip_value), max=float(clip_value))
    keep_records_for_step(with_grad, records)


def averaged_grad_shards(members: list[ShardedParam], bucket_bytes: int) -> tuple[list[ShardedParam], list]:
    """The members that have a gradient, each with its averaged gradient shard on ``shard.grad``
    (stage 1 reduce-scattered now), and the collectives that issued."""
    _common_group(members)  # before any collective
    early = [m for m in members if m.full_grad is not None]  # stage 1, or eager code at stages 2 and 3
    records = reduce_grads_onto_shards(early, bucket_bytes)
    return [m for m in members if m.shard_grad is not None], records


def global_grad_norm(
    members: list[ShardedParam], norm_type: float, group: DataParallelGroup | None, device: torch.device
) -> tuple[torch.Tensor, CollectiveRecord | None]:
    """The ``norm_type``-norm of every rank's gradient shards viewed as one vector (fp32), and the
    record of the scalar all-reduce that made it global (None in a world of one)."""
    if group is not None and group.tensor_parallel is not None:
        # a tensor-parallel model: one reduction over every rank (dp x tp) sums the pieces split over
        # mesh["tp"] across it; the replicated weights' terms, the same on every tp rank, count 1/tp each;
        # with hybrid sharding every term is on each replica, 1/replicas each
        replicas = group.replicas
        share = 1.0 / (group.tensor_parallel.world_size * replicas)
        weights = [1.0 / replicas if m.split_over_tensor_parallel else share for m in members]
        local, record = _norm_over_group(members, norm_type, DataParallelGroup.resolve(None), device, weights)
    else:
        local, record = _norm_over_group(members, norm_type, group, device)
    total = local if math.isinf(norm_type) else local.pow(1.0 / norm_type)
    return total.to(torch.float32), record


def _norm_over_group(
    members: list[ShardedParam],
    norm_type: float,
    group: DataParallelGroup | None,
    device: torch.device,
    weights: list[float] | None = None,
) -> tuple[torch.Tensor, CollectiveRecord | None]:
    """The sum over ``group``'s ranks of the members' gradient shards' norms to the power
    ``norm_type`` (float64; each member's term times its ``weights`` entry), their max for the
    inf-norm; and the record of the all-reduce."""
    norms = [
        torch.linalg.vector_norm(m.shard_grad.detach(), norm_type, dtype=torch.float32) for m in members
    ]  # fp32, like torch's
    local = torch.zeros((), dtype=torch.float64, device=device)
    if norms:
        stacked = torch.stack([n.to(device) for n in norms]).to(torch.float64)
        if math.isinf(norm_type):
            local = stacked.max()
        else:
            terms = stacked.pow(norm_type)
            local = (
                (terms * torch.tensor(weights, dtype=torch.float64, device=device)).sum() if weights else terms.sum()
            )
    record = None
    if group is not None and group.world_size > 1 and math.isinf(norm_type):
        local = _all_reduce_max_keeping_nan(local, group)
        record = CollectiveRecord("all_reduce", 2, torch.float64, "optimizer", (), group.name or "", group.world_size)
    elif group is not None and group.world_size > 1:
        all_reduce_eager(local, group, dist.ReduceOp.SUM)  # a NaN or inf term makes the sum NaN or inf
        record = CollectiveRecord("all_reduce", 1, torch.float64, "optimizer", (), group.name or "", group.world_size)
    return local, record


def _all_reduce_max_keeping_nan(value: torch.Tensor, group: DataParallelGroup) -> torch.Tensor:
    """The MAX over ranks of the scalar ``value``, NaN when any rank's is NaN (collective).

    gloo's MAX drops a NaN that is not the first operand (``max(1, nan)`` is 1), so a NaN from any
    rank but the first would vanish. The inf-norm of a NaN gradient
    would then depend on which rank held it, and ``skip_nonfinite``, which decides from this norm
    when the step clips, would update with it. A NaN flag travels in the same all-reduce.
    """
    packed = torch.stack([value, torch.isnan(value).to(value.dtype)])
    all_reduce_eager(packed, group, dist.ReduceOp.MAX)
    return torch.where(packed[1] > 0, torch.full_like(packed[0], math.nan), packed[0])


def _check_norm_type(norm_type: float) -> float:
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise ValueError(f"zcompile: gradient clipping: norm_type must be > 0 or inf, got {norm_type}")
    return norm_type


def _common_group(members: list[ShardedParam]) -> DataParallelGroup | None:
    groups = {m.group.name: m.group for m in members}
    if len(groups) > 1:
        raise ValueError(
            f"zcompile: gradient clipping: the parameters are sharded over different process groups "
            f"({sorted(map(str, groups))}); one norm cannot span them. Clip each group's parameters separately."
        )
    return next(iter(groups.values()), None)


def _device_of(members: list[ShardedParam]) -> torch.device:
    return members[0].shard.device if members else torch.device("cpu")


def keep_records_for_step(members: list[ShardedParam], records: list) -> None:
    """The optimizer's next step reports these collectives, issued ahead of it (by clipping, or by
    ``gathered(grads=True)``); it collects them from the members with a gradient (with none, nothing
    was reduced and a clip's norm all-reduce goes unreported)."""
    if members and records:
        members[0].pre_step_records += records
