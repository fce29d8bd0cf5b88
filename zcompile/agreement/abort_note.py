"""The abort note: a rank that raises a ``RankDivergenceError`` leaves its message in the store, so
every other rank, waiting in an exchange or a collective, raises the same error within seconds."""

from __future__ import annotations

import json
import logging
from typing import NoReturn

import torch.distributed as dist

from zcompile.agreement.rank_state import describe_all, rank_states
from zcompile.common.process_group import DataParallelGroup, default_store

log = logging.getLogger(__name__)


class RankDivergenceError(RuntimeError):
    """The ranks would issue different collectives (and deadlock) if the job went on."""


def raise_if_aborted(group: DataParallelGroup, error: BaseException | None = None) -> None:
    """Raises ``RankDivergenceError`` (from ``error``) when a rank of ``group`` left an abort note.

    For code that caught a failed collective: the other rank probably left because it found the
    ranks diverged, and its reason is more useful than "connection closed". Does nothing when there
    is no note or the store cannot be read (the rank holding it may be gone).
    """
    if group.world_size == 1 or not dist.is_initialized():
        return
    note = abort_note(default_store(), group)
    if note is not None and note[0] != group.rank:  # this rank's own note: its own error says it
        rank, message = note
        raise RankDivergenceError(
            f"zcompile: rank {group.rank} stopped because rank {rank} reported: {message}"
        ) from error


def raise_naming_the_others(group: DataParallelGroup, what: str, error: BaseException) -> None:
    """For a collective of ``what`` (a compiled graph) that failed with no abort note to quote: a
    ``RankDivergenceError`` (from ``error``) naming what the other ranks' beats say they were doing,
    where the backend's text (gloo's "Timed out waiting 90000ms", "Connection closed by peer") says
    nothing of who did not come. Does nothing for an error that is not a collective's."""
    text = str(error)
    failed_collective = isinstance(error, dist.DistError) or any(
        mark in text for mark in ("Timed out", "Connection closed", "gloo", "NCCL")
    )
    if group.world_size == 1 or not dist.is_initialized() or not failed_collective:
        return
    try:
        others = describe_all(
            rank_states(default_store(), group, [r for r in range(group.world_size) if r != group.rank])
        )
    except Exception:  # the store may be gone with the rank that held it
        return
    first_line = next((line for line in text.splitlines() if line.strip()), text)
    message = (
        f"zcompile: rank {group.rank}: a collective of {what} failed ({first_line[:200]}) while {others}. A rank "
        "held up before its compiled call (a slow data loader, work of its own) or gone makes the others' "
        "collectives time out: give every rank the same work between steps, or raise the process group's "
        "timeout (init_process_group(timeout=...))."
    )
    leave_abort_note(group, message)
    raise RankDivergenceError(message) from error


def abort_note(store: dist.Store, group: DataParallelGroup) -> tuple[int, str] | None:
    """``(rank, message)`` of the abort note of ``group``, or None (no note, or no store to read it from)."""
    try:
        if not store.check([abort_key(group)]):
            return None
        rank, message = json.loads(store.get(abort_key(group)))
    except Exception:  # the store may be gone with the rank that held it
        log.debug("could not read the abort note of group %s", group.name, exc_info=True)
        return None
    return rank, message


def abort_key(group: DataParallelGroup) -> str:
    return f"zcompile/abort/{group.name}"


# the first note of any group, with the global rank that left it: what every process's heartbeat reports
# (``heartbeat.Heartbeat``), so that a rank failing in a collective of its own learns why the peer left
FIRST_NOTE_KEY = "zcompile/abort/first"


def first_note(store: dist.Store) -> tuple[int, str] | None:
    """``(global rank, message)`` of the first abort note left in any group, or None."""
    try:
        if not store.check([FIRST_NOTE_KEY]):
            return None
        rank, message = json.loads(store.get(FIRST_NOTE_KEY))
    except Exception:  # the store may be gone with the rank that held it
        return None
    return rank, message


def tell_others_and_raise(store: dist.Store | None, group: DataParallelGroup, message: str) -> NoReturn:
    """Leaves the abort note (the first one stays: it names the cause), then raises ``message``."""
    leave_abort_note(group, message, store)
    raise RankDivergenceError(message)


def leave_abort_note(group: DataParallelGroup, message: str, store: dist.Store | None = None) -> None:
    """Tells the other ranks of ``group`` why this one stops (the first note stays: it names the cause):
    a rank waiting on the store, or whose collective failed as this rank left, raises quoting it
    (``raise_if_aborted``) instead of "connection closed". For an error this rank raises that the others
    do not, before a collective they are already in."""
    if group.world_size == 1 or (store is None and not dist.is_initialized()):
        return
    try:
        store = store or default_store()
        store.compare_set(abort_key(group), "", json.dumps([group.rank, message]))
        store.compare_set(FIRST_NOTE_KEY, "", json.dumps([dist.get_rank() if dist.is_initialized() else 0, message]))
    except Exception:  # the store may be gone with the rank that held it; this rank's own error still tells
        log.debug("could not leave the abort note for group %s", group.name, exc_info=True)
