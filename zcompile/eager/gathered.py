"""``gathered(model)``: the full parameters of a sharded model, materialized for eager use."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from zcompile.agreement.store_exchange import agree_on_store, names_digest
from zcompile.common.process_group import all_gather_eager, gather_to_first_eager
from zcompile.eager import gathered_grads as full_grads
from zcompile.optim.buckets import copy_rows, plan_optimizer_buckets
from zcompile.sharding.shards import ShardedParam, shard_of

DEFAULT_TIMEOUT_S = 60.0
GATHER_BUCKET_BYTES = 4 * 2**20  # full bytes per all-gather on entry, as the optimizer's default bucket_mb


def _sharded_params(model: torch.nn.Module) -> list[ShardedParam]:
    """Every sharded parameter of ``model``, each once (tied weights)."""
    return [s for s in dict.fromkeys(map(shard_of, model.parameters())) if s is not None]


def _freed_shards(model: torch.nn.Module) -> list[ShardedParam]:
    """The parameters whose full value exists on no rank at rest: stage 3's, and stage 1's and 2's
    kept as a low-precision replica (``param_dtype``)."""
    return [s for s in _sharded_params(model) if s.stage == 3 or s.replica is not None]


@contextlib.contextmanager
def gathered(
    model: torch.nn.Module,
    writeback: bool | None = None,
    rank0_only: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    grads: bool = False,
) -> Iterator[torch.nn.Module]:
    """Materializes the full parameters of ``model`` inside the block and frees them after.

    Use it for evaluation, ``generate()``, export or inspection in eager mode (call the original
    module, ``compiled._orig_mod``, or read ``state_dict()``). Every rank of the group must enter
    it: the parameters are gathered. Before any collective the ranks agree through the store, so
    a rank that enters alone (``if rank == 0: with gathered(model): ...``) gets a
    ``RankDivergenceError`` naming the missing ranks within ``timeout_s`` instead of a hang.

    ``writeback`` (default True, False with ``rank0_only``): changes made to the full parameters
    inside the block are copied back into this rank's shards on exit. ``rank0_only=True`` gathers to
    rank 0 only (every rank still enters; the others keep their parameters sharded): saving or
    exporting from rank 0 without a full model on every rank. It cannot write back (rank 0's
    changes would have to be scattered); ``writeback=True`` with it is refused.

    Parameters of stages 1 and 2 are full (fp32) unless ``param_dtype`` keeps them as low-precision
    replicas: the fp32 values are then gathered from the master shards like stage 3's, and a write-back
    refreshes the replicas too. For full ones this is a no-op (no agreement needed).
    A parameter already gathered by an enclosing ``gathered`` is left to it.

    ``grads=True``: inside, each sharded parameter with a gradient also holds in ``.grad`` the full
    gradient averaged over ranks, what DDP leaves there (between backward and ``optimizer.step()``
    zcompile keeps it on the shards at stages 2 and 3, and stage 1's ``.grad`` is the local,
    unreduced one); with ``writeback`` what ``.grad`` holds on exit, edits included, is what the
    step applies (``zcompile.eager.gathered_grads``). Not with ``rank0_only``.
    """
    if rank0_only and writeback:
        raise ValueError(
            "zcompile.gathered: writeback=True with rank0_only=True is not supported (rank 0's changes "
            "would have to be scattered to every rank); use writeback=False, or rank0_only=False"
        )
    if rank0_only and grads:
        raise ValueError(
            "zcompile.gathered: grads=True with rank0_only=True is not supported (the averaged gradients "
            "are gathered on every rank); use rank0_only=False and read them on rank 0"
        )
    writeback = not rank0_only if writeback is None else writeback
    shards = [s for s in _freed_shards(model) if s.is_freed]
    grad_members = _sharded_params(model) if grads else []  # every sharded parameter, freed or not
    if shards or (grad_members and grad_members[0].group.world_size > 1):
        _agree_on_entry(grad_members or shards, rank0_only, writeback, timeout_s, full_grads.grad_layout(grad_members))
    with torch.no_grad():
        _materialize(shards, rank0_only)
        with_grad = full_grads.enter(grad_members)
    try:
        yield model
    finally:
        with torch.no_grad():
            full_grads.leave(with_grad, writeback)
            for sharded in shards:
                if writeback:
                    sharded.write_shard_from_full()
                sharded.free_full()


def _materialize(shards: list[ShardedParam], rank0_only: bool) -> None:
    """Every rank's shards of ``shards`` gathered into their parameters (collective), a bucket of
    ``GATHER_BUCKET_BYTES`` per collective (``gather_into_full``): one blocking all-gather per
    parameter would make entering the block latency-bound for a model of many small weights.
    ``rank0_only``: gathered to rank 0, the other
    ranks' parameters left freed."""
    receives = [s for s in shards if not rank0_only or s.group.rank == 0]
    for sharded in receives:
        sharded.allocate_full()
    receiving = set(map(id, receives))
    gather_into_full(
        [
            (s.param.data.view(-1) if id(s) in receiving else None, s.shard.detach().to(s.param.dtype), s)
            for s in shards
        ],
        to_first=rank0_only,
    )


