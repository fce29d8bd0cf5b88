"""A heartbeat per process: which ranks are alive, and what each waits in: a rank busy with its own work is not a divergence.

The ranks meet through the store with a timeout (``store_exchange.exchange_on_store``), so a rank that
never comes is an error in seconds, not a hang. But a rank can be late for a good reason: an
evaluation, a checkpoint written or an upload made by rank 0 alone, minutes long, while the others
wait at the next ``optimizer.step()``. DDP waits there (its next collective waits for the process
group's timeout); a ``RankDivergenceError`` after ``check_timeout_s`` would end a run that is fine.

So each process beats: a daemon thread writes, every ``BEAT_S``, its count of beats and what the
training thread is blocked in, under ``zcompile/alive/{global rank}``: zcompile's own waits (an
exchange of the ranks, a compiled graph: marked by ``blocked``), and what that thread's stack shows
in two beats in a row: compiled code (fx's or inductor's) waiting for a functional collective, read
from the code's lines with the global ranks of its group, or a call into ``torch.distributed`` (the
user's ``dist.barrier()``, a checkpoint's collectives; of every rank where the calling line names no
group).

A rank whose wait times out reads the missing ranks' beats: one that beats and is blocked in
nothing runs code of its own, and the wait goes on (with a warning each ``check_timeout_s``, up to
the process group's timeout); one blocked in a wait of its own (a divergence), or that stopped
beating (dead, or frozen), is the error. And once a beat, during the wait: a missing rank
that waits in another exchange of this group, or in a collective whose group holds this rank, waits
for this rank, which waits for it, so both raise at once, with no timeout to pass
(``waiting_on_each_other``).
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import dataclasses
import json
import linecache
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

from zcompile.agreement.abort_note import first_note
from zcompile.agreement.mismatch_watch import MismatchWatch
from zcompile.agreement.rank_state import BEAT_S, StackWait, alive_key, describe_others
from zcompile.common.process_group import DataParallelGroup, default_store, group_ranks_by_name, process_group_timeout_s
from zcompile.passes.call_prologue import issued_by

log = logging.getLogger(__name__)

_DISTRIBUTED_DIR = os.path.join("torch", "distributed", "")
THREAD_NAME = "zcompile-heartbeat"
# a compiled graph's wait for a functional collective, in fx's code and in inductor's:
# "wait_tensor_default = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_out_default)"
_WAIT_LINE = re.compile(r"_c10d_functional\.wait_tensor(?:\.default)?\((\w+)\)")
_COLLECTIVE_CALL = re.compile(r"_c10d_functional\.(\w+?)(?:\.default)?\((.*)\)")


@dataclass(eq=False)
class Heartbeat:
    """This process's beat (one per process, found through its thread: no module-level registry)."""

    store: dist.Store  # the beating thread's own client of the store (a clone: requests never interleave)
    rank: int  # global rank
    world_size: int  # of the default group
    blocked_in: str | None = None  # what the training thread waits in, inside zcompile; None: its own code
    blocked_since: float = 0.0
    # blocked_in is an exchange of the ranks of this group (store_exchange), which needs all of them; None: not one
    exchange_group: str | None = None
    beats: int = 0
    thread_id: int = field(default_factory=threading.get_ident)  # the training thread: the one that made it
    # called each beat with what the stack has waited in for a beat or more (mismatch_watch.MismatchWatch)
    watch: Callable[[StackWait | None, float], None] | None = field(default=None, repr=False)
    _waiting: StackWait | None = field(default=None, repr=False)  # what the stack waits in, since when
    _group_ranks: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False)  # by group name
    _peer_note_told: bool = field(default=False, repr=False)
    _next_long_wait_warning: float | None = field(default=None, repr=False)  # for the compiled wait seen now
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _stopped: threading.Event = field(default_factory=threading.Event, repr=False)

    def beat_forever(self) -> None:
        while not self._stopped.is_set():
            self.beats += 1
            now = time.monotonic()
            state = {"beat": self.beats, **self._state(now)}
            try:
                self.store.set(alive_key(self.rank), json.dumps(state))
            except Exception:  # the store's host is gone: the job is ending, the training thread will say why
                return
            self._tell_peer_note()
            self._warn_of_a_long_compiled_wait(now)
            if self.watch is not None:
                try:
                    self.watch(self._seen(now), now)
                except Exception:  # a beat unread (a rank leaving): the next look reads again
                    log.debug("the mismatch watch could not look", exc_info=True)
            self._stopped.wait(BEAT_S)

    def _tell_peer_note(self) -> None:
        """Logs, once, the reason another rank left (its abort note) as soon as it is in the store: this
        rank may be in a collective of the user's own (``dist.barrier()``, ``dist.all_reduce``), where the
        peer's leaving shows only as gloo's "Connection closed by peer", with nothing of why."""
        if self._peer_note_told:
            return
        note = first_note(self.store)
        if note is not None and note[0] != self.rank:
            self._peer_note_told = True
            log.error(
                "zcompile: rank %d stopped: %s (rank %d's collectives with it fail from now on, in torch.distributed "
                "calls of its own too: this is why)",
                note[0],
                note[1],
                self.rank,
            )

    def _warn_of_a_long_compiled_wait(self, now: float) -> None:
        """A warning each ``long_wait_s()`` that the training thread waits in a compiled graph's collective,
        naming the ranks it waits for and what their beats say they do: the first compiled call after a
        step is not agreed on (every rank left the step together), so a rank held up before its forward
        (a slow data loader) leaves the others waiting in gloo or NCCL with no other word until the
        process group's timeout."""
        seen = self._seen(now)
        if seen is None or not seen.compiled or seen.ranks is None:
            self._next_long_wait_warning = None
            return
        if self._next_long_wait_warning is None:
            self._next_long_wait_warning = seen.since + long_wait_s()
        if now < self._next_long_wait_warning:
            return
        self._next_long_wait_warning = now + long_wait_s()
        log.warning(
            "zcompile: rank %d has waited %.0fs in %s, for ranks %s (%s); it waits on up to the process group's "
            "timeout (%.0fs). A rank held up before its compiled call (a slow data loader, work of its own on one "
            "rank) keeps the others waiting here",
            self.rank,
            now - seen.since,
            seen.call,
            [r for r in seen.ranks if r != self.rank],
            describe_others(self.store, seen.ranks, self.rank),
            default_group_timeout_s(),
        )

    def _state(self, now: float) -> dict:
        """What this beat says: what the training thread is blocked in, for how long, and (where known)
        the exchange's group or the global ranks of the collective it waits for."""
        try:
            waiting = self._stack_wait(sys._current_frames().get(self.thread_id))
        except Exception:  # a stack read while it changes (linecache, the group registry): next beat
            log.debug("could not read the training thread's stack", exc_info=True)
            waiting = None
        if waiting is None or self._waiting is None or self._waiting.call != waiting.call:
            self._waiting = None if waiting is None else dataclasses.replace(waiting, since=now)
        seen = self._seen(now)
        with self._lock:
            mark, since, group = self.blocked_in, self.blocked_since, self.exchange_group
        if seen is not None:
            return {
                "blocked_in": seen.call if mark is None else f"{mark}, in {seen.call}",
                "for_s": round(now - seen.since, 1),
                "collective_ranks": seen.ranks,
                "compiled_collective": seen.compiled,
                "collective_group": seen.group_name,
                "exchange_group": group,
            }
        if mark is not None:
            return {"blocked_in": mark, "for_s": round(now - since, 1), "exchange_group": group}
        return {"blocked_in": None, "for_s": 0.0}

    def _seen(self, now: float) -> StackWait | None:
        """The stack's wait once seen in two beats (in one call seen once: a rank busy with its own
        work passes through many)."""
        return self._waiting if self._waiting is not None and now - self._waiting.since >= BEAT_S else None

    def _stack_wait(self, frame) -> StackWait | None:
        """What a stack waits in: a compiled graph's wait for a collective (with its group's global
        ranks, where its code names the group), or else a call into ``torch.distributed``."""
        collective = collective_wait(frame)
        if collective is not None:
            call, group_name = collective
            if group_name is not None and group_name not in self._group_ranks:
                self._group_ranks.update(group_ranks_by_name())  # a group made since the last look
            ranks = self._group_ranks.get(group_name) if group_name is not None else None
        else:
            distributed = _distributed_call(frame)
            if distributed is None:
                return None
            call, on_default_group = distributed
            ranks = tuple(range(self.world_size)) if on_default_group else None
            group_name = None
        return StackWait(
            call if ranks is None else f"{call} over ranks {list(ranks)}",
            ranks,
            0.0,
            compiled=collective is not None,
            group_name=group_name,
        )

    def stop(self, thread: threading.Thread) -> None:
        """Ends the beat (at exit: a daemon thread inside a store call while the interpreter tears down
        torch's objects could crash the process on its way out), and says so: a rank waiting for this
        one at an exchange then raises at once instead of at its timeout (a rank whose loop ended early
        while rank 0 saves a checkpoint would otherwise read as "alive, running its own code")."""
        self._stopped.set()
        thread.join(timeout=BEAT_S)
        self._tell_peer_note()  # a process ending on a failed collective of its own: why, if a peer said
        try:
            self.store.set(
                alive_key(self.rank),
                json.dumps({"beat": self.beats + 1, "blocked_in": None, "for_s": 0.0, "ended": True}),
            )
        except Exception:  # the store went first (its host ended): nobody is left waiting on it
            log.debug("could not leave the last beat", exc_info=True)

    @contextlib.contextmanager
    def blocked(self, what: str, exchange_group: str | None = None):
        """The training thread waits in ``what`` (zcompile's; ``exchange_group``: an exchange of that
        group's ranks) until the block ends; nested blocks keep the outer. A wait on another thread (a
        background checkpoint save's swap) says nothing: marking it would hide the training thread's own."""
        if self.blocked_in is not None or threading.get_ident() != self.thread_id:
            yield
            return
        with self._lock:
            self.blocked_in, self.blocked_since, self.exchange_group = what, time.monotonic(), exchange_group
        try:
            yield
        finally:
            with self._lock:
                self.blocked_in, self.exchange_group = None, None


