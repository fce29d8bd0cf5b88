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
- anything else (one side sharded, the other not; a ``param_dtype`` replica, whose fp32 master is
  sharded but whose replica is full) is refused naming the pair and the fixes, before any weight
  changes.

The ranks agree through the store first (the pairs, the weight), as ``gathered`` does: a rank that
skips the update, or updates with another weight, is a ``RankDivergenceError`` on every rank rather
than a teacher whose pieces follow different schedules.
"""

from __future__ import annotations

import hashlib

import torch

from zcompile.full_params import DEFAULT_TIMEOUT_S
from zcompile.param_shards import ShardedParam, shard_of
from zcompile.rank_check import RankDivergenceError, exchange_on_store

_FIX = ("compile both models with the same options and call each once before the first update (a teacher's "
        "forward does), or update inside `with zcompile.gathered(target), zcompile.gathered(source):`")


def _held_in_full(sharded: ShardedParam | None) -> bool:
    """Every rank holds the whole weight: not sharded, or stages 1-2 whose shard is a view of it."""
    return sharded is None or (sharded.stage in (1, 2) and sharded.replica is None)


def _pieces(target: torch.nn.Parameter, source: torch.nn.Parameter, name: str) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """What this rank updates for one pair: (target's tensor, source's tensor, whether it is a shard)."""
    t_shard, s_shard = shard_of(target), shard_of(source)
    if _held_in_full(t_shard) and _held_in_full(s_shard):
        return target.detach(), source.detach(), False
    if (t_shard is not None and s_shard is not None and t_shard.stage == s_shard.stage == 3
            and t_shard.piece == s_shard.piece and t_shard.group.name == s_shard.group.name):
        if not (t_shard.is_freed and s_shard.is_freed):
            raise RuntimeError(f"zcompile.lerp_weights_: parameter pair {name} is gathered now (inside "
                               "`zcompile.gathered`, whose exit writes the full weights back over the shards); "
                               "update outside it, or update the full weights there")
        return t_shard.shard.detach(), s_shard.shard.detach(), True
    raise ValueError(f"zcompile.lerp_weights_: parameter pair {name} is held differently by the two models (target: "
                     f"{_held_as(t_shard)}; source: {_held_as(s_shard)}), so this rank's pieces of the two do not "
                     f"match; {_FIX}")


def _held_as(sharded: ShardedParam | None) -> str:
    if sharded is None:
        return "full, not sharded"
    if sharded.replica is not None:
        return f"stage {sharded.stage} with a {sharded.replica.dtype} replica and an fp32 shard"
    return f"stage {sharded.stage}, {sharded.numel} elements over {sharded.group.world_size} ranks"


@torch.no_grad()
def lerp_weights_(target: torch.nn.Module, source: torch.nn.Module, weight: float,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Moves every weight of ``target`` toward ``source``'s: ``t += weight * (s - t)`` (``torch.lerp``),
    on each rank's pieces (module docstring). An EMA with decay ``d`` is ``weight = 1 - d``. Every rank
    calls it; buffers are left alone (copy them as you would without zcompile)."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"zcompile.lerp_weights_: weight={weight!r} must be in [0, 1] (an EMA with decay d: 1 - d)")
    targets, sources = list(target.parameters()), list(source.parameters())
    if len(targets) != len(sources):
        raise ValueError(f"zcompile.lerp_weights_: target has {len(targets)} parameters and source {len(sources)}; "
                         "they must be two instances of one architecture")
    pairs = []
    for index, (t, s) in enumerate(zip(targets, sources)):
        name = f"#{index} {tuple(t.shape)}"
        if t.shape != s.shape:
            raise ValueError(f"zcompile.lerp_weights_: parameter pair {name} has shapes {tuple(t.shape)} and "
                             f"{tuple(s.shape)}; the two models must be instances of one architecture")
        pairs.append(_pieces(t, s, name))
    _agree(targets, weight, timeout_s)
    torch._foreach_lerp_([t for t, _, _ in pairs], [s.to(t.dtype) for t, s, _ in pairs], weight)
    for param, (_, _, on_shards) in zip(targets, pairs):
        sharded = shard_of(param)
        if not on_shards and sharded is not None and sharded.home is None:
            # a full weight with a master shard apart (a bf16 model at stages 1-2): the shard is what the
            # optimizer steps from and what checkpoints save, so it takes the new value too
            sharded.write_shard_from_full()


def _agree(targets: list[torch.nn.Parameter], weight: float, timeout_s: float) -> None:
    """Every rank updates the same target with the same weight, or every rank that came raises."""
    sharded = [s for s in map(shard_of, targets) if s is not None]
    if not sharded or sharded[0].group.world_size == 1:
        return
    names = hashlib.sha1("\n".join(s.name for s in sharded).encode()).hexdigest()[:16]
    call = [len(targets), names, float(weight)]
    calls = exchange_on_store(
        call, sharded[0].group, timeout_s, "lerp_weights", "zcompile.lerp_weights_(target, source, weight)",
        "Every rank must call zcompile.lerp_weights_ at the same point of the loop (each updates its own pieces of "
        "the target: a rank that skips it leaves its pieces behind the others').")
    if any(other != call for other in calls):
        raise RankDivergenceError(
            "zcompile.lerp_weights_: the ranks called it with different models or weights ([parameters, their names' "
            f"digest, weight] per rank: {dict(enumerate(calls))}); call it on every rank with the same arguments.")