def gather_into_full(
    items: list[tuple[torch.Tensor | None, torch.Tensor, ShardedParam]], to_first: bool = False
) -> None:
    """For each ``(full, chunk, layout)``: ``full`` (flat, ``layout.numel`` elements) = every rank's
    ``chunk`` (``layout.shard_numel`` elements, padded past what the rank owns) in rank order
    (collective), each layout once. The chunks side by side, in the optimizer's buckets of ``GATHER_BUCKET_BYTES``
    (``optim.buckets.plan_optimizer_buckets``), one collective each, every member's rows copied out:
    ``gathered``'s parameters, ``full_state_dict``'s, and a weight averaged toward a replica's masters
    (``zcompile.eager.weight_average``). ``full`` may be on another device than the chunks (the CPU), or None
    on a rank that only takes part. ``to_first``: gathered to the group's rank 0 only; the other ranks
    send, and their ``full`` is None."""
    by_layout = {id(layout): (full, chunk) for full, chunk, layout in items}
    if len(by_layout) != len(items):
        raise ValueError("zcompile: gather_into_full takes each layout once (one full tensor per parameter)")
    buckets = plan_optimizer_buckets(
        [layout for _, _, layout in items], lambda layout: by_layout[id(layout)][1].dtype, GATHER_BUCKET_BYTES
    )
    for bucket in buckets:
        group = bucket[0].group
        flat = torch.cat([by_layout[id(layout)][1] for layout in bucket])
        if to_first and group.rank != 0:
            gather_to_first_eager(None, flat, group)
            continue
        if group.world_size > 1:
            gathered = torch.empty(flat.numel() * group.world_size, dtype=flat.dtype, device=flat.device)
            (gather_to_first_eager if to_first else all_gather_eager)(gathered, flat, group)
        else:
            gathered = flat
        rows = gathered.view(group.world_size, -1)
        offset = 0
        for layout in bucket:
            full = by_layout[id(layout)][0]
            if full is not None:
                copy_rows(full, rows[:, offset : offset + layout.shard_numel], layout.numel)
            offset += layout.shard_numel


def _agree_on_entry(
    shards: list[ShardedParam], rank0_only: bool, writeback: bool, timeout_s: float, grad_layout: list[bool]
) -> None:
    """Every rank enters with the same parameters (``shards``: those it gathers or reduces) and
    arguments (and, with ``grads``, gradients on the same parameters: they are reduced together), or
    every rank that came raises."""
    group = shards[0].group
    layout = "".join("1" if has else "0" for has in grad_layout)
    # which parameters, not only how many: ranks whose graphs reached different ones (a branch on
    # the rank) would pair one parameter's collective with another's of the same size
    names = names_digest(s.name for s in shards)
    call = [len(shards), sum(s.numel for s in shards), names, rank0_only, writeback, layout]
    agree_on_store(
        call,
        group,
        timeout_s,
        "gathered",
        "zcompile.gathered(model)",
        "Every rank must enter `with zcompile.gathered(model):` (it gathers the parameters with collectives); "
        "to save or export from one rank, enter it on every rank with rank0_only=True and act on rank 0 inside.",
        lambda calls: (
            "zcompile.gathered(model): the ranks entered it with different models or arguments "
            f"([parameters, elements, their names' digest, rank0_only, writeback, which parameters have gradients] "
            f"per rank: {dict(enumerate(calls))}); enter it on every rank with the same model and arguments (with "
            "grads=True, after a backward on every rank that reached the same parameters)."
        ),
    )
