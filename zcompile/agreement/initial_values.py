"""Every rank starts from the same weights: a digest of each parameter's values when it is sharded,
compared at the first step (``zcompile.eager.sync.sync_module_states`` takes rank 0's).

Why: a rank's shard is cut from its own copy of the parameter. Ranks that built the model with
different weights (no common seed, or a checkpoint loaded on rank 0 only, counting on DDP, which
broadcasts rank 0's parameters when it wraps the model) then train a mix of their weights: rank 0's
first slice, rank 1's second, with no word.

How: ``value_digest`` is the sum of the values' bit patterns as integers, exact and independent of
the order of the sum (so the same on any device and thread count); ``zcompile.sharding.shards`` takes
it when it shards a parameter, before the full value is freed (and again after ``p.data = values``).
The digests are compared through the store, no collective: by the compile that sharded them when
every rank compiles it (a training graph, or one with collectives: stage 3), frozen parameters
included, else by the next step's agreement (``zcompile.agreement.step_agreement``: the optimizer's
parameters), before anything is updated. Different weights are a ``RankDivergenceError`` on every
rank naming the parameters and the fixes. A graph compiled under ``no_grad`` without collectives
(stages 1-2: evaluation, maybe on one rank alone) compares nothing; its parameters' digests wait
for the next training compile or step.
"""

from __future__ import annotations

import torch

from zcompile.agreement.abort_note import RankDivergenceError
from zcompile.agreement.store_exchange import exchange_on_store
from zcompile.common.process_group import DataParallelGroup

_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def value_digest(tensor: torch.Tensor) -> int:
    """The sum of ``tensor``'s values' bit patterns, as a Python int (exact; module doc)."""
    flat = tensor.detach().reshape(-1)
    return int(flat.view(_BITS[flat.element_size()]).sum(dtype=torch.int64))


def pending_digests(members: list, positions: list[int] | None = None) -> dict[str, int]:
    """``digest_key`` -> digest of the members sharded since the ranks last compared them;
    ``positions``: each member's place among the parameters the ranks list alike (default: among ``members``)."""
    positions = range(len(members)) if positions is None else positions
    return {digest_key(at, m): m.initial_digest for at, m in zip(positions, members) if m.initial_digest is not None}


def digest_key(index: int, member) -> str:
    """A member's key among ``members``: its position and name. The name alone is not unique: blocks
    compiled one by one (``block.compile()``) name their weights from the block (``attn.qkv.weight``
    for every layer), and a dict by name would keep one layer's digest for all. The ranks list the same
    members in the same order (the optimizer's parameters, or one graph's), so positions compare."""
    return f"#{index} {member.name}"


def differing_parameters(per_rank: list[dict[str, int]], rank: int) -> list[str]:
    """The parameters every rank sharded whose digest on some rank differs from ``rank``'s. One that
    some rank lacks is not a difference of weights but of graphs (a branch per rank), which the
    collectives' and the step's other checks name."""
    mine = per_rank[rank]
    return [
        name
        for name in mine
        if all(name in digests for digests in per_rank) and any(digests[name] != mine[name] for digests in per_rank)
    ]


def different_weights_message(what: str, names: list[str]) -> str:
    """The error for ranks whose parameters were sharded from different values (module doc)."""
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    count = "1 parameter was" if len(names) == 1 else f"{len(names)} parameters were"
    return (
        f"zcompile: {what}: the ranks started from different weights: {count} sharded from values that differ "
        f"between ranks ({shown}), so the ranks would train a mix of their weights. Build the model the same way "
        "on every rank (torch.manual_seed(same seed) before creating it) and load checkpoints on every rank, or "
        "take rank 0's with zcompile.sync_module_states(model) before the first compiled call (as DDP does). "
        "Other causes: eager code that wrote the weights in place before they were sharded (a frame Dynamo ran "
        "eagerly: see the warnings logged before this), or blocks compiled one by one whose first calls ran "
        "different layers per rank (LayerDrop drawn per rank)."
    )


def check_same_initial_values(members: list, group: DataParallelGroup, timeout_s: float, what: str) -> None:
    """At a compile every rank joins (module doc): the digests of its parameters not compared yet are
    compared now, frozen ones included (a step compares only the optimizer's); raises
    ``RankDivergenceError`` on every rank when they differ."""
    pending = pending_digests(members)
    if group.world_size == 1 or not pending:
        return
    per_rank = exchange_on_store(
        pending, group, timeout_s, "values", f"zcompile: {what}", "Give every rank the same weights."
    )
    if names := differing_parameters(per_rank, group.rank):
        raise RankDivergenceError(different_weights_message(what, names))
    for index, member in enumerate(members):
        if all(digest_key(index, member) in digests for digests in per_rank):  # compared
            member.initial_digest = None
