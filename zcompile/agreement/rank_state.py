"""What each rank's heartbeat says, read back by the others: its beat count, what it waits in and for
how long. Shared by the beat (``heartbeat``), the store exchange (``store_exchange``) and the deadlock
watch (``mismatch_watch``)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch.distributed as dist

BEAT_S = 2.0  # a beat's period; a rank is alive when its count moved within a wait's timeout


@dataclass(frozen=True)
class StackWait:
    """A wait seen on the training thread's stack."""

    call: str  # what it waits in, for the messages
    ranks: tuple[int, ...] | None  # the global ranks of the collective's group; None: not known
    since: float  # when a beat first saw it
    compiled: bool = False  # a compiled graph's collective (else a torch.distributed call)
    group_name: str | None = None  # the compiled collective's group, as its code names it


def alive_key(global_rank: int) -> str:
    return f"zcompile/alive/{global_rank}"


@dataclass(frozen=True)
class RankState:
    """What a rank's last beat said (``beat`` None: it never beat)."""

    rank: int  # in the waiting group
    beat: int | None
    blocked_in: str | None
    for_s: float
    exchange_group: str | None = None
    collective_ranks: tuple[int, ...] | None = None  # the global ranks of the collective it waits for
    compiled_collective: bool = False  # that collective is a compiled graph's
    collective_group: str | None = None  # its group's name, as the graph's code names it
    ended: bool = False  # its process has ended (its last beat, written at exit)

    @classmethod
    def from_beat(cls, rank: int, value: dict) -> RankState:
        ranks = value.get("collective_ranks")
        return cls(
            rank,
            value["beat"],
            value["blocked_in"],
            value["for_s"],
            value.get("exchange_group"),
            tuple(ranks) if ranks is not None else None,
            bool(value.get("compiled_collective")),
            value.get("collective_group"),
            bool(value.get("ended")),
        )

    def beat_since(self, earlier: dict[int, int | None]) -> bool:
        """Whether this beat was written after ``earlier`` (rank -> beat count, ``beat_counts``) was read."""
        before = earlier.get(self.rank)
        return self.beat is not None and before is not None and self.beat > before

    def stuck(self) -> bool:
        """Blocked in one wait for a beat or more (a rank busy with its own work passes through many)."""
        return self.blocked_in is not None and self.for_s >= BEAT_S

    def in_collective_of(self, global_rank: int) -> bool:
        """Stuck in a collective whose group holds ``global_rank``: it cannot end while that rank waits
        elsewhere."""
        return self.stuck() and global_rank in (self.collective_ranks or ())

    def describe(self) -> str:
        if self.beat is None:
            return f"rank {self.rank} has not started zcompile's beat"
        if self.ended:
            return f"rank {self.rank} has ended its process"
        if self.blocked_in is None:
            return f"rank {self.rank} is alive, running its own code"
        return f"rank {self.rank} waits in {self.blocked_in} (for {self.for_s:.0f}s)"


def rank_states(store: dist.Store, group, ranks: list[int]) -> list[RankState]:
    """The last beat of each of ``ranks`` (ranks of ``group``, a ``DataParallelGroup``)."""
    global_ranks = [
        dist.get_global_rank(group.process_group, r) if group.process_group is not None else r for r in ranks
    ]
    states = []
    for rank, global_rank in zip(ranks, global_ranks):
        key = alive_key(global_rank)
        if not store.check([key]):
            states.append(RankState(rank, None, None, 0.0))
            continue
        states.append(RankState.from_beat(rank, json.loads(store.get(key))))
    return states


def beat_counts(states: list[RankState]) -> dict[int, int | None]:
    return {state.rank: state.beat for state in states}


def describe_others(store: dist.Store, global_ranks, own_rank: int) -> str:
    """What the beats of ``global_ranks`` other than ``own_rank`` say each does (global ranks)."""
    states = []
    for rank in global_ranks:
        if rank == own_rank:
            continue
        key = alive_key(rank)
        states.append(
            RankState.from_beat(rank, json.loads(store.get(key)))
            if store.check([key])
            else RankState(rank, None, None, 0.0)
        )
    return describe_all(states)


def describe_all(states: list[RankState]) -> str:
    return "; ".join(state.describe() for state in states)


def waiting_on_each_other(
    missing: list[RankState], first_look: list[RankState], group_name: str | None, global_rank: int
) -> bool:
    """Whether every missing rank waits for this one, which waits for it, so neither will ever come:
    no timeout needs to pass. A missing rank waits for this one when it has waited, for a beat or more,
    - in another exchange of this group's ranks than the one this rank waits in (it would be counted
      as arrived in this one): ``if rank == 0: zcompile.checkpoint.save(...)`` while the others are at
      stage 1's ``optimizer.step()``; an exchange of another group may end without this rank;
    - or in a collective whose group holds this rank (``global_rank``), which this rank, waiting here,
      has not joined: the same save at stages 2-3, where the others wait in the next backward's
      reduce-scatters; ``gathered()`` or a stage-3 evaluation on one rank; the others' ``dist.barrier()``.
    Only beats written after ``first_look`` (read while this rank already waited here) count: an
    older one may show a wait that this rank ended just before it came here."""
    earlier = beat_counts(first_look)

    def waits_for_this_rank(state: RankState) -> bool:
        if not state.beat_since(earlier):
            return False
        if state.collective_ranks is not None:
            return state.in_collective_of(global_rank)
        return state.stuck() and state.exchange_group is not None and state.exchange_group == str(group_name)

    return bool(missing) and all(waits_for_this_rank(state) for state in missing)


def busy_with_own_work(before: list[RankState], now: list[RankState]) -> bool:
    """Whether every rank of ``now`` beat since ``before`` and is not stuck: blocked in nothing, or in
    one call for less than a beat (a rank evaluating alone through the compiled model passes through
    many short compiled calls; one stuck in a collective stays in the same one)."""
    earlier = beat_counts(before)
    return bool(now) and all(state.beat_since(earlier) and not state.stuck() for state in now)
