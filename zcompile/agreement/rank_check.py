"""Compile-time check that every rank's graph issues the same collectives, in the same order, and
its helpers: the signatures and where two of them differ (the exchange is ``store_exchange``).

A rank whose compiled graph issues different collectives (another model, another stage, a
parameter missing) would deadlock the job at the first mismatched collective. Each rank publishes
the signature of its planned collectives in the process group's key-value store and waits, with a
timeout, for the others'. The store is used rather than a collective so that a rank that never
compiles this graph produces a timeout error, not a hang; the signatures themselves are exchanged
(not digests) so that the error can name the first setting, parameter or collective that differs.

A signature every rank has already agreed on may be compiled by one rank alone: a recompile for
that rank's own input shapes (a batch padded to its own longest sequence, a shorter last batch) issues
the collectives of a graph the ranks checked together, so it pairs with whatever graph of that frame
the others run, exactly as a cached graph does (``check_same_on_all_ranks``, ``_agreed_key``).

A rank that raises ``RankDivergenceError`` here first leaves an abort note in the store: the other
ranks stop waiting in their own exchanges (and a collective that failed because this rank left can
say why, ``raise_if_aborted``) instead of waiting for a rank that will never come.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from typing import Any

import torch

from zcompile.agreement.abort_note import tell_others_and_raise
from zcompile.agreement.fixes import CHECK_FIX, COMPILE_CHECK, NO_GRAD_CALL
from zcompile.agreement.store_exchange import exchange_on_store
from zcompile.common.dynamo_frame import compile_mode, recompile_reason
from zcompile.common.process_group import DataParallelGroup, default_store
from zcompile.passes.collectives import COLLECTIVE_KINDS, collective_nodes
from zcompile.passes.metadata import params_of
from zcompile.passes.regions import subgraph_calls

log = logging.getLogger(__name__)

SHOWN = 4  # extra parameters or collectives listed by name, ranks described, in a difference


# ---- signatures and where two of them differ (pure functions) ----

MODELS_OWN = "(the model's own)"  # marks a collective the model calls itself in a graph's signature
MARKED_BLOCKS = "blocks marked by mark_repeated_blocks"


def collective_signature(plan, extra: list | None = None, marked_blocks: int = 0, options: dict | None = None) -> list:
    """``[settings, parameters]``: what decides a Dynamo graph's collectives, named so a difference can be.
    ``marked_blocks``: the graph's block subgraph calls (they decide the buckets of its backward);
    ``options``: other options that decide what the ranks exchange at this compile, by name."""
    # the options first: where one differs it is the cause, and the settings it decides follow from it
    settings = {
        **(options or {}),
        "stage": plan.stage,
        "world_size": plan.world_size,
        "param_dtype": str(plan.param_dtype),
        "reduce_dtype": str(plan.reduce_dtype),
    }
    if extra:
        settings["zero++"] = list(extra)
    if marked_blocks:
        settings[MARKED_BLOCKS] = marked_blocks
    return [settings, [[p.name, list(p.shape), p.requires_grad, str(p.dtype)] for p in plan.params]]


def call_identity(plan, gm: torch.fx.GraphModule, extra: list | None = None) -> str:
    """What a stage-3 graph's call is, for the ranks' agreement on each call
    (``step_agreement.agree_on_call``): the same on every rank for graphs that issue the same
    collectives in the same mode (``collective_signature``, ``dynamo_frame.compile_mode``), whatever
    their compile ids. A rank that recompiled alone for its own shapes (graph 0/1 where the others
    run 0/0) makes the same call; a rank evaluating under ``torch.no_grad()`` where the others train
    does not. Read while the backend compiles (the mode is the compile's)."""
    grad_enabled, training = compile_mode()
    digest = hashlib.sha1(
        json.dumps([collective_signature(plan, extra, subgraph_calls(gm)), grad_enabled, training]).encode()
    ).hexdigest()[:8]
    names = [p.name for p in plan.params]
    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
    return (
        f"{NO_GRAD_CALL if not grad_enabled else 'a call of a compiled training graph'} of {names[0]!r}{more} "
        f"(collectives {digest})"
    )


def sequence_signature(gm: torch.fx.GraphModule) -> list:
    """The collectives of a compiled (aten) graph in issue order: kind, input shape, dtype, other
    arguments, and the parameters it moves (from the node metadata, when the pass that made it said).

    The group is the last argument of every collective op; it is left out because sub-groups
    (one per node) have a different name on each node. Its size is in the other arguments.
    """
    signature = []
    for collective in collective_nodes(gm):
        val = collective.input_val
        # a dynamic dimension by its expression (``s0``): a SymInt is no JSON, and its value may differ by rank
        shape = [size if isinstance(size, int) else str(size) for size in val.shape] if val is not None else None
        # the form it runs in too: a reduce-scatter on one rank and an all-to-all on another would not pair
        ran_as = COLLECTIVE_KINDS[collective.node.target]
        kind = (
            collective.kind
            if ran_as == collective.kind
            else f"{collective.kind} run as {ran_as} (option reduce_scatter)"
        )
        if not collective.is_zero:
            kind = f"{kind} {MODELS_OWN}"
        signature.append(
            [
                kind,
                shape,
                str(getattr(val, "dtype", None)),
                [str(a) for a in collective.node.args[1:-1]],
                params_of(collective.node),
            ]
        )
    return signature


def plan_difference(mine: list, theirs: list, rank: int, other: int) -> str | None:
    """Where two ranks' ``collective_signature`` first differ, in words; None when they do not."""
    (settings, params), (other_settings, other_params) = mine, theirs
    for key in list(settings) + [k for k in other_settings if k not in settings]:
        if settings.get(key) != other_settings.get(key):
            return (
                f"setting {key!r}: rank {rank} {_short(settings.get(key))}, "
                f"rank {other} {_short(other_settings.get(key))}"
            )
    for index, (param, other_param) in enumerate(zip(params, other_params)):
        if param != other_param:
            return f"parameter #{index}: rank {rank}: {_param(param)}; rank {other}: {_param(other_param)}"
    return _more_entries(params, other_params, rank, other, "parameters", lambda p: repr(p[0]))


def sequence_difference(mine: list, theirs: list, rank: int, other: int) -> str | None:
    """Where two ranks' ``sequence_signature`` first differ, in words; None when they do not. Where a
    collective the model calls itself is among those that differ, it says what such a call needs: the
    general fix (the same model and options everywhere) would not point at the model's own code."""
    for index, (collective, other_collective) in enumerate(zip(mine, theirs)):
        if collective != other_collective:
            # the arguments (group size, reduce op) only when they are what differs
            with_args = collective[:3] == other_collective[:3] and collective[3] != other_collective[3]
            # two buckets alike but for their parameters: show them from where they part
            alike = collective[:4] == other_collective[:4]
            start = _first_difference(collective[4], other_collective[4]) if alike else 0
            return (
                f"collective #{index}: rank {rank}: {_collective(collective, with_args, start)}; "
                f"rank {other}: {_collective(other_collective, with_args, start)}"
                + _models_own_advice([collective, other_collective])
            )
    text = _more_entries(mine, theirs, rank, other, "collectives", _collective)
    return None if text is None else text + _models_own_advice(mine[len(theirs) :] + theirs[len(mine) :])


def models_own_note(signature: list) -> str:
    """How a graph whose ``sequence_signature`` holds collectives the model calls itself says so where
    it is named (a rank waiting at its check): a rank whose graph lacks them compiled nothing to check,
    so the wait is all the others see. Empty for a graph with ZeRO's collectives alone."""
    own = [entry for entry in signature if entry[0].endswith(MODELS_OWN)]
    if not own:
        return ""
    more = f" and {len(own) - 1} more" if len(own) > 1 else ""
    collective = _collective(own[0]).replace(f" {MODELS_OWN}", "")
    return f" (with the model's own {collective}{more}, which every rank must run)"


def _models_own_advice(differing: list) -> str:
    if not any(entry[0].endswith(MODELS_OWN) for entry in differing):
        return ""
    return (
        ". A collective the model calls itself (in its forward, not one zcompile inserts) must run on every "
        "rank, in the same order and with the same shapes: take it out of any branch on the rank or on data "
        "that differs by rank"
    )


def entry_difference(mine: list, theirs: list, rank: int, other: int) -> str | None:
    """Where two lists first differ, entry by entry (for signatures without a describer of their own)."""
    for index, (entry, other_entry) in enumerate(zip(mine, theirs)):
        if entry != other_entry:
            return f"entry #{index}: rank {rank}: {json.dumps(entry)}; rank {other}: {json.dumps(other_entry)}"
    return _more_entries(mine, theirs, rank, other, "entries", json.dumps)


def describe_differences(signatures: list, difference: Callable[[list, list, int, int], str | None]) -> str:
    """Each rank whose signature differs from rank 0's, and where first (the first ``SHOWN`` ranks)."""
    found = [
        text
        for rank, signature in enumerate(signatures[1:], 1)
        if (text := difference(signatures[0], signature, 0, rank)) is not None
    ]
    more = f"; and {len(found) - SHOWN} more ranks" if len(found) > SHOWN else ""
    return "; ".join(found[:SHOWN]) + more


def _more_entries(mine: list, theirs: list, rank: int, other: int, what: str, describe: Callable) -> str | None:
    if len(mine) == len(theirs):
        return None
    longer, extra = (rank, mine[len(theirs) :]) if len(mine) > len(theirs) else (other, theirs[len(mine) :])
    shown = ", ".join(describe(entry) for entry in extra[:SHOWN]) + (", ..." if len(extra) > SHOWN else "")
    return f"rank {longer} has {len(extra)} more {what} than rank {other if longer == rank else rank}: {shown}"


def _short(value: Any) -> str:
    return value.removeprefix("torch.") if isinstance(value, str) else json.dumps(value)


def _param(entry: list) -> str:
    name, shape, requires_grad, dtype = entry
    return f"parameter {name!r} shape {shape} {_short(dtype)}" + ("" if requires_grad else " (frozen)")


def _collective(entry: list, with_args: bool = False, start: int = 0) -> str:
    """``all_gather of [96] float32 moving parameter 'h.0.weight'``; a bucket's parameters from ``start``."""
    kind, shape, dtype, args, params = entry
    text = f"{kind} of {shape} {_short(dtype)}" + (f" with arguments {args}" if with_args else "")
    if len(params) == 1:
        return f"{text} moving parameter {params[0]!r}"
    if not params:
        return text
    shown = ", ".join(repr(p) for p in params[start : start + SHOWN]) or "none"
    more = ", ..." if start + SHOWN < len(params) else ""
    return f"{text} moving {len(params)} parameters" + (f", from #{start}: " if start else ": ") + shown + more


def _first_difference(mine: list, theirs: list) -> int:
    """The first index where two lists differ (the shorter one's length when it is a prefix; 0 when equal)."""
    if mine == theirs:
        return 0
    return next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))