def collective_wait(frame) -> tuple[str, str | None] | None:
    """The functional collective that compiled code (an fx graph's, or inductor's) on a thread's stack
    waits for: ``(what, its group's name or None)``, or None.

    Read from the code's lines (``linecache``: fx registers its generated code there, inductor's is a
    file): the line of the frame waits (``wait_tensor(buf)``) and the line that launched ``buf`` names
    the collective and, as its last string argument, its group; a gather the call before issued
    (``passes/call_prologue.py``) is an input whose name says both."""
    while frame is not None:
        filename = frame.f_code.co_filename
        waited = _WAIT_LINE.search(linecache.getline(filename, frame.f_lineno))
        if waited is not None:
            where = f"{os.path.basename(filename)}:{frame.f_lineno}"
            launch = _launch_of(linecache.getlines(filename), waited.group(1))
            if launch is None:
                return f"a collective's wait ({where})", None
            kind, group_name = launch
            return f"{kind} ({where})", group_name
        frame = frame.f_back
    return None


def _launch_of(lines: list[str], tensor: str) -> tuple[str, str | None] | None:
    """The collective that made ``tensor`` in generated code, and its group's name (its last string
    argument), from the line that assigns it (``buf = ..._c10d_functional.all_to_all_single.default(...)``)
    or writes it (``..._c10d_functional.all_gather_into_tensor_out.default(..., out=buf)``)."""
    issued = issued_by(tensor)
    if issued is not None:
        return issued
    assigns, writes = re.compile(rf"^\s*{re.escape(tensor)}\s*="), re.compile(rf"\bout\s*=\s*{re.escape(tensor)}\b")
    for line in lines:
        statement = line.split(";")[0]  # fx appends "; x = None" frees
        call = _COLLECTIVE_CALL.search(statement)
        if call is None or call.group(1).startswith("wait_tensor"):
            continue
        if assigns.search(statement) or writes.search(call.group(2)):
            names = re.findall(r"'([^']*)'", call.group(2))
            return call.group(1), names[-1] if names else None
    return None


