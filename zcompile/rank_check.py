"""Compile-time check that every rank's graph issues the same collectives, in the same order.

A rank whose compiled graph issues different collectives (another model, another stage, a
parameter missing) would deadlock the job at the first mismatched collective. Each rank publishes
a digest of its planned collectives in the process group's key-value store under the graph's
Dynamo compile id and waits, with a timeout, for the others'. The store is used rather than a
collective so that a rank that never compiles this graph produces a timeout error, not a hang.
"""

from __future__ import annotations

import hashlib
import json
import logging
from datetime import timedelta
from typing import Any

import torch

from zcompile.passes.collectives import collective_nodes
from zcompile.process_group import DataParallelGroup, default_store

log = logging.getLogger(__name__)


class RankDivergenceError(RuntimeError):
    """The ranks would issue different collectives (and deadlock) if the job went on."""


def collective_signature(plan, extra: list | None = None) -> list:
    return list(extra or []) + [plan.stage, plan.world_size, str(plan.param_dtype), str(plan.reduce_dtype)] + [[p.name, list(p.shape), p.requires_grad, str(p.dtype)] for p in plan.params]


def check_same_collectives(plan, gm: torch.fx.GraphModule, group: DataParallelGroup, timeout_s: float,
                            extra: list | None = None) -> None:
    """Raises ``RankDivergenceError`` unless all ranks planned identical collectives for this graph.

    ``extra``: more settings that decide the collectives (the ZeRO++ options).
    """
    compile_id = str(gm.meta.get("dynamo_compile_id", "unknown"))
    check_same_on_all_ranks(collective_signature(plan, extra), group, timeout_s, f"graph {compile_id}",
                            f"this rank's parameters: {[p.name for p in plan.params][:8]}...")


def sequence_signature(gm: torch.fx.GraphModule) -> list:
    """The collectives of a compiled (aten) graph in issue order: kind, shape, dtype, other arguments.

    The group is the last argument of every collective op; it is left out because sub-groups
    (one per node) have a different name on each node. Its size is in the other arguments.
    """
    signature = []
    for collective in collective_nodes(gm):
        val = collective.input_val
        shape = list(val.shape) if val is not None else None
        signature.append([str(collective.node.target), shape, str(getattr(val, "dtype", None)),
                          [str(a) for a in collective.node.args[1:-1]]])
    return signature


def exchange_on_store(value: Any, group: DataParallelGroup, timeout_s: float, purpose: str, doing: str,
                      fix: str) -> list:
    """Every rank's ``value`` (JSON-able), exchanged through the store, in rank order.

    The n-th call of a rank for ``purpose`` meets every other rank's n-th call for it. A rank that
    does not come within ``timeout_s`` (it skipped the call, or took another code path) makes a
    ``RankDivergenceError`` here, on the ranks that came, naming the missing ones, instead of a
    collective that waits for it until the process group's timeout. Uses the store, not a
    collective, so that a missing rank is a timeout and not a hang.
    """
    if group.world_size == 1:
        return [value]
    store = default_store()
    # the counter lives in the store, so it survives torch._dynamo.reset() and needs no global
    sequence = store.add(f"zcompile/{purpose}/{group.name}/sequence/{group.rank}", 1)
    prefix = f"zcompile/{purpose}/{group.name}/{sequence}/"
    store.set(f"{prefix}{group.rank}", json.dumps(value))
    keys = [f"{prefix}{rank}" for rank in range(group.world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as error:  # the store raises a generic error on timeout
        missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
        raise RankDivergenceError(
            f"{doing}: rank {group.rank} got there (its call #{sequence}) but ranks {missing} did not within "
            f"{timeout_s:.0f}s. {fix}") from error
    return [json.loads(store.get(key)) for key in keys]


def check_same_on_all_ranks(signature: list, group: DataParallelGroup, timeout_s: float, what: str,
                            detail: str = "") -> None:
    """Raises ``RankDivergenceError`` unless every rank of ``group`` passes the same ``signature``.

    The n-th check of a rank is compared with every other rank's n-th check.
    """
    digest = hashlib.sha256(json.dumps(signature).encode()).hexdigest()[:16]
    digests = exchange_on_store(
        digest, group, timeout_s, "check", f"zero backend: {what}",
        "The ranks took different compile paths (different models, code paths or input shapes per rank) and "
        "their collectives would deadlock. Give every rank the same model and inputs of the same shapes "
        "(drop_last=True in the sampler), or raise check_timeout_s if a rank is only slow.")
    if len(set(digests)) > 1:
        raise RankDivergenceError(
            f"zero backend: {what} would issue different collectives on different ranks "
            f"(digest per rank {dict(enumerate(digests))}; {detail}). Every rank must compile the same model with "
            "the same options."
        )
    log.debug("rank check passed for %s (digest %s)", what, digest)
