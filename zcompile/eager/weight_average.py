"""``lerp_weights_(target, source, weight)``: weights averaged over steps, on what each rank holds.

An EMA of a model's weights, or a teacher that follows its student (BYOL, DINO, MoCo), moves each
target weight toward its source after the optimizer's step: ``t += weight * (s - t)``. At stage 3
no rank holds a full weight between steps, so eager code can do that only inside
``zcompile.gathered`` on both models, which gathers the whole of both every step: the memory and
traffic a stage-3 run was chosen to avoid. The update is elementwise, so each rank does it on its own
pieces instead: this rank's shard of the target from this rank's shard of the source, with no
collective and no memory beyond the models'.

Each pair of parameters (``target.parameters()`` and ``source.parameters()`` in order) is one of:

- both held in full on every rank (not compiled, or stages 1-2 without ``param_dtype``): the full
  weights, as torch would, and a stage-1/2 master shard kept apart from them (a bf16 model's fp32
  one; an fp32 model's shard is a view of the weight) is rewritten from the new weight;
- both stage 3 with the same layout (size, group and rank): the shards, so what the next compiled
  call gathers is the average. A prefetch issued before is dropped (it checks the shard's version);
- a target not sharded yet beside a stage-3 source (an EMA copy made before the model was compiled,
  not called since): the target is sharded as the source is, then as above. A later compile of it
  with the same options takes those shards; eager use of it then needs ``gathered``, as the
  source's does;
- a target held in full beside a stage-1/2 source with a ``param_dtype`` replica (a bf16-trained
  student's fp32 values exist only as the ranks' master shards): this rank's slice of the target
  from the source's master shard, then the slices all-gathered into the full target a bucket at a
  time (``eager.gathered.gather_into_full``): one all-gather of the target, where ``gathered`` on both
  models gathered the source and wrote both back;
- anything else (a stage-3 target beside a source held in full; a target with a replica of its
  own) is refused naming the pair and the fix, before any weight changes.

The ranks agree through the store first (which models, how each pair is held, the weight), as
``gathered`` does: a rank that skips the update, or updates another model or with another weight, is
a ``RankDivergenceError`` on every rank rather than a teacher whose pieces follow different
schedules. Models of one architecture read alike (their parameters' names, shapes and sharding), so
each model is numbered the first time it is passed (``store_exchange.next_number``; the number kept on
the module with its ``id``, so a deep copy is numbered anew): a rank that skips the teacher's update
and makes the EMA's in its place is told, even with the same weight. At a target's first update the
ranks also compare the values it starts from (``_starting_digest``): a copy that differs between
ranks would be cut into a mix of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zcompile.agreement.initial_values import value_digest
from zcompile.agreement.store_exchange import agree_on_store, names_digest, next_number
from zcompile.common.process_group import DataParallelGroup
from zcompile.eager.gathered import DEFAULT_TIMEOUT_S, gather_into_full
from zcompile.routes import install as install_routes
from zcompile.sharding.shards import ShardedParam, shard_of, shard_parameter

_FIX = (
    "compile both models with the same options and call each once before the first update (a teacher's "
    "forward does), or update inside `with zcompile.gathered(target), zcompile.gathered(source):`"
)

# a target with a replica of its own: its fp32 values are master shards, its replica a second copy to keep
_REPLICA_FIX = (
    "a target trained with param_dtype keeps its fp32 values on the ranks' master shards and a "
    "low-precision replica beside them; update inside `with zcompile.gathered(target), "
    "zcompile.gathered(source):` (or train at stage 3, where both are shards)"
)

# on a module passed to lerp_weights_: (its number, id(module)); a deep copy carries the pair, not the id
NUMBER_ATTR = "_zcompile_averaging_number"

# how this rank updates one pair: the full weights, the two stage-3 shards, the target sharded first, or
# this rank's slice of a full target from a replica's master shard, the slices gathered after
FULL, SHARDS, SHARD_TARGET, SLICES = "full", "shards", "shard target", "slices"


@dataclass(frozen=True)
class _Pair:
    target: torch.nn.Parameter
    source: torch.nn.Parameter
    way: str


def _held_in_full(sharded: ShardedParam | None) -> bool:
    """Every rank holds the whole weight: not sharded, or stages 1-2 whose shard is a view of it."""
    return sharded is None or (sharded.stage in (1, 2) and sharded.replica is None)


def _sharded_alike(target: ShardedParam, source: ShardedParam) -> bool:
    return target.stage == source.stage == 3 and target.piece == source.piece and target.group.name == source.group.name


def _plan(target: torch.nn.Parameter, source: torch.nn.Parameter, name: str) -> _Pair:
    """How this rank updates one pair (module docstring), or the error that says why it cannot."""
    if target.shape != source.shape:
        raise ValueError(
            f"zcompile.lerp_weights_: parameter pair {name} has shapes {tuple(target.shape)} and "
            f"{tuple(source.shape)}; the two models must be instances of one architecture"
        )
    t_shard, s_shard = shard_of(target), shard_of(source)
    if _held_in_full(t_shard) and _held_in_full(s_shard):
        return _Pair(target, source, FULL)
    if s_shard is not None and s_shard.stage == 3 and (t_shard is None or _sharded_alike(t_shard, s_shard)):
        if not s_shard.is_freed or (t_shard is not None and not t_shard.is_freed):
            raise RuntimeError(
                f"zcompile.lerp_weights_: parameter pair {name} is gathered now (inside "
                "`zcompile.gathered`, whose exit writes the full weights back over the shards); "
                "update outside it, or update the full weights there"
            )
        return _Pair(target, source, SHARDS if t_shard is not None else SHARD_TARGET)
    if (
        _held_in_full(t_shard)
        and target.is_contiguous()
        and s_shard is not None
        and s_shard.stage in (1, 2)
        and s_shard.replica is not None
    ):
        return _Pair(target, source, SLICES)
    replica = any(sharded is not None and sharded.replica is not None for sharded in (t_shard, s_shard))
    fix = _REPLICA_FIX if replica else _FIX
    raise ValueError(
        f"zcompile.lerp_weights_: parameter pair {name} is held differently by the two models (target: "
        f"{_held_as(t_shard)}; source: {_held_as(s_shard)}), so this rank's pieces of the two do not "
        f"match; {fix}"
    )


def _held_as(sharded: ShardedParam | None) -> str:
    if sharded is None:
        return "full, not sharded"
    if sharded.replica is not None:
        return f"stage {sharded.stage} with a {sharded.replica.dtype} replica and an fp32 shard"
    return f"stage {sharded.stage}, {sharded.numel} elements over {sharded.group.world_size} ranks"


def _pieces(pair: _Pair) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tensors of the pair: what is updated, and what it moves toward."""
    if pair.way == FULL:
        return pair.target.detach(), pair.source.detach()
    source = shard_of(pair.source)
    if pair.way == SLICES:
        piece = source.piece
        return pair.target.detach().view(-1)[piece.offset : piece.offset + piece.owned], source.shard.detach()[
            : piece.owned
        ]
    if pair.way == SHARD_TARGET:  # as a compile of the target with the source's options would
        install_routes()
        shard_parameter(pair.target, f"{source.name} (averaged)", stage=3, group=source.group)
    return shard_of(pair.target).shard.detach(), source.shard.detach()


