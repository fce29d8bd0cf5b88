"""A heartbeat per process: which ranks are alive, and what each waits in: a rank busy with its own work is not a divergence.

The ranks meet through the store with a timeout (``rank_check.exchange_on_store``), so a rank that
never comes is an error in seconds, not a hang. But a rank can be late for a good reason: an
evaluation, a checkpoint written or an upload made by rank 0 alone, minutes long, while the others
wait at the next ``optimizer.step()``. DDP waits there (its next collective waits for the process
group's timeout); zcompile raised ``RankDivergenceError`` after ``check_timeout_s`` (60 s), ending a
run that was fine.

So each process beats: a daemon thread writes, every ``BEAT_S``, its count of beats and what the
training thread is blocked in, under ``zcompile/alive/{global rank}``: zcompile's own waits (an
exchange of the ranks, a compiled graph's collectives: marked by ``blocked``), or a call into
``torch.distributed`` seen in that thread's stack for two beats in a row (the user's
``dist.barrier()``, a checkpoint's collectives). A rank whose wait times out reads the missing
ranks' beats: one that beats and is blocked in nothing runs code of its own, and the wait goes on
(with a warning each ``check_timeout_s``); one blocked in a wait of its own (a divergence: each
waits for the other), or that stopped beating (dead, or frozen), is the error as before.

What it cannot see: a rank blocked in an inductor-compiled backward's collectives (its frames are
not zcompile's) looks busy; the wait then lasts until the process group's timeout ends that rank
(its beats stop), as DDP's would.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from zcompile.process_group import default_store

log = logging.getLogger(__name__)

BEAT_S = 2.0  # a beat's period; a rank is alive when its count moved within a wait's timeout
_DISTRIBUTED_DIR = os.path.join("torch", "distributed", "")
THREAD_NAME = "zcompile-heartbeat"


@dataclass(eq=False)
class Heartbeat:
    """This process's beat (one per process, found through its thread: no module-level registry)."""

    store: dist.Store  # the beating thread's own client of the store (a clone: requests never interleave)
    rank: int  # global rank
    blocked_in: str | None = None  # what the training thread waits in, inside zcompile; None: its own code
    blocked_since: float = 0.0
    # blocked_in is an exchange of the ranks of this group (rank_check), which needs all of them; None: not one
    exchange_group: str | None = None
    beats: int = 0
    thread_id: int = field(default_factory=threading.get_ident)  # the training thread: the one that made it
    _in_distributed: tuple[str, float] | None = field(default=None, repr=False)  # (call, first seen)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _stopped: threading.Event = field(default_factory=threading.Event, repr=False)

    def beat_forever(self) -> None:
        while not self._stopped.is_set():
            self.beats += 1
            call = _distributed_call(sys._current_frames().get(self.thread_id))
            now = time.monotonic()
            if call is None or self._in_distributed is None or self._in_distributed[0] != call:
                self._in_distributed = None if call is None else (call, now)
            with self._lock:
                if self.blocked_in is not None:
                    state = {"blocked_in": self.blocked_in, "for_s": now - self.blocked_since,
                             "exchange_group": self.exchange_group}
                elif self._in_distributed is not None and now - self._in_distributed[1] >= BEAT_S:
                    state = {"blocked_in": self._in_distributed[0], "for_s": now - self._in_distributed[1]}
                else:  # in no call, or in one seen once: a rank busy with its own work passes through many
                    state = {"blocked_in": None, "for_s": 0.0}
            state = {"beat": self.beats, **state, "for_s": round(state["for_s"], 1)}
            try:
                self.store.set(alive_key(self.rank), json.dumps(state))
            except Exception:  # the store's host is gone: the job is ending, the training thread will say why
                return
            self._stopped.wait(BEAT_S)

    def stop(self, thread: threading.Thread) -> None:
        """Ends the beat (at exit: a daemon thread inside a store call while the interpreter tears down
        torch's objects could crash the process on its way out)."""
        self._stopped.set()
        thread.join(timeout=BEAT_S)

    @contextlib.contextmanager
    def blocked(self, what: str, exchange_group: str | None = None):
        """The training thread waits in ``what`` (zcompile's; ``exchange_group``: an exchange of that
        group's ranks) until the block ends; nested blocks keep the outer."""
        if self.blocked_in is not None:
            yield
            return
        with self._lock:
            self.blocked_in, self.blocked_since, self.exchange_group = what, time.monotonic(), exchange_group
        try:
            yield
        finally:
            with self._lock:
                self.blocked_in, self.exchange_group = None, None


