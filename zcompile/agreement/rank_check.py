"""Compile-time check that every rank's graph issues the same collectives, in the same order, and
the store exchange that the other cross-rank agreements (``gathered``, checkpoints, steps) share.

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
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zcompile.agreement.abort_note import RankDivergenceError, abort_note, tell_others_and_raise
from zcompile.agreement.heartbeat import blocked
from zcompile.agreement.rank_state import BEAT_S, busy_with_own_work, describe_all, rank_states, waiting_on_each_other
from zcompile.common.dynamo_frame import compile_mode, recompile_reason
from zcompile.common.process_group import DataParallelGroup, default_store, process_group_timeout_s
from zcompile.passes.collectives import COLLECTIVE_KINDS, collective_nodes
from zcompile.passes.metadata import params_of
from zcompile.passes.regions import subgraph_calls

log = logging.getLogger(__name__)

FIRST_WAIT_S = 1.0  # one store.wait, notified at once: ranks that arrive within it cost no polling
POLL_S = 0.25  # then store.check every POLL_S (a timed-out store.wait prints c10d warnings each time)
# answered store requests per rank in one exchange whose ranks agree (``exchange_through``): what an
# exchange costs the one store server at N ranks, 5N requests (``zcompile.simulate`` prices it)
ANSWERED_REQUESTS_PER_EXCHANGE = 5
SHOWN = 4  # extra parameters or collectives listed by name, ranks described, in a difference
COMPILE_CHECK = (
    "zcompile compile check: "  # how a compile's rank check names itself (and how a beat shows a rank waiting in one)
)
CHECK_FIX = (
    "The ranks took different compile paths (different models, modes, code paths or input shapes per rank) "
    "and their collectives would deadlock. Give every rank the same model, the same mode (model.train() / "
    "model.eval(), torch.no_grad()) and the same code path. A rank recompiling alone for its own input shapes "
    "is fine while the new graph issues the collectives the ranks agreed on; where it issues others (code "
    "that branches on a shape), give every rank inputs of the same shapes (drop_last=True in the sampler, "
    "pad to a fixed length) or make the shapes dynamic on every rank from the first call "
    "(torch._dynamo.mark_dynamic(inputs, dim), or compile with torch.compile(..., dynamic=True)). Raise "
    "check_timeout_s if a rank is only slow. Evaluating on one "
    "rank only works at stages 1 and 2 under torch.no_grad(); at stage 3 the forward gathers parameters from "
    "every rank, so evaluate on every rank."
)


# ---- signatures and where two of them differ (pure functions) ----

MODELS_OWN = "(the model's own)"  # marks a collective the model calls itself in a graph's signature
MARKED_BLOCKS = "blocks marked by mark_repeated_blocks"


def collective_signature(plan, extra: list | None = None, marked_blocks: int = 0) -> list:
    """``[settings, parameters]``: what decides a Dynamo graph's collectives, named so a difference can be.
    ``marked_blocks``: the graph's block subgraph calls (they decide the buckets of its backward)."""
    settings = {
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
        f"a call of a compiled {'training' if grad_enabled else 'no-grad'} graph of {names[0]!r}{more} "
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
    plan, gm: torch.fx.GraphModule, group: DataParallelGroup, timeout_s: float, extra: list | None = None
) -> None:
    """Raises ``RankDivergenceError`` unless all ranks planned identical collectives for this graph.

    ``extra``: more settings that decide the collectives (the ZeRO++ options). Blocks marked on one
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
        collective_signature(plan, extra, subgraph_calls(gm)), group, timeout_s, what, plan_difference, aside=hooked
    )
    if any(other != hooked for other in per_rank):
        listed = "; ".join(
            f"rank {rank}: {', '.join(names[:4]) or 'none'}{' ...' if len(names) > 4 else ''}"
            for rank, names in enumerate(per_rank)
        )
        log.warning(
            "zcompile: graph %s: the parameters with gradient hooks (register_hook) differ between ranks "
            "(%s). Fine for hooks that only read the gradient (logging on one rank); a hook that changes it "
            "on some ranks only makes the mean over ranks a mix of hooked and unhooked gradients. Register "
            "such hooks on every rank.",
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
    compile made that a ``RankDivergenceError``. Every rank's ``aside`` is then taken to be this
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


# ---- the exchange through the store, and the abort note ----


def exchange_on_store(
    value: Any, group: DataParallelGroup, timeout_s: float, purpose: str, doing: str, fix: str, label: str | None = None
) -> list:
    """Every rank's ``value`` (JSON-able), exchanged through the store, in rank order.

    The n-th call of a rank for ``purpose`` meets every other rank's n-th call for it. A rank that
    does not come within ``timeout_s`` (it skipped the call, or took another code path) makes a
    ``RankDivergenceError`` here, on the ranks that came, naming the missing ones, instead of a
    collective that waits for it until the process group's timeout; a rank that already gave up
    elsewhere (its abort note) ends the wait at once. Uses the store, not a collective, so that a
    missing rank is a timeout and not a hang.
    """
    if group.world_size == 1:
        return [value] if label is None else [(value, label)]
    return exchange_through(default_store(), value, group, timeout_s, purpose, doing, fix, label)


def next_number(purpose: str, group: DataParallelGroup) -> int:
    """This rank's next number for ``purpose`` (1, 2, ...), counted in the store: ranks that number the
    same things in the same order give each the same number, with no exchange (an agreement then
    compares them). A world of one counts nothing: 0."""
    if group.world_size == 1:
        return 0
    return default_store().add(f"zcompile/{purpose}/{group.name}/numbered/{group.rank}", 1)


def names_digest(names: Iterable[str]) -> str:
    """A short stand-in for a list of names (parameters, ways of holding them) that the ranks compare
    through the store: one value however long the list (a LoRA model's frozen base has thousands)."""
    return hashlib.sha1("\n".join(names).encode()).hexdigest()[:16]


def agree_on_store(
    value: Any,
    group: DataParallelGroup,
    timeout_s: float,
    purpose: str,
    doing: str,
    fix: str,
    differ: Callable[[list], str],
) -> None:
    """``exchange_on_store``, then a ``RankDivergenceError`` on every rank unless every rank passed the
    same ``value``: ``differ(per_rank)`` says how they differ (a rank entering a collective context with
    other arguments, other models)."""
    per_rank = exchange_on_store(value, group, timeout_s, purpose, doing, fix)
    if any(other != value for other in per_rank):
        raise RankDivergenceError(differ(per_rank))


def exchange_through(
    store: dist.Store,
    value: Any,
    group: DataParallelGroup,
    timeout_s: float,
    purpose: str,
    doing: str,
    fix: str,
    label: str | None = None,
) -> list:
    """``exchange_on_store`` on a given ``store``.

    Each rank writes its value into its slot, offers the digest of its value as the call's first
    (``compare_set``: it gets back the first rank's, and marks the call "values differ" when that is
    not its own) and counts itself among the arrived. The last to arrive reads the mark and sets the
    call's "everyone is here" key, which every other rank waits for, then reads the mark too. When the
    ranks agree (the normal case) the values are this rank's own, and no rank reads the others': a
    rank's requests are the same few whatever the number of ranks, so the exchange may run at every
    training step, and at every layer (reading every rank's value on every rank is N^2 through the one
    store: a million reads a step at 1,024 ranks). Only when values differ does each rank read them
    all, to name the difference.

    Five round trips a call, as blocks compiled apart make one exchange per layer (a store's ``set`` is
    not answered, the other requests are): this rank's count, the first digest, the arrival, then the
    wait and the mark, or, for the last to arrive, the mark and deleting the "everyone" key of the call
    before (every rank has passed it, since all arrived here). The first digest and the arrival count
    live in two slots, alternating, that the last to arrive resets by a ``set`` (two calls later every
    rank has passed this one), and each rank's value in two of its own, written over; so does a call
    whose values differ, whose last reader deletes its keys. It made ten round trips a call until
    2026-11-28 (a digest's count, two reads of it, every rank deleting its four keys of two calls
    before after reading its old value): on 2 CPU ranks an exchange took 0.64 ms with the ranks in
    step and 1.29 ms between layers' work, now 0.34 and 0.58.

    ``label``: this rank's words for its call, not compared (they may differ between agreeing ranks);
    given one, each entry is ``(value, label)``, with every rank's label when the values differ and
    this rank's own when they agree (no rank reads the others' then)."""
    # the counter lives in the store, so it survives torch._dynamo.reset() and needs no global
    sequence = store.add(_sequence_key(purpose, group), 1)
    own_slot = _value_slot(purpose, group, sequence, group.rank)  # the others' named only where read
    text = json.dumps(value)
    if label is not None:  # before the value: a rank that reads values may read labels
        store.set(_label_key(own_slot), _stamped(sequence, label))
    store.set(own_slot, _stamped(sequence, text))
    first, arrived, everyone, differ = _call_keys(purpose, group, sequence)
    digest = hashlib.sha1(text.encode()).hexdigest()[:16]
    if store.compare_set(first, "", digest).decode() != digest:
        store.set(differ, "1")  # before arriving: once everyone has arrived, the mark is there if it will be
    where = f"{doing}: rank {group.rank} (its call #{sequence})"
    try:
        if store.add(arrived, 1) == group.world_size:
            agreed = not store.check([differ])
            store.set(everyone, "1")
            store.set(arrived, "0")  # the slots' next call is two calls on: every rank has passed this one then
            store.set(first, "")
            if sequence > 1:
                store.delete_key(_call_keys(purpose, group, sequence - 1)[2])
        else:
            _wait_for_ranks(
                store, everyone, lambda: _missing(store, purpose, group, sequence), group, timeout_s, where, fix
            )
            agreed = not store.check([differ])
        if agreed:
            mine = json.loads(text)
            return [mine] * group.world_size if label is None else [(mine, label)] * group.world_size
        slots = [_value_slot(purpose, group, sequence, rank) for rank in range(group.world_size)]
        values = [json.loads(_slot_value(raw, sequence)) for raw in store.multi_get(slots)]
        labels = (
            [_slot_value(raw, sequence) for raw in store.multi_get([_label_key(slot) for slot in slots])]
            if label is not None
            else []
        )
        if store.add(f"{differ}/read", 1) == group.world_size:  # the last reader deletes the call's own keys
            for key in (differ, everyone, f"{differ}/read"):
                store.delete_key(key)
    except dist.DistNetworkError as error:
        # the store's host ended while this rank waited or read: without torchrun's agent (which hosts
        # it) that is rank 0's process, which leaves as soon as it has raised the divergence it found
        raise RankDivergenceError(
            f"{where} lost the store the ranks meet through: the process that hosts it (rank 0's, unless "
            f"torchrun's agent hosts it) has ended, most likely with an error of its own: read that rank's "
            f"error. {fix}"
        ) from error
    return values if label is None else list(zip(values, labels))


def _call_keys(purpose: str, group: DataParallelGroup, sequence: int) -> tuple[str, str, str, str]:
    """The keys of one call every rank writes: the first digest offered and the count of ranks arrived
    (slots, reset for the call two on), the "everyone is here" key and the "values differ" mark."""
    base = f"zcompile/{purpose}/{group.name}"
    slot = f"{base}/slot{sequence % 2}"
    return f"{slot}/first", f"{slot}/arrived", f"{base}/{sequence}/everyone", f"{base}/{sequence}/differ"


def _stamped(sequence: int, text: str) -> str:
    """A slot's content: the call it was written at, then the value (``_written``)."""
    return f"{sequence}\n{text}"


def _written(raw: bytes) -> tuple[int, str]:
    """A slot's call number and value (``_stamped``)."""
    written, _, value = raw.decode().partition("\n")
    return int(written), value


def _slot_value(raw: bytes, sequence: int) -> str:
    """A slot's value written at call ``sequence`` (every rank wrote it before arriving; one written at
    another call is a rank whose exchanges are out of step with this one's)."""
    written, value = _written(raw)
    if written != sequence:
        raise RankDivergenceError(
            f"zcompile: a rank's value read at its exchange #{sequence} was written at "
            f"its #{written}: the ranks' exchanges are out of step"
        )
    return value


def exchanges_made(group: DataParallelGroup, purpose: str) -> int:
    """How many exchanges for ``purpose`` this rank has made in ``group`` (``exchange_on_store``'s
    counter, read without moving it: one store request); 0 on one rank, where none is made."""
    if group.world_size == 1:
        return 0
    return default_store().add(_sequence_key(purpose, group), 0)


def _sequence_key(purpose: str, group: DataParallelGroup) -> str:
    return f"zcompile/{purpose}/{group.name}/sequence/{group.rank}"


def _value_slot(purpose: str, group: DataParallelGroup, sequence: int, rank: int) -> str:
    """``rank``'s slot for its value at call ``sequence``: two per rank, alternating. A rank writes
    over its value of two calls before, which no rank reads any more (every rank arrived at the call
    between, so has finished that one)."""
    return f"zcompile/{purpose}/{group.name}/slot{sequence % 2}/{rank}"


def _label_key(key: str) -> str:
    return f"{key}/label"


def _fix_for(fix: str, missing: list) -> str:
    """``fix``, or a compile's when a missing rank waits in a compile's rank check: it compiled a graph
    the others did not (a recompile of its own, its inputs' shapes changed), and the fix is about that,
    whatever this rank was doing."""
    if any((state.blocked_in or "").startswith(COMPILE_CHECK) for state in missing):
        return CHECK_FIX
    return fix


def _wait_for_ranks(
    store: dist.Store,
    everyone: str,
    missing: Callable[[], list[int]],
    group: DataParallelGroup,
    timeout_s: float,
    where: str,
    fix: str,
) -> None:
    """Returns once ``everyone`` is set; raises when the time is up (naming the ranks that have not
    arrived, ``missing()``, and what each is doing) or another rank left an abort note. Time is up
    only for ranks that wait in zcompile too, or stopped beating: one that beats and runs its own code
    (an evaluation or a checkpoint on one rank) is waited for, with a warning each ``timeout_s``
    (``zcompile.agreement.heartbeat``), up to the process group's timeout (how long DDP's next collective would
    wait): never forever."""
    with blocked(where, exchange_group=str(group.name)):
        deadline = time.monotonic() + timeout_s
        try:
            store.wait([everyone], timedelta(seconds=min(FIRST_WAIT_S, timeout_s)))
            return
        except dist.DistStoreError:  # a timeout: c10d has printed a warning about it
            log.info("%s: waiting for ranks %s for up to %.0fs more", where, missing(), deadline - time.monotonic())
        started = looked = time.monotonic()
        patience_s = max(timeout_s, process_group_timeout_s(group))
        before = first_look = rank_states(store, group, missing())
        global_rank = dist.get_rank() if dist.is_initialized() else group.rank
        while True:
            while time.monotonic() < deadline:
                if store.check([everyone]):
                    return
                note = abort_note(store, group)
                if note is not None and note[0] != group.rank:
                    raise RankDivergenceError(f"{where} stopped waiting: rank {note[0]} reported: {note[1]}")
                if time.monotonic() - looked >= BEAT_S:  # once a beat: do the missing ranks wait for this one?
                    looked, now = time.monotonic(), rank_states(store, group, missing())
                    if any(state.ended for state in now):
                        tell_others_and_raise(
                            store,
                            group,
                            f"{where} got there but ranks {missing()} "
                            f"did not, and will not ({describe_all(now)}). "
                            f"{_fix_for(fix, now)}",
                        )
                    if waiting_on_each_other(now, first_look, group.name, global_rank):
                        tell_others_and_raise(
                            store,
                            group,
                            f"{where} got there but ranks {missing()} "
                            f"wait elsewhere ({describe_all(now)}): each waits for "
                            f"the other. {_fix_for(fix, now)}",
                        )
                time.sleep(min(POLL_S, max(deadline - time.monotonic(), 0.0)))
            if store.check([everyone]):
                return
            now, waited = rank_states(store, group, missing()), time.monotonic() - started
            if not busy_with_own_work(before, now):
                break
            if waited >= patience_s:
                tell_others_and_raise(
                    store,
                    group,
                    f"{where} got there but ranks {missing()} did not "
                    f"within {waited:.0f}s, the process group's timeout "
                    f"({describe_all(now)}: busy, or stuck in code of their own). "
                    f"{_fix_for(fix, now)}",
                )
            log.warning(
                "%s: ranks %s have not come after %.0fs; they are alive and running code of their own "
                "(an evaluation or a checkpoint on some ranks only?), so this rank waits on, up to the "
                "process group's timeout (%.0fs)",
                where,
                [state.rank for state in now],
                waited,
                patience_s,
            )
            before, deadline = now, time.monotonic() + min(timeout_s, max(patience_s - waited, 0.0))
        tell_others_and_raise(
            store,
            group,
            f"{where} got there but ranks {missing()} did not within "
            f"{timeout_s:.0f}s ({describe_all(now)}). {_fix_for(fix, now)}",
        )


def _missing(store: dist.Store, purpose: str, group: DataParallelGroup, sequence: int) -> list[int]:
    """The ranks whose slot does not hold a value of call ``sequence`` yet: they have not arrived."""

    def arrived(slot: str) -> bool:
        return store.check([slot]) and _written(store.get(slot))[0] == sequence

    return [rank for rank in range(group.world_size) if not arrived(_value_slot(purpose, group, sequence, rank))]