@torch.no_grad()
def lerp_weights_(
    target: torch.nn.Module,
    source: torch.nn.Module,
    weight: float,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    buffers: bool = False,
) -> None:
    """Moves every weight of ``target`` toward ``source``'s: ``t += weight * (s - t)`` (``torch.lerp``),
    on each rank's pieces (module docstring). An EMA with decay ``d`` is ``weight = 1 - d``. Every rank
    calls it.

    ``buffers``: the buffers too (``AveragedModel(use_buffers=True)``, timm's ``ModelEmaV3``): the
    floating-point ones moved the same way (BatchNorm's running statistics), the others copied
    (``num_batches_tracked``). Buffers are whole on every rank; the source's must be the same on
    every rank, as they are after ``optimizer.step()`` (which gives every rank rank 0's), or the ranks'
    averages would part: compared with the rest of the call. Default False, as ``AveragedModel``:
    the target's buffers are left alone (copy them yourself, or run ``torch.optim.swa_utils.update_bn``)."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"zcompile.lerp_weights_: weight={weight!r} must be in [0, 1] (an EMA with decay d: 1 - d)")
    target, source = (getattr(m, "_orig_mod", m) for m in (target, source))  # torch.compile's wrapper: its module
    targets, sources = list(target.parameters()), list(source.parameters())
    if len(targets) != len(sources):
        raise ValueError(
            f"zcompile.lerp_weights_: target has {len(targets)} parameters and source {len(sources)}; "
            "they must be two instances of one architecture"
        )
    pairs = [_plan(t, s, f"#{index} {tuple(t.shape)}") for index, (t, s) in enumerate(zip(targets, sources))]
    buffer_pairs = _buffer_pairs(target, source) if buffers else []
    group = _group_of(pairs)  # None: nothing sharded, nothing to agree on
    starting = _starting_digest(pairs) if _number_of(target) is None else None  # its first update
    source_buffers = sum(value_digest(s) for _, s in buffer_pairs) if buffers else None
    _agree(pairs, [_number(target, group), _number(source, group)], starting, weight, group, timeout_s, source_buffers)
    pieces = [_pieces(pair) for pair in pairs]  # nothing changed before every rank agreed
    torch._foreach_lerp_([t for t, _ in pieces], [s.to(t.dtype) for t, s in pieces], weight)
    for t, s in buffer_pairs:
        if t.is_floating_point():
            t.lerp_(s.to(t.dtype), weight)
        else:
            t.copy_(s)
    _gather_slices([pair for pair in pairs if pair.way == SLICES])
    for pair in pairs:
        sharded = shard_of(pair.target)
        if pair.way in (FULL, SLICES) and sharded is not None and sharded.home is None:
            # a full weight with a master shard apart (a bf16 model at stages 1-2): the shard is what the
            # optimizer steps from and what checkpoints save, so it takes the new value too
            sharded.write_shard_from_full()


def _buffer_pairs(target: torch.nn.Module, source: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``target.buffers()`` and ``source.buffers()`` in order, detached; an error unless they match."""
    targets, sources = list(target.buffers()), list(source.buffers())
    if len(targets) != len(sources) or any(t.shape != s.shape for t, s in zip(targets, sources)):
        raise ValueError(
            f"zcompile.lerp_weights_(buffers=True): target has {len(targets)} buffers and source "
            f"{len(sources)}, or their shapes differ; they must be two instances of one architecture"
        )
    return [(t.detach(), s.detach()) for t, s in zip(targets, sources)]


