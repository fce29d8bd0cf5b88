"""The ranks agree, before the collectives of ``optimizer.step()`` or of gradient clipping, that
every one of them got there from the same training step.

Why: code between the compiled graphs can branch per rank. ``if not torch.isfinite(loss):
continue`` on one rank skips its step; the other ranks' step then meets that rank's next
forward/backward in the collectives: a hang until the process group's timeout at stage 2 and,
where the collectives happen to line up (stage 1), ranks that silently train on different steps.

How: each compiled call with gradients enabled counts one on each of its parameters' shards
(``ShardSwap`` in ``zcompile.backend``). Before its first collective, a step (or a clip) exchanges
through the store its call number and the training calls its parameters saw since the last
agreement. At stage 3 the forward itself starts with all-gathers, so a compiled stage-3 call also
takes a turn on the same sequence (``agree_on_call``): a rank that skipped its step meets the
others' step there. The first call after an agreed step needs no turn of its own (every rank left
that agreement together and goes on to it; ``AgreedStep``, ``ShardSwap.first_call_since_agreed_step``):
a rank that went elsewhere instead meets the others at their next agreement, or, waiting in a
collective, gets the note of the rank that timed out there. Only the first: the calls after it are
turns of their own, whatever their parameters (a graph run once per layer meets every layer). A rank
that does not come within the timeout, or comes from a different number of training calls, from
calls on other parameters (one graph run on different layers per rank: LayerDrop), or with gradients
on other parameters (the step's buckets are planned from those that have one), makes every rank that
came raise ``RankDivergenceError`` saying which. Parameters are compared by their position among the
optimizer's (or the clipped) parameters, not their names: blocks compiled one by one name their
weights from the block (``_positions_among``). Evaluation
under ``torch.no_grad()`` is not counted, so evaluating on rank 0 only stays allowed. The cost is
one store exchange per step (and per further stage-3 compiled call; see the README's fault table); the
step's exchange also carries each rank's "are my gradients finite?" for ``skip_nonfinite``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch

from zcompile.agreement.abort_note import RankDivergenceError
from zcompile.agreement.fixes import STEP_FIX
from zcompile.agreement.fixes import choose as choose_fix
from zcompile.agreement.initial_values import different_weights_message, differing_parameters, pending_digests
from zcompile.agreement.store_exchange import exchange_on_store, exchanges_made
from zcompile.common.process_group import DataParallelGroup
from zcompile.sharding.buffer_sync import changed_buffers_summary
from zcompile.sharding.shards import ShardedParam, shard_of

DEFAULT_TIMEOUT_S = 60.0


@dataclass(eq=False)
class AgreedStep:
    """A step (or clip) the ranks agreed on, shared by its members (``ShardedParam.agreed_step``).

    The first compiled call with collectives after it needs no agreement of its own: every rank left
    the agreement together and goes to that call next. Any later call does, whichever its parameters:
    blocks compiled one by one are one graph called once per layer, so a rank that skipped a layer
    makes the next layer's call, whose collectives would pair with another rank's other call (a gloo
    abort where the sizes differ, one layer's weights gathered with another's where they match)."""

    # how many agreements this rank had made when the ranks agreed on it (``store_exchange.exchanges_made``):
    # only the latest agreement's first call is where every rank goes next
    sequence: int = 0
    free_call_taken: bool = False


def take_free_call(shards: list) -> bool:
    """Whether a compiled call with collectives over ``shards`` is the first since the ranks agreed on a
    step whose members they all are (``AgreedStep``), that agreement the rank's latest; marks that
    step's free call taken either way.

    The latest: with two models stepped in turn (a GAN's discriminator, then its generator), the
    model stepped first would otherwise keep its free call past the other's step, and a rank that
    skipped its forward would meet, without an agreement, the others' call of it with its call of the
    other model: their collectives would pair, ending in gloo's "Connection closed by peer" with no
    word of why. Reading the count costs a store request at the step and one at the call."""
    steps = {id(s.agreed_step): s.agreed_step for s in shards if s is not None and s.agreed_step is not None}
    step = next(iter(steps.values()), None)
    free = (
        len(steps) == 1
        and all(s is not None and s.agreed_step is not None for s in shards)
        and not step.free_call_taken
        and exchanges_made(shards[0].group, "step") == step.sequence
    )
    for taken in steps.values():
        taken.free_call_taken = True
    return free


def agree_on_call(group: DataParallelGroup, what: str, timeout_s: float) -> None:
    """Before a compiled call that starts with collectives (a stage-3 forward): every rank is making
    the same call. On the same sequence as the steps, so a rank that skipped its backward and step
    (and is already in its next forward) meets the others' ``optimizer.step()`` here and every rank
    raises at once, before a collective could pair a forward's all-gather with a backward's."""
    # a rank at a step's agreement sent the step's fields: its "what" comes first there too
    arrivals = [
        other[0] for other in exchange_on_store([what, None], group, timeout_s, "step", f"zcompile: {what}", STEP_FIX)
    ]
    if any(arrival != what for arrival in arrivals):
        raise RankDivergenceError(
            f"zcompile: the ranks are at different points of training (per rank: {dict(enumerate(arrivals))}); "
            f"their collectives would not match. {choose_fix(STEP_FIX, what, arrivals)}"
        )


def _positions_among(members: list[ShardedParam], params) -> list[int]:
    """Each member's position among ``params`` (the optimizer's parameters in order, or the clipped
    ones): what identifies a parameter across ranks, which list the same parameters in the same order.
    Not its place among ``members``: a weight a rank never ran has no shard there and moves the others
    up, nor its name (``digest_key``)."""
    first: dict[int, int] = {}
    for index, param in enumerate(params):
        sharded = shard_of(param)
        if sharded is not None:
            first.setdefault(id(sharded), index)
    return [first[id(member)] for member in members]


def agree_before_step(
    members: list[ShardedParam],
    params,
    what: str,
    timeout_s: float | None,
    grads_finite: bool | None = None,
    hyperparameters: list[dict] | None = None,
) -> bool | None:
    """Raises ``RankDivergenceError`` unless every rank of the members' group reaches ``what`` from
    the same number of training calls (module docstring); ``timeout_s=None`` skips the check.

    ``grads_finite``: whether this rank's gradients are finite, carried in the same exchange so that
    ``skip_nonfinite`` needs no collective of its own. Returns whether they are finite on every
    rank; None when not asked, or when nothing was exchanged (check off, one rank).
    ``hyperparameters``: the optimizer's param groups without their parameters (``optimizer.step()``):
    a learning rate that differs by rank (a scheduler stepped on some ranks only, ``ReduceLROnPlateau``
    fed each rank's own metric) would update each rank's shard with its own, silently. ``params``: the
    parameters ``members`` are the shards of, in the caller's order (the optimizer's, or the clipped ones),
    which names each member by its position there (``_positions_among``)."""
    if timeout_s is None or not members or members[0].group.world_size == 1:
        return None
    positions = _positions_among(members, params)
    calls_per_member = [m.training_calls for m in members]
    for member in members:
        member.training_calls = 0
    arrival = f"{what} after {sum(calls_per_member)} training calls"
    # the calls that paired collectives over these weights (stages 2-3; stage 1's pair only at the step, by
    # the gradients compared below), by position, not name: blocks compiled one by one share their names
    called = _positions_summary(
        [(at, calls) for at, calls, m in zip(positions, calls_per_member, members) if calls and m.stage != 1]
    )
    layout = replicated_layout(members)
    with_grads = [at for at, m in zip(positions, members) if m.shard_grad is not None or m.has_full_grad]
    grads = f"{len(with_grads)} parameters ({_digest(with_grads)})"
    buffers = changed_buffers_summary(members)
    replaced = sorted(m.name for m in members if m.storage_replaced)
    for member in members:
        member.storage_replaced = False
    initial = pending_digests(
        members, positions
    )  # the values each parameter was sharded from (zcompile.agreement.initial_values)
    mine = {
        "arrival": arrival,
        "called": called,
        "layout": layout,
        "grads": grads,
        "finite": grads_finite,
        "buffers": buffers,
        "replaced": _some(replaced),
        "initial": initial,
        "hyperparameters": hyperparameters,
    }
    arrivals = exchange_on_store(
        list(mine.values()), members[0].group, timeout_s, "step", f"zcompile: {what}", STEP_FIX
    )

    def differs(field: str) -> dict[int, Any] | None:
        """Every rank's ``field`` when some rank's differs from this rank's, else None."""
        index = list(mine).index(field)
        per_rank = {rank: values[index] for rank, values in enumerate(arrivals)}
        return per_rank if any(value != mine[field] for value in per_rank.values()) else None

    if per_rank := differs("arrival"):
        raise RankDivergenceError(
            f"zcompile: {what}: the ranks come from different training steps (what each rank called, and its compiled "
            f"calls with gradients since the last step: {per_rank}). "
            f"{choose_fix(STEP_FIX, what, [str(value) for value in per_rank.values()])}"
        )
    if per_rank := differs("called"):
        # as many calls, on other parameters: at stage 3 (and 2) the same graph run on one layer here and
        # another there pairs their gathers and reduce-scatters, one layer's weights with another's
        raise RankDivergenceError(
            f"zcompile: {what}: the ranks ran different parts of the model since the last step (per rank, the "
            f"parameters its compiled calls with gradients used, numbered in the optimizer's order, and how often: "
            f"{per_rank}), so their collectives paired one layer's weights or gradients with another's. Every rank "
            "must run the same modules: skip a layer (LayerDrop, stochastic depth) on every rank together (draw the "
            "decision from a torch.Generator seeded alike on every rank, or broadcast it)."
        )
    if per_rank := differs("grads"):
        # the step's buckets are planned from the parameters that have gradients (zcompile.optim.buckets) and
        # pair their members by position: one parameter's gradient would be averaged with another's
        raise RankDivergenceError(
            f"zcompile: {what}: the ranks have gradients on different parameters (per rank, how many and a digest of "
            f"their positions: {per_rank}; this rank's: {_some(_member_names(with_grads, positions, members))}), so "
            "the step's reductions would not match. A parameter used on some ranks only must get a gradient on "
            "every rank: use it everywhere (`+ 0 * module(x)`) or give it zeros before the step "
            "(`p.grad = torch.zeros_like(p)` where `p.grad is None`)."
        )
    if per_rank := differs("layout"):
        raise RankDivergenceError(
            f"zcompile: {what}: the ranks hold the replicated weights in different dtypes (per rank, stage-1/2 "
            f"parameters by dtype: {per_rank}), so the step's all-gathers would not match. Compile the model with the "
            "same param_dtype on every rank."
        )
    if per_rank := differs("buffers"):
        raise RankDivergenceError(
            f"zcompile: {what}: the ranks' compiled calls changed different module buffers since the last step (per "
            f"rank: {per_rank}), so the step's broadcast of them (option broadcast_buffers) would not match: a module "
            "is in training mode on some ranks only (model.train() / model.eval() on one rank). Put the model in "
            "the same mode on every rank."
        )
    if per_rank := differs("replaced"):
        raise RankDivergenceError(
            f"zcompile: {what}: weights were given new values through `.data =` on some ranks only since the last step "
            f"(per rank, the parameters: {per_rank}); each rank's become its own master weights, so the ranks would "
            "train different weights. Load weights on every rank (the same values), or before compiling the model."
        )
    if per_rank := differs("hyperparameters"):
        where = _first_hyperparameter_difference(per_rank, members[0].group.rank)
        raise RankDivergenceError(
            f"zcompile: {what}: the ranks' optimizers have different hyper-parameters ({where}), so each rank would "
            "update its shard with its own. Step learning-rate schedulers on every rank, and feed metric-driven "
            "ones (ReduceLROnPlateau) the same value everywhere (the metric all-reduced and averaged)."
        )
    if (per_rank := differs("initial")) and (
        names := differing_parameters(list(per_rank.values()), members[0].group.rank)
    ):
        raise RankDivergenceError(different_weights_message(what, names))
    agreed = AgreedStep(exchanges_made(members[0].group, "step"))
    for member in members:
        member.agreed_step = agreed
        member.initial_digest = None  # compared: the step updates them from here on
    finite = list(mine).index("finite")
    return None if grads_finite is None else all(values[finite] for values in arrivals)