def _distributed_call(frame) -> tuple[str, bool] | None:
    """The outermost ``torch.distributed`` function on a thread's stack (past torch's logging
    decorators) and the line that called it, and whether that call is on the default group, or None."""
    found, inner = None, None
    while frame is not None:
        code = frame.f_code
        if (
            _DISTRIBUTED_DIR in code.co_filename
            and frame.f_back is not None
            and _DISTRIBUTED_DIR not in frame.f_back.f_code.co_filename
        ):
            decorated = code.co_filename.endswith("c10d_logger.py") and inner is not None
            found = (inner if decorated else frame, frame.f_back)
        inner, frame = frame, frame.f_back
    if found is None:
        return None
    called, caller = found
    where = f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"
    line = linecache.getline(caller.f_code.co_filename, caller.f_lineno)
    return f"torch.distributed's {called.f_code.co_name} (called at {where})", _on_default_group(called.f_code, line)


def _on_default_group(function, line: str) -> bool:
    """Whether ``line`` calls ``function`` (one of ``torch.distributed``'s collectives, whose ``group``
    None is the default group) without a group: ``dist.barrier()``, ``dist.all_reduce(t)``. False
    where that cannot be read from the line (a call over several lines, ``*args``, another API)."""
    if not function.co_filename.endswith("distributed_c10d.py"):
        return False
    params = function.co_varnames[: function.co_argcount + function.co_kwonlyargcount]
    if "group" not in params:
        return False
    try:
        tree = ast.parse(line.strip())
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == function.co_name
        ):
            if any(keyword.arg in ("group", None) for keyword in node.keywords) or any(
                isinstance(arg, ast.Starred) for arg in node.args
            ):
                return False
            position = params.index("group")
            return position >= function.co_argcount or len(node.args) <= position
    return False


LONG_WAIT_S = 60.0  # as a step's wait for a missing rank warns (step_agreement.DEFAULT_TIMEOUT_S)


def default_group_timeout_s() -> float:
    return process_group_timeout_s(DataParallelGroup.resolve(None))


def long_wait_s() -> float:
    """How long a compiled collective waits before the first warning: a minute, or a third of the process
    group's timeout where that is shorter (the warning must come before the timeout's error)."""
    return min(LONG_WAIT_S, default_group_timeout_s() / 3)


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
    beat = Heartbeat(store=store, rank=dist.get_rank(), world_size=dist.get_world_size())
    beat.watch = MismatchWatch(store=store, rank=beat.rank).look
    thread = threading.Thread(target=beat.beat_forever, name=THREAD_NAME, daemon=True)
    thread.heartbeat = beat
    thread.start()
    atexit.register(beat.stop, thread)
    return beat


def blocked(what: str, exchange_group: str | None = None):
    """``Heartbeat.blocked`` of this process's beat, or nothing without one."""
    beat = heartbeat()
    return beat.blocked(what, exchange_group) if beat is not None else contextlib.nullcontext()