def _gather_slices(pairs: list[_Pair]) -> None:
    """Each pair's target whole again on every rank from every rank's updated slice (collective)."""
    items = []
    for pair in pairs:
        layout = shard_of(pair.source)
        piece = layout.piece
        flat = pair.target.detach().view(-1)
        mine = flat[piece.offset : piece.offset + piece.owned]
        items.append((flat, F.pad(mine, (0, piece.chunk - piece.owned)) if piece.owned < piece.chunk else mine, layout))
    gather_into_full(items)


def _group_of(pairs: list[_Pair]) -> DataParallelGroup | None:
    for pair in pairs:
        for param in (pair.target, pair.source):
            if (sharded := shard_of(param)) is not None:
                return sharded.group
    return None


def _number_of(module: torch.nn.Module) -> int | None:
    """``module``'s number if it was passed to ``lerp_weights_`` before (not a deep copy of one)."""
    numbered = module.__dict__.get(NUMBER_ATTR)
    return numbered[0] if numbered is not None and numbered[1] == id(module) else None


def _number(module: torch.nn.Module, group: DataParallelGroup | None) -> int:
    """``module``'s number among the models passed to ``lerp_weights_`` (module docstring)."""
    if (number := _number_of(module)) is not None:
        return number
    number = next_number("lerp_weights", group) if group is not None else 0
    module.__dict__[NUMBER_ATTR] = (number, id(module))  # not a submodule, buffer or parameter: the plain dict
    return number


def _starting_digest(pairs: list[_Pair]) -> int | None:
    """At a target's first update, the digest of the values it starts from where every rank holds them
    whole (``initial_values.value_digest``): a copy made on each rank before the ranks' weights were
    made equal (``copy.deepcopy(model)`` before ``sync_module_states``, or without a common seed)
    would be cut into shards or slices that mix the ranks' copies. Shards a compile made were compared
    there (None)."""
    whole = [pair.target for pair in pairs if pair.way != SHARDS]
    return sum(value_digest(target) for target in whole) if whole else None


def _agree(
    pairs: list[_Pair],
    numbers: list[int],
    starting: int | None,
    weight: float,
    group: DataParallelGroup | None,
    timeout_s: float,
    source_buffers: int | None,
) -> None:
    """Every rank updates the same models' pairs the same way with the same weight, a target starts
    from the same values on every rank, and buffers averaged move toward the same values (their
    digest, ``source_buffers``; None: not averaged), or every rank that came raises."""
    if group is None or group.world_size == 1:
        return
    ways = names_digest(pair.way for pair in pairs)
    call = [numbers, len(pairs), ways, float(weight), starting, source_buffers is not None, source_buffers]
    agree_on_store(
        call,
        group,
        timeout_s,
        "lerp_weights",
        "zcompile.lerp_weights_(target, source, weight)",
        "Every rank must call zcompile.lerp_weights_ at the same point of the loop (each updates its own pieces of "
        "the target: a rank that skips it leaves its pieces behind the others').",
        lambda calls: _difference(calls, call),
    )


def _difference(calls: list, mine: list) -> str:
    # [numbers, pairs, ways, weight, the target's starting values, buffers or not, the source's buffers]
    same_call = all(other[:4] == mine[:4] and other[5] == mine[5] for other in calls)
    if same_call and any(other[4] != mine[4] for other in calls):
        return (
            "zcompile.lerp_weights_: the target starts from different values on different ranks (a digest of "
            f"its weights per rank: {dict(enumerate(other[4] for other in calls))}), so its pieces would mix the "
            "ranks' copies. Make the copy from weights every rank shares: copy.deepcopy(model) after "
            "zcompile.sync_module_states(model), or the same seed on every rank"
        )
    if same_call:
        return (
            "zcompile.lerp_weights_(buffers=True): the source's buffers differ between ranks (a digest per rank: "
            f"{dict(enumerate(other[6] for other in calls))}), so the ranks' averages would part: update after the "
            "step (optimizer.step() gives every rank rank 0's buffers), not between the forward and the step"
        )
    return (
        "zcompile.lerp_weights_: the ranks called it with different models or weights ([the models' numbers, "
        "pairs, how each pair is held, weight, starting values, buffers or not, the source's buffers] per "
        f"rank: {dict(enumerate(calls))}); call it on every rank with the same models and weight."
    )