def _distributed_call(frame) -> str | None:
    """The outermost ``torch.distributed`` function on a thread's stack and the line that called it, or None."""
    call = None
    while frame is not None:
        code = frame.f_code
        if _DISTRIBUTED_DIR in code.co_filename and frame.f_back is not None:
            caller = frame.f_back.f_code
            if _DISTRIBUTED_DIR not in caller.co_filename:
                call = (f"torch.distributed's {code.co_name} (called at "
                        f"{os.path.basename(caller.co_filename)}:{frame.f_back.f_lineno})")
        frame = frame.f_back
    return call


def alive_key(global_rank: int) -> str:
    return f"zcompile/alive/{global_rank}"


def heartbeat() -> Heartbeat | None:
    """This process's beat, started on first use; None without a process group (nothing to tell)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    for thread in threading.enumerate():
        if thread.name == THREAD_NAME and thread.is_alive():
            return thread.heartbeat
    try:
        store = default_store().clone()  # a client of its own for the thread
    except Exception:  # a store that cannot be cloned (torch's fake process group, zcompile.simulate): no beat
        return None
    beat = Heartbeat(store=store, rank=dist.get_rank())
    thread = threading.Thread(target=beat.beat_forever, name=THREAD_NAME, daemon=True)
    thread.heartbeat = beat
    thread.start()
    atexit.register(beat.stop, thread)
    return beat


def blocked(what: str, exchange_group: str | None = None):
    """``Heartbeat.blocked`` of this process's beat, or nothing without one."""
    beat = heartbeat()
    return beat.blocked(what, exchange_group) if beat is not None else contextlib.nullcontext()


@dataclass(frozen=True)
class RankState:
    """What a rank's last beat said (``beat`` None: it never beat)."""

    rank: int  # in the waiting group
    beat: int | None
    blocked_in: str | None
    for_s: float
    exchange_group: str | None = None

    def describe(self) -> str:
        if self.beat is None:
            return f"rank {self.rank} has not started zcompile's beat"
        if self.blocked_in is None:
            return f"rank {self.rank} is alive, running its own code"
        return f"rank {self.rank} waits in {self.blocked_in} (for {self.for_s:.0f}s)"


def rank_states(store: dist.Store, group, ranks: list[int]) -> list[RankState]:
    """The last beat of each of ``ranks`` (ranks of ``group``, a ``DataParallelGroup``)."""
    global_ranks = [dist.get_global_rank(group.process_group, r) if group.process_group is not None else r
                    for r in ranks]
    states = []
    for rank, global_rank in zip(ranks, global_ranks):
        key = alive_key(global_rank)
        if not store.check([key]):
            states.append(RankState(rank, None, None, 0.0))
            continue
        value = json.loads(store.get(key))
        states.append(RankState(rank, value["beat"], value["blocked_in"], value["for_s"],
                                value.get("exchange_group")))
    return states


def waiting_on_each_other(missing: list[RankState], group_name: str | None) -> bool:
    """Whether every missing rank has waited, for a beat or more, in another exchange of this group's
    ranks than the one this rank waits in (it would be counted as arrived in this one): that exchange
    needs this rank, which waits for it, so neither will ever come (``if rank == 0:
    zcompile.checkpoint.save(...)`` while the others are at ``optimizer.step()``). No timeout needs to
    pass. An exchange of another group may end without this rank: it does not count."""
    return bool(missing) and all(state.exchange_group is not None and state.exchange_group == str(group_name)
                                 and state.for_s >= BEAT_S for state in missing)


def busy_with_own_work(before: list[RankState], now: list[RankState]) -> bool:
    """Whether every rank of ``now`` beat since ``before`` and is not stuck: blocked in nothing, or in
    one call for less than a beat (a rank evaluating alone through the compiled model passes through
    many short compiled calls; one stuck in a collective stays in the same one)."""
    earlier = {state.rank: state.beat for state in before}
    return bool(now) and all(state.beat is not None and (state.blocked_in is None or state.for_s < BEAT_S)
                             and earlier.get(state.rank) is not None and state.beat > earlier[state.rank]
                             for state in now)