def _first_hyperparameter_difference(per_rank: dict[int, list[dict]], rank: int) -> str:
    """``param group 0 'lr': rank 0 0.001, rank 1 0.0005`` for the first setting that differs."""
    for index, group in enumerate(per_rank[rank]):
        for key in group:
            values = {
                other: groups[index].get(key) if index < len(groups) else None for other, groups in per_rank.items()
            }
            if len({json.dumps(v) for v in values.values()}) > 1:
                return f"param group {index} {key!r}: " + ", ".join(f"rank {r} {v}" for r, v in values.items())
    return "param groups per rank: " + ", ".join(f"rank {r} {len(groups)}" for r, groups in per_rank.items())


def hyperparameters_of(param_groups: list[dict]) -> list[dict]:
    """The param groups' settings without their parameters, as the step's agreement compares them
    (a tensor setting by its shape: reading its value would wait for the device)."""

    def plain(value):
        if isinstance(value, torch.Tensor):
            return f"tensor of shape {tuple(value.shape)}"
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value if isinstance(value, (int, float, str, bool)) or value is None else repr(value)

    return [{key: plain(value) for key, value in group.items() if key != "params"} for group in param_groups]


def _digest(values: list) -> str:
    return hashlib.sha1(json.dumps(values).encode()).hexdigest()[:12]


