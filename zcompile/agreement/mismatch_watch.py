"""Ends a deadlock that no exchange of the ranks sees: this rank waits in a ``torch.distributed``
call of its own code (``dist.barrier()``) while another rank waits in a compiled graph's collective
that needs this rank.

The usual cause is data of uneven length at the end of an epoch: rank 0 runs out of batches and
reaches the ``dist.barrier()`` after the loop, while rank 1 runs one more step, whose backward's
reduce-scatters (stage 2) or forward's all-gathers (stage 3) wait for rank 0. Neither rank is in
one of zcompile's exchanges, whose timeouts end every other divergence, and gloo waits for the
process group's timeout (30 min by default), as it would under DDP.

Each rank's heartbeat (``zcompile.agreement.heartbeat``) says what it waits in. A rank that has waited in a
``torch.distributed`` call on a group it knows (the default one: the call names no group) reads the
beats of that group's other ranks, once it has waited a beat, then less and less often (a long barrier
is often legitimate: rank 0 writing a checkpoint). One whose fresh beat says it has waited a beat or
more in a compiled graph's collective over a group holding this rank can never finish it: this rank
will not join that collective while it waits in its own, and the other will not join this one.
This rank's call is the user's and cannot be made to raise, so it leaves the abort note, logs the
error and ends its process, as torch's NCCL watchdog ends a process whose collective timed out; the
other rank's collective then fails, and it raises ``RankDivergenceError`` quoting the note.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

from zcompile.agreement.abort_note import leave_abort_note
from zcompile.agreement.rank_state import BEAT_S, RankState, StackWait, alive_key, beat_counts
from zcompile.common.process_group import DataParallelGroup

log = logging.getLogger(__name__)

FIRST_LOOK_S = BEAT_S  # the first look records the beats; the next, with fresh ones, can decide
LONGEST_GAP_S = 60.0  # between looks, however long the wait: 1,000 ranks in a long barrier read little


@dataclass(eq=False)
class MismatchWatch:
    """One rank's watch, called by its heartbeat each beat with what its stack waits in."""

    store: dist.Store  # the heartbeat's own client
    rank: int  # global rank
    end_process: Callable[[int], None] = os._exit
    _since: float | None = None  # the wait being watched (its StackWait.since)
    _next_look: float = 0.0
    _beats: dict[int, int | None] = field(default_factory=dict)  # the others' beat counts at the last look

    def look(self, waiting: StackWait | None, now: float) -> None:
        if waiting is None or waiting.compiled or waiting.ranks is None:
            self._since = None  # zcompile's own collectives: their rank raises; another group: unknown
            return
        if self._since != waiting.since:
            self._since, self._next_look, self._beats = waiting.since, waiting.since + FIRST_LOOK_S, {}
        if now < self._next_look:
            return
        self._next_look = now + min(max(now - waiting.since, BEAT_S), LONGEST_GAP_S)  # the gaps double
        others = [rank for rank in waiting.ranks if rank != self.rank]
        keys = [alive_key(rank) for rank in others]
        if not others or not self.store.check(keys):  # a rank that never beat: nothing to compare
            return
        states = [
            RankState.from_beat(rank, json.loads(value)) for rank, value in zip(others, self.store.multi_get(keys))
        ]
        earlier, self._beats = self._beats, beat_counts(states)
        for state in states:  # a beat written while this rank waited, in a compiled graph's collective with it
            if state.beat_since(earlier) and state.compiled_collective and state.in_collective_of(self.rank):
                self._end(waiting, now, state)
                return

    def _end(self, waiting: StackWait, now: float, other: RankState) -> None:
        message = (
            f"zcompile: rank {self.rank} has waited {now - waiting.since:.0f}s in {waiting.call}, and rank "
            f"{other.rank} in {other.blocked_in} (for {other.for_s:.0f}s): different collectives, which "
            f"never match, so both would wait until the process group's timeout. Most often one rank ran "
            f"more training steps than another (data of uneven length: give every rank the same number of "
            f"batches, as DistributedSampler does) or skipped a call the others made. Rank {self.rank} ends its "
            f"process now; the others raise quoting this."
        )
        ranks = other.collective_ranks
        group = DataParallelGroup(
            rank=ranks.index(self.rank), world_size=len(ranks), name=other.collective_group, process_group=None
        )
        leave_abort_note(group, message, self.store)  # under the group the other rank's graph quotes
        log.error("%s", message)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        self.end_process(1)
