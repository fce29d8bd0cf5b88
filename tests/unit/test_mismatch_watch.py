"""``zcompile.agreement.mismatch_watch``: a rank waiting in a ``torch.distributed`` call of its own code while
another waits in a compiled graph's collective that needs it (a deadlock no exchange sees) ends its
process with a note the other quotes; anything short of that proof leaves it waiting.

Driven by hand on an in-process store: the other rank's beats are written as its heartbeat writes
them, and the watch is given the time, so no test waits."""

import json

import pytest
import torch.distributed as dist

from zcompile.agreement.abort_note import abort_note
from zcompile.agreement.mismatch_watch import MismatchWatch
from zcompile.agreement.rank_state import StackWait, alive_key
from zcompile.common.process_group import DataParallelGroup

BARRIER = StackWait("torch.distributed's barrier (called at train.py:9) over ranks [0, 1]", (0, 1), since=100.0)
IN_GRAPH = {
    "blocked_in": "a compiled backward, in all_to_all_single (<eval_with_key>.5:275) over ranks [0, 1]",
    "for_s": 4.0,
    "collective_ranks": [0, 1],
    "compiled_collective": True,
    "collective_group": "0",
}


def _beat(store, count: int, state: dict) -> None:
    store.set(alive_key(1), json.dumps({"beat": count, **state}))


def _watch_rank0(store, rank1_states: list[dict], times=(101.0, 102.0, 104.0)) -> list[int]:
    """Rank 0 waits in a barrier; before each of its looks rank 1 beats once more (its next state)."""
    ended = []
    watch = MismatchWatch(store=store, rank=0, end_process=ended.append)
    for count, (now, state) in enumerate(zip(times, rank1_states), start=5):
        _beat(store, count, state)
        watch.look(BARRIER, now)
    return ended


def test_a_barrier_against_a_compiled_collective_that_needs_it_ends_the_process_with_a_note():
    store = dist.HashStore()
    # 101 s: a beat since the wait began, before the first look; 102 s: the beats recorded; 104 s: fresh
    assert _watch_rank0(store, [IN_GRAPH] * 3) == [1]
    rank, message = abort_note(store, DataParallelGroup(rank=1, world_size=2, name="0", process_group=None))
    assert rank == 0
    assert message.startswith(
        "zcompile: rank 0 has waited 4s in torch.distributed's barrier (called at train.py:9) "
        "over ranks [0, 1], and rank 1 in a compiled backward, in all_to_all_single"
    )
    assert "different collectives, which never match" in message and "the same number of batches" in message


@pytest.mark.parametrize(
    "case",
    [
        "another torch.distributed call",
        "a collective without rank 0",
        "a stale beat",
        "waited under a beat",
        "running its own code",
    ],
)
def test_anything_short_of_a_proof_leaves_the_rank_waiting(case):
    state = {
        "another torch.distributed call": {**IN_GRAPH, "compiled_collective": False},
        "a collective without rank 0": {**IN_GRAPH, "collective_ranks": [1, 2]},
        "a stale beat": IN_GRAPH,
        "waited under a beat": {**IN_GRAPH, "for_s": 1.0},
        "running its own code": {"blocked_in": None, "for_s": 0.0},
    }[case]
    store = dist.HashStore()
    if case == "a stale beat":  # written once, before rank 0's wait; rank 1 beats no more
        ended = []
        watch = MismatchWatch(store=store, rank=0, end_process=ended.append)
        _beat(store, 5, state)
        for now in (102.0, 104.0, 108.0):
            watch.look(BARRIER, now)
    else:
        ended = _watch_rank0(store, [state] * 3)
    assert ended == []
    assert abort_note(store, DataParallelGroup(rank=1, world_size=2, name="0", process_group=None)) is None


def test_zcompiles_own_waits_and_calls_on_unknown_groups_are_not_watched():
    """A compiled graph's wait is the other side (its rank raises when this one leaves); a call that
    names its group may wait for ranks that are not these: neither reads any beat."""
    store, ended = dist.HashStore(), []
    watch = MismatchWatch(store=store, rank=0, end_process=ended.append)
    for count, now in enumerate((102.0, 104.0, 108.0)):
        _beat(store, count, IN_GRAPH)
        watch.look(StackWait("all_gather (x.py:3) over ranks [0, 1]", (0, 1), 100.0, compiled=True), now)
        watch.look(StackWait("torch.distributed's all_reduce (called at t.py:4)", None, 100.0), now)
    assert ended == []


class _CountingStore:
    def __init__(self, store):
        self.store, self.reads = store, 0

    def check(self, keys):
        return self.store.check(keys)

    def multi_get(self, keys):
        self.reads += 1
        return self.store.multi_get(keys)


def test_the_looks_thin_out_as_a_legitimate_wait_goes_on():
    """Rank 1 runs its own code (rank 0 writing a checkpoint alone is the barrier's usual reason): in 30
    minutes of barrier, rank 0 reads the beats a few dozen times, not once a beat (900)."""
    store = _CountingStore(dist.HashStore())
    watch = MismatchWatch(store=store, rank=0, end_process=lambda code: pytest.fail("ended a legitimate wait"))
    now, count = 100.0, 0
    while now < 100.0 + 1800:
        now, count = now + 2.0, count + 1
        _beat(store.store, count, {"blocked_in": None, "for_s": 0.0})
        watch.look(BARRIER, now)
    assert 5 < store.reads <= 40, store.reads
