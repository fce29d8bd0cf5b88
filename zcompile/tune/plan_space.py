"""What ``zcompile.plan`` chooses among: the planned options, their candidates, and the order in which
the planner tries them.

The planned options are the five memory knobs (``stage``, ``bucket_mb``, ``prefetch``,
``keep_gathered_mb``, ``activation_memory_budget``) and, where the world spans several nodes,
``shard_size`` (``None`` or ``"node"``); ``zcompile.plan`` of a model it can split also plans the
tensor-parallel degree (``TENSOR_PARALLEL``: a planned value that is not a backend option, but the
mesh's tp dim). An option the user set is kept as given and not planned. The stage-3-only knobs
(``prefetch``, ``keep_gathered_mb``) vary at stage 3 only.

A layout is an activation budget, a tp degree, a stage and a shard size; its variants are the other
knobs' values. Layouts are tried cheapest-to-run first, by what each costs in time: recomputing
activations first of all (it repeats forward compute), then a higher tp degree (its all-reduces
in every layer), then a higher stage (more communication), then full sharding over a node-sized
shard group (gathers across nodes). Within a layout the
fastest variant comes first (the most weights kept, the largest buckets, the deepest prefetch) and
the leanest last. The trial order is every layout's fastest variant, then every layout's leanest,
then the rest. It only decides what is simulated first when the planner's budget of simulations
is smaller than the candidates; the choice itself is the fastest simulated candidate that fits.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

TENSOR_PARALLEL = "tensor_parallel"  # the tp degree, planned by zcompile.plan where it can split the model
PLANNED = (
    "stage",
    "shard_size",
    "activation_memory_budget",
    "keep_gathered_mb",
    "bucket_mb",
    "prefetch",
    TENSOR_PARALLEL,
)
STAGE_3_ONLY = ("keep_gathered_mb", "prefetch")
# options that fix the layout by themselves: no shard_size candidates next to them
HYBRID_EXCLUSIVE = ("mesh", "group", "hpz_size", "quantize_grads")

# a candidate's status in a plan (with tune.search's PRUNED, INVALID, FAILED)
CHOSEN, FITS, OVER, NOT_SIMULATED = "chosen", "fits", "over the limit", "not simulated"

STAGES = (1, 2, 3)
ACTIVATION_BUDGETS = (None, 0.5, 0.0)  # the default partition, half of what it saves, recompute all
BUCKETS_MB = (64.0, 4.0)  # larger first: fewer collectives; 4 is the default
PREFETCH = (2, 1)
KEEP_FRACTIONS = (1.0, 0.25, 0.0)  # of the model's gathered weights, kept forward to backward


def planned_candidates(
    fixed: dict[str, Any],
    gathered_mib: float,
    world_size: int,
    node_size: int,
    tensor_parallel: tuple[int, ...] = (1,),
) -> list[dict[str, Any]]:
    """The planned options' combinations (each a dict of the planned options only), in trial order.

    ``fixed``: the options the user set; ``gathered_mib``: the model's weights gathered in the
    compute dtype, per rank (what ``keep_gathered_mb`` can keep at most; a tp degree t's pieces, 1/t
    of it); ``tensor_parallel``: the tp degrees to plan (``(1,)``: none, and no
    ``tensor_parallel`` in the candidates).
    """
    hybrid_possible = (
        world_size > node_size >= 2 and world_size % node_size == 0 and not any(fixed.get(k) for k in HYBRID_EXCLUSIVE)
    )
    choices: dict[str, tuple] = {
        "stage": STAGES,
        "shard_size": ("node", None) if hybrid_possible else (None,),
        "activation_memory_budget": ACTIVATION_BUDGETS,
        "keep_gathered_mb": None,  # per tp degree: shares of the pieces' gathered weights (below)
        "bucket_mb": BUCKETS_MB,
        "prefetch": PREFETCH,
        TENSOR_PARALLEL: tuple(tensor_parallel),
    }
    for name in PLANNED:
        if name in fixed:
            choices[name] = (fixed[name],)
    layouts = []  # per (activation budget, tp degree, stage, shard size): its variants, fastest first
    for budget, tp, stage, shard_size in itertools.product(
        choices["activation_memory_budget"], choices[TENSOR_PARALLEL], choices["stage"], choices["shard_size"]
    ):
        if shard_size == "node" and node_size // tp < 2:
            continue  # the node's data-parallel ranks (node / tp) are one: no shard group to shard over
        stage_3 = stage == 3
        variants = []
        keeps = choices["keep_gathered_mb"] or sorted(
            {float(math.ceil(fraction * gathered_mib / tp)) for fraction in KEEP_FRACTIONS}, reverse=True
        )
        knobs = itertools.product(
            keeps if stage_3 else (None,),
            choices["bucket_mb"],
            choices["prefetch"] if stage_3 else (None,),
        )
        for keep, bucket, prefetch in knobs:
            values = {
                "stage": stage,
                "shard_size": shard_size,
                "activation_memory_budget": budget,
                "keep_gathered_mb": keep,
                "bucket_mb": bucket,
                "prefetch": prefetch,
                TENSOR_PARALLEL: tp if choices[TENSOR_PARALLEL] != (1,) else None,
            }
            variant = {
                name: value
                for name, value in values.items()
                if name not in fixed and (value is not None or name in ("shard_size", "activation_memory_budget"))
            }
            if variant not in variants:
                variants.append(variant)
        layouts.append(variants)
    # every layout's fastest variant, then every layout's leanest, then the rest: a small budget of
    # simulations sees every layout before it refines one
    ordered = [v[0] for v in layouts] + [v[-1] for v in layouts if len(v) > 1] + [x for v in layouts for x in v[1:-1]]
    candidates = []
    for candidate in ordered:
        if candidate not in candidates:
            candidates.append(candidate)
    return candidates


def frugality(candidate: dict[str, Any]) -> tuple:
    """A sort key, least memory first by construction: the highest tp degree, the highest stage, full sharding, nothing kept,
    the smallest buckets and prefetch, then recompute (a full recompute can peak above half of it in
    backward, so the budgets are tried half first)."""
    budget = candidate.get("activation_memory_budget")
    return (
        -(candidate.get(TENSOR_PARALLEL) or 1),
        -candidate.get("stage", 0),
        candidate.get("shard_size") is not None,
        candidate.get("keep_gathered_mb") or 0.0,
        candidate.get("bucket_mb") or 0.0,
        candidate.get("prefetch") or 0,
        {0.5: 0, 0.0: 1}.get(budget, 2),
    )