def _member_names(chosen: list[int], positions: list[int], members: list[ShardedParam]) -> list[str]:
    names = {at: member.name for at, member in zip(positions, members)}
    return [f"#{at} {names[at]}" for at in chosen]


def _positions_summary(calls: list[tuple[int, int]], shown: int = 6) -> str:
    """``"#2-#13 x1, #26-#37 x2 (digest)"``: runs of consecutive positions called as often, the first
    ``shown`` runs in words and a digest of all (what the ranks compare)."""
    runs: list[list[int]] = []  # [first, last, calls]
    for index, count in calls:
        if runs and runs[-1][1] == index - 1 and runs[-1][2] == count:
            runs[-1][1] = index
        else:
            runs.append([index, index, count])
    words = [f"#{first}" + (f"-#{last}" if last > first else "") + f" x{count}" for first, last, count in runs[:shown]]
    more = f" and {len(runs) - shown} more runs" if len(runs) > shown else ""
    return f"{', '.join(words) or 'none'}{more} ({_digest(calls)})"


def _some(names: list[str], shown: int = 8) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "") or "none"


def replicated_layout(members: list[ShardedParam]) -> dict[str, int]:
    """How many stage-1/2 parameters each dtype of replicated weights holds: what the step's all-gathers
    move (a rank compiled with another ``param_dtype`` would gather other bytes: gloo aborts the process)."""
    layout: dict[str, int] = {}
    for member in members:
        if member.stage in (1, 2):
            dtype = str(member.replicated_dtype)
            layout[dtype] = layout.get(dtype, 0) + 1
    return layout