# ---- the checks ----


def issues_collectives(plan, zeropp_active: bool, grad_enabled: bool | None = None) -> bool:
    """Whether compiling this Dynamo graph needs the ranks' agreement: it will issue a collective,
    or ZeRO++ will make its process groups (a collective) for it.

    A graph without either cannot deadlock, so one rank may compile it alone: evaluation on rank 0
    under ``torch.no_grad()`` at stages 1 and 2. Stage 1 graphs have no collectives; a stage 2 graph
    has only the backward's reduce-scatters, absent when no gradient will be computed (grad mode off
    at compile, or no parameter requiring grad: AOTAutograd then makes an inference graph). The
    post-partition check still runs on any graph whose collectives turn out not empty.
    """
    if zeropp_active:
        return True
    if not plan.params or plan.stage == 1:
        return False
    if plan.stage == 2:
        grad_enabled = torch.is_grad_enabled() if grad_enabled is None else grad_enabled
        return grad_enabled and any(p.requires_grad for p in plan.params)
    return True


def check_same_collectives(
    plan,
    gm: torch.fx.GraphModule,
    group: DataParallelGroup,
    timeout_s: float,
    extra: list | None = None,
    options: dict | None = None,
) -> None:
    """Raises ``RankDivergenceError`` unless all ranks planned identical collectives for this graph.

    ``extra``: more settings that decide the collectives (the ZeRO++ options); ``options``: others that
    decide what the ranks exchange next (``sync_module_states``), compared by name. Blocks marked on one
    rank only (``mark_repeated_blocks``) are named here, before the backward's buckets differ.
    Gradient hooks registered on some ranks only ride along and get a warning, not an error: one that
    only reads (``wandb.watch`` on rank 0) is fine, one that changes the gradient on some ranks only
    makes the mean a mix of hooked and unhooked gradients, as it does under DDP.
    """
    compile_id = str(gm.meta.get("dynamo_compile_id", "unknown"))
    hooked = sorted(p.name for p in plan.params if p.grad_hooks)
    # a recompile says which guard failed: a rank recompiling alone names the input that changed
    reason = recompile_reason()
    what = f"graph {compile_id}" + (f" (a recompile: {reason})" if reason else "")
    per_rank = check_same_on_all_ranks(
        collective_signature(plan, extra, subgraph_calls(gm), options),
        group,
        timeout_s,
        what,
        plan_difference,
        aside=hooked,
    )
    if any(other != hooked for other in per_rank):
        listed = "; ".join(
            f"rank {rank}: {', '.join(names[:4]) or 'none'}{' ...' if len(names) > 4 else ''}"
            for rank, names in enumerate(per_rank)
        )
        log.warning(
            "zcompile: graph %s: the parameters with gradient hooks (register_hook) differ between ranks "
            "(%s). Fine for hooks that only read the gradient; one that changes it on some ranks only makes "
            "the mean over ranks a mix of hooked and unhooked gradients: register such hooks on every rank.",
            compile_id,
            listed,
        )


