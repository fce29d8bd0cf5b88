"""Cross-call prefetch: a compiled graph called again and again in a row (blocks compiled one by one)
issues the next call's first all-gather while this call computes.

Each call of such a graph waits for its first bucket exposed (``passes/call_prologue.py``). With the
graph split into a prologue (that gather, issued) and a body, a call:

1. takes the gather the call before issued for it, if it was issued for exactly this call's shards
   (the same tensors, unchanged since: storage, offset and version), else runs its own prologue;
2. issues the prologue of the call that came next the last time (the previous run's successor of
   this call, its shards the same tensors every step);
3. runs the body with its gather.

A run is the calls of one graph between calls of its other graph (a forward's run ends where its
backward starts, and the backward's where a forward starts): links are learned from the previous run
of the same kind, so the last layer of a forward never prefetches the first of the next step, whose
weights the step is about to change. A prefetch not taken is waited and dropped when its run ends.

Every rank must take or not take alike, or one rank gathers once more than the others and the
collectives stop pairing: ranks that run the same calls predict the same (their previous runs were
the same), and a forward call's agreement with the other ranks (``zcompile.step_agreement``) also
compares whether each rank takes its prefetch (``would_take``), so ranks that ran different layers
raise there rather than pair one layer's gather with another's. A backward is the forward's calls in
reverse, so its takes follow the agreed forward's.

One state per compiled function (``CallChain``), shared by its forward and backward through a
``RunPhase``: no module-level state; the chains live as long as the compiled graphs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from zcompile.passes.call_prologue import CallSplit

log = logging.getLogger(__name__)
WAIT = torch.ops._c10d_functional.wait_tensor.default

CallKey = tuple[int, ...]


def _key(inputs: list[torch.Tensor]) -> CallKey:
    return tuple(id(t) for t in inputs)


def _stamp(inputs: list[torch.Tensor]) -> tuple:
    """What must not change between a prefetch and its take: each input's storage, place and version
    (an in-place update, such as the optimizer's, bumps the version; a new storage moves the pointer)."""
    return tuple((t.untyped_storage().data_ptr(), t.storage_offset(), t._version) for t in inputs)


@dataclass
class _Prefetch:
    inputs: list[torch.Tensor]
    stamp: tuple
    issued: torch.Tensor


@dataclass
class RunPhase:
    """Which kind of call (``"forward"``, ``"backward"``) one compiled function runs now; a call of the
    other kind ends the run of every chain that shares it."""

    current: str | None = None
    chains: list = field(default_factory=list)

    def enter(self, kind: str) -> None:
        if self.current != kind:
            for chain in self.chains:
                chain.end_run()
            self.current = kind


@dataclass
class CallChain:
    """Cross-call prefetch for one compiled graph of one kind (module docstring)."""

    kind: str
    split: CallSplit
    phase: RunPhase
    links: dict[CallKey, list[torch.Tensor]] = field(default_factory=dict)  # the previous run's: key -> next inputs
    learning: dict[CallKey, list[torch.Tensor]] = field(default_factory=dict)  # this run's
    calls_this_run: int = 0
    last_key: CallKey | None = None
    pending: _Prefetch | None = None
    agreed_take: bool | None = None  # what this call's agreement said it would do (forward)
    taken: int = 0  # calls that took a prefetch, and prefetches dropped: for tests and the report
    dropped: int = 0

    def __post_init__(self) -> None:
        self.phase.chains.append(self)

    def inputs_of(self, args: list) -> list[torch.Tensor]:
        return [args[i] for i in self.split.input_indices]

    def would_take(self, inputs: list[torch.Tensor]) -> bool:
        """Whether a call now with these prologue inputs takes a prefetch (what ``run`` will do)."""
        return self.phase.current == self.kind and self._matches(inputs)

    def agree_to_take(self, inputs: list[torch.Tensor]) -> bool:
        """``would_take``, remembered: the call's ``run`` checks it does what its agreement said."""
        self.agreed_take = self.would_take(inputs)
        return self.agreed_take

    def run(self, args: list, body: Callable[[list], object]):
        """The call: its gather taken or issued, the next call's issued, then ``body`` (boxed: it
        takes ``args`` with the gather appended, and clears the list, freeing each input after its
        last reader)."""
        self.phase.enter(self.kind)
        inputs = self.inputs_of(args)
        take = self._matches(inputs)
        agreed, self.agreed_take = self.agreed_take, None
        if agreed is not None and agreed != take:  # never: would_take is the same test, just before
            raise RuntimeError(f"zcompile cross-call prefetch: the call agreed to {'take' if agreed else 'not take'} "
                               "its prefetched gather and then did the other; every rank must do the same")
        # no local of this frame holds the gather: the body frees it after its last reader
        if take:
            args.append(self.pending.issued)
            self.pending = None
            self.taken += 1
        else:
            self._drop_pending()
            args.append(self.split.prologue(*inputs))
        key = _key(inputs)
        if self.last_key is not None:
            self.learning[self.last_key] = inputs
        self.last_key = key
        self.calls_this_run += 1
        following = self.links.get(key)
        if following is not None:
            self.pending = _Prefetch(following, _stamp(following), self.split.prologue(*following))
        return body(args)

    def end_run(self) -> None:
        """The run is over (a call of the other kind): what it learned replaces the links; a prefetch
        it did not take is waited (its collective ran on every rank) and dropped."""
        self._drop_pending()
        if self.calls_this_run:
            self.links, self.learning = self.learning, {}
        self.calls_this_run = 0
        self.last_key = None

    def _matches(self, inputs: list[torch.Tensor]) -> bool:
        pending = self.pending
        return (pending is not None and len(pending.inputs) == len(inputs)
                and all(a is b for a, b in zip(pending.inputs, inputs)) and pending.stamp == _stamp(inputs))

    def _drop_pending(self) -> None:
        if self.pending is not None:
            WAIT(self.pending.issued)
            self.pending = None
            self.dropped += 1


def prefetching_call(run: Callable[[list], object], chain: CallChain) -> Callable[[list], object]:
    """``run`` (a boxed body) called through ``chain``: AOTAutograd's boxed convention kept."""

    def call(args: list):
        return chain.run(args, run)

    call._boxed_call = True
    return call
