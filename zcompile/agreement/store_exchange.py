"""The store exchange every cross-rank agreement shares (compiles, calls, steps, ``gathered``,
checkpoints): each rank publishes a value in the process group's key-value store and waits, with a
timeout, for the others'. The store rather than a collective, so that a rank that never comes is a
``RankDivergenceError`` on every rank that came, naming it and what it is doing (its heartbeat), not
a hang; a rank that raises first leaves an abort note the others stop on."""

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
from zcompile.agreement.fixes import choose as choose_fix
from zcompile.agreement.heartbeat import blocked
from zcompile.agreement.rank_state import BEAT_S, busy_with_own_work, describe_all, rank_states, waiting_on_each_other
from zcompile.common.process_group import DataParallelGroup, default_store, process_group_timeout_s

log = logging.getLogger(__name__)


FIRST_WAIT_S = 1.0  # one store.wait, notified at once: ranks that arrive within it cost no polling
POLL_S = 0.25  # then store.check every POLL_S (a timed-out store.wait prints c10d warnings each time)
# answered store requests per rank in one exchange whose ranks agree (``exchange_through``): what an
# exchange costs the one store server at N ranks, 5N requests (``zcompile.simulate`` prices it)
ANSWERED_REQUESTS_PER_EXCHANGE = 5


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
    whose values differ, whose last reader deletes its keys.

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


def _fix_for(fix: str, where: str, missing: list) -> str:
    """The fix for ranks ``missing`` that did not come where this rank waits (``where``): the pattern's,
    from what each waits in (``fixes.choose``), else ``fix``."""
    return choose_fix(fix, where, [state.blocked_in for state in missing], torch.is_grad_enabled())


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
                            f"{_fix_for(fix, where, now)}",
                        )
                    if waiting_on_each_other(now, first_look, group.name, global_rank):
                        tell_others_and_raise(
                            store,
                            group,
                            f"{where} got there but ranks {missing()} "
                            f"wait elsewhere ({describe_all(now)}): each waits for "
                            f"the other. {_fix_for(fix, where, now)}",
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
                    f"{_fix_for(fix, where, now)}",
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
            f"{timeout_s:.0f}s ({describe_all(now)}). {_fix_for(fix, where, now)}",
        )


def _missing(store: dist.Store, purpose: str, group: DataParallelGroup, sequence: int) -> list[int]:
    """The ranks whose slot does not hold a value of call ``sequence`` yet: they have not arrived."""

    def arrived(slot: str) -> bool:
        return store.check([slot]) and _written(store.get(slot))[0] == sequence

    return [rank for rank in range(group.world_size) if not arrived(_value_slot(purpose, group, sequence, rank))]