def check_same_on_all_ranks(
    signature: list,
    group: DataParallelGroup,
    timeout_s: float,
    what: str,
    difference: Callable[[list, list, int, int], str | None] = entry_difference,
    aside: Any = None,
    at_call_fix: str | None = None,
) -> list:
    """Raises ``RankDivergenceError`` unless every rank of ``group`` passes the same ``signature``;
    the error names, per rank, the first place where ``difference`` finds it differs from rank 0's.
    Returns every rank's ``aside``: carried by the same exchange, compared by the caller.

    A check runs at a compile (a rank that never comes compiled what the others did not: its fix is
    ``CHECK_FIX``, and a rank waiting for it elsewhere gives that fix too), or, with ``at_call_fix``, at
    a compiled call (a backward's first: a rank that never comes skipped it, and that is the fix).

    The n-th check of a rank is compared with every other rank's n-th check. At a recompile, and at
    a backward's first call, a ``signature`` every rank agreed on at an earlier check of this kind is
    not exchanged again: a rank recompiling alone for its own input shapes issues the same
    collectives as the graph the others run (module docstring), and waiting for ranks that will not
    compile would make that a ``RankDivergenceError``. Every rank's ``aside`` is then taken to be this
    rank's (a first compile, after ``torch._dynamo.reset()`` too, exchanges and compares them). A
    compile's check counts as agreed only in the mode it was agreed in (``dynamo_frame.compile_mode``:
    grad mode, the modules' training flags): rank 0 evaluating alone, under ``torch.no_grad()`` or
    after ``model.eval()``, compiles a graph whose collectives may be the training graph's, and is
    still met by the exchange (which names it). The decision to skip depends only on what every rank
    doing the same thing has in common, so agreeing ranks skip together or exchange together.
    """
    # a compile's signature counts as agreed only in the same mode (grad, modules' training flags): one
    # rank evaluating alone compiles a graph whose collectives may equal the training graph's
    agreed = _agreed_key(group, [signature, difference.__name__, compile_mode() if at_call_fix is None else None])
    may_skip = at_call_fix is not None or recompile_reason() is not None  # a first compile always exchanges
    if group.world_size > 1 and may_skip and default_store().check([agreed]):
        log.info(
            "zcompile: %s issues the collectives every rank agreed on at an earlier compile: no exchange "
            "(a recompile on this rank only is fine)",
            what,
        )
        return [aside] * group.world_size
    # the kind of check is compared (rank-independent); ``what`` (a compile id, a recompile's reason: they
    # may differ between agreeing ranks) rides as a label, read only when the values differ
    doing, fix = (f"{COMPILE_CHECK}{what}", CHECK_FIX) if at_call_fix is None else (f"zcompile: {what}", at_call_fix)
    exchanged = exchange_on_store(
        [signature, aside, difference.__name__], group, timeout_s, "check", doing, fix, label=what
    )
    signatures = [entry[0] for entry, _ in exchanged]
    kinds = [entry[2] for entry, _ in exchanged]
    if any(kind != difference.__name__ for kind in kinds):  # the ranks met at different checks
        at = "; ".join(
            f"rank {rank} at {label}"
            for rank, (_, label) in enumerate(exchanged)
            if kinds[rank] != kinds[0] or rank == 0
        )
        tell_others_and_raise(
            None,
            group,
            (
                f"zcompile: the ranks reached different compile steps at the same point ({at}): they compiled "
                "different graphs, or in another order. " + CHECK_FIX
            ),
        )
    if any(other != signatures[group.rank] for other in signatures):
        tell_others_and_raise(
            None,
            group,
            (
                f"zcompile: {what} would issue different collectives on different ranks "
                f"({describe_differences(signatures, difference)}). Every rank must compile the same model with "
                "the same options."
            ),
        )
    log.debug("rank check passed for %s (%d entries)", what, len(signature))
    if group.world_size > 1:
        default_store().set(agreed, "1")  # each rank its own: its later lone recompile reads it at once
    return [entry[1] for entry, _ in exchanged]


def _agreed_key(group: DataParallelGroup, compared: list) -> str:
    """The store key set once every rank of ``group`` passed ``compared`` (a signature and its kind of
    check): keyed by the digest of the value, so one key per distinct graph, not per compile."""
    digest = hashlib.sha1(json.dumps(compared).encode()).hexdigest()[:24]
    return f"zcompile/check/{group.name}/agreed/{digest}"
