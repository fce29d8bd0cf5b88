"""Cross-call prefetch: a compiled graph called again and again in a row (blocks compiled one by one)
issues the next call's first all-gather while this call computes.

Each call of such a graph waits for its first bucket exposed (``passes/call_prologue.py``). With the
graph split into a prologue (that gather, issued) and a body, a call:

1. takes the gather the call before issued for it, if it was issued for exactly this call's shards
   (the same tensors, unchanged since: storage, offset and version), else runs its own prologue;
2. issues the prologue of the call predicted next;
3. runs the body with its gather.

Which call comes next. A forward predicts from its previous run (a run is a graph's calls between
calls of its other graph: a forward's run ends where its backward starts), so the last layer never
prefetches the first of the next step, whose weights the step is about to change. A backward knows:
it is its forward's calls in reverse, so a backward call prefetches the backward of the forward call
made before its own (found by its shards). A prefetch not taken is waited and dropped when its run ends.

Every rank must issue the same collectives, or they stop pairing (gloo aborts the process where the
sizes differ). A prediction is rank-local, so what a forward call does is decided where the ranks
agree on the call (``zcompile.agreement.step_agreement``): whether it takes a prefetch and whether it issues
one are part of what the ranks compare (``CallChain.plan``). A call that needs no agreement (the
first after a step) neither takes nor issues. A backward's choices follow from its own forward's run
length alone (every call but the first takes, every call but the last issues), which the forward's
agreements made the same on every rank. With ``check_ranks=False`` nothing is agreed and each rank
follows its own predictions, which agree wherever the ranks run the same calls.

One state per compiled graph and kind (``CallChain``), the forward's and backward's sharing a
``RunPhase``: no module-level state; the chains live as long as the compiled graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor

from zcompile.passes.call_prologue import CallSplit

log = logging.getLogger(__name__)
WAIT = torch.ops._c10d_functional.wait_tensor.default

CallKey = tuple[int, ...]
RunPlace = tuple[CallKey, int]  # a forward call's shards, and how many calls of its run had them before


def _key(inputs: list[torch.Tensor]) -> CallKey:
    return tuple(id(t) for t in inputs)


def _stamp(inputs: list[torch.Tensor]) -> tuple:
    """What must not change between a prefetch and its take: each input's storage, place and version
    (an in-place update, such as the optimizer's, bumps the version; a new storage moves the pointer).
    A fake tensor (``zcompile.simulate``'s world) has no storage to point at: its version alone."""
    return tuple(
        (0 if isinstance(t, FakeTensor) else t.untyped_storage().data_ptr(), t.storage_offset(), t._version)
        for t in inputs
    )


@dataclass
class _Prefetch:
    inputs: list[torch.Tensor]
    stamp: tuple
    issued: torch.Tensor


@dataclass(frozen=True)
class CallPlan:
    """What one call does: take the pending prefetch, and the inputs of the prefetch it issues (None: none)."""

    take: bool
    following: list[torch.Tensor] | None

    def describe(self) -> str:
        """For the ranks' agreement on the call: ranks that would issue different collectives differ here."""
        return (", taking its prefetched first gather" if self.take else "") + (
            ", prefetching the next call's" if self.following is not None else ""
        )


@dataclass
class RunPhase:
    """Which kind of call (``"forward"``, ``"backward"``) one compiled function runs now; a call of the
    other kind ends the run of every chain that shares it."""

    current: str | None = None
    chains: dict = field(default_factory=dict)  # kind -> CallChain

    def enter(self, kind: str) -> None:
        if self.current != kind:
            for chain in self.chains.values():
                chain.end_run()
            self.current = kind


@dataclass
class CallChain:
    """Cross-call prefetch for one compiled graph of one kind (module docstring). ``agreed``: its
    forward calls agree with the other ranks (``plan`` then decides there, and a call that skipped
    its agreement takes and issues nothing)."""

    kind: str
    split: CallSplit
    phase: RunPhase
    agreed: bool = False
    # a forward: where its call's arguments hold each parameter's shard (Dynamo-graph input -> position),
    # recorded per call for its backward to find it by
    shard_positions: dict[int, int] = field(default_factory=dict)
    links: dict[RunPlace, list[torch.Tensor]] = field(default_factory=dict)  # the previous run's: place -> next inputs
    learning: dict[RunPlace, list[torch.Tensor]] = field(default_factory=dict)  # this run's
    seen: dict[CallKey, int] = field(default_factory=dict)  # this run's calls so far, by shards
    # a forward: each call's Dynamo-graph inputs by index (shards only), this run's and the last run's
    calls: list[dict[int, torch.Tensor]] = field(default_factory=list)
    last_run_calls: list[dict[int, torch.Tensor]] = field(default_factory=list)
    # a backward: where its forward's last run made the calls with each key, not yet claimed by a backward call
    forward_positions: dict[CallKey, list[int]] | None = None
    last_place: RunPlace | None = None
    pending: _Prefetch | None = None
    agreed_plan: CallPlan | None = None
    taken: int = 0  # calls that took a prefetch, and prefetches dropped: for tests and the report
    dropped: int = 0

    def __post_init__(self) -> None:
        self.phase.chains[self.kind] = self

    def inputs_of(self, args: list) -> list[torch.Tensor]:
        """The prologue's inputs among the compiled graph's arguments."""
        return [args[i] for i in self.split.input_indices]

    def inputs_of_call(self, dynamo_args: list) -> list[torch.Tensor]:
        """The same among the Dynamo graph's (the call's, its parameters swapped for their shards)."""
        return [dynamo_args[i] for i in self.split.dynamo_indices]

    def plan(self, inputs: list[torch.Tensor]) -> CallPlan:
        """What a call now with these prologue inputs does, decided where the ranks agree on the call
        (the backend's agreement compares ``describe()``): ``run`` then does exactly that."""
        starts_run = self.phase.current != self.kind
        take = not starts_run and self._matches(inputs)
        self.agreed_plan = CallPlan(take, self.links.get(self._place(inputs)) if self.kind == "forward" else None)
        return self.agreed_plan

    def run(self, args: list, body: Callable[[list], object]):
        """The call: its gather taken or issued, the next call's issued, then ``body`` (boxed: it
        takes ``args`` with the gather appended, and clears the list, freeing each input after its
        last reader)."""
        self.phase.enter(self.kind)
        inputs = self.inputs_of(args)
        call_plan = self._plan_now(inputs)
        # no local of this frame holds the gather: the body frees it after its last reader
        if call_plan.take:
            args.append(self.pending.issued)
            self.pending = None
            self.taken += 1
        else:
            self._drop_pending()
            args.append(self.split.prologue(*inputs))
        self._learn(inputs, args)
        if call_plan.following is not None:
            self.pending = _Prefetch(
                call_plan.following, _stamp(call_plan.following), self.split.prologue(*call_plan.following)
            )
        return body(args)

    def end_run(self) -> None:
        """The run is over (a call of the other kind): what it learned replaces the links; a prefetch
        it did not take is waited (its collective ran on every rank) and dropped."""
        self._drop_pending()
        if self.calls:
            self.links, self.learning = self.learning, {}
            self.last_run_calls, self.calls = self.calls, []
        self.last_place = None
        self.seen = {}
        self.forward_positions = None

    def _plan_now(self, inputs: list[torch.Tensor]) -> CallPlan:
        agreed, self.agreed_plan = self.agreed_plan, None
        if self.kind != "forward":
            return self._backward_plan(inputs)
        if agreed is not None:
            if agreed.take != self._matches(inputs):  # never: the same test, just before
                raise RuntimeError(
                    "zcompile: cross-call prefetch: a call agreed on taking its prefetched gather and "
                    "then could not; every rank must issue the same collectives"
                )
            return agreed
        if self.agreed:  # a call that needed no agreement (the first after a step): nothing to compare with
            return CallPlan(False, None)
        return CallPlan(self._matches(inputs), self.links.get(self._place(inputs)))

    def _backward_plan(self, inputs: list[torch.Tensor]) -> CallPlan:
        """Take what the backward call before issued for this one; issue the backward of the forward
        call made just before this one's forward call (the forward's last run, found by the shards)."""
        forward = self.phase.chains.get("forward")
        made = forward.last_run_calls if forward is not None else []
        if self.forward_positions is None:  # once a run
            self.forward_positions = {}
            for at, call in enumerate(made):
                self.forward_positions.setdefault(_key([call.get(j) for j in self.split.dynamo_indices]), []).append(at)
        unclaimed = self.forward_positions.get(_key(inputs))
        at = unclaimed.pop() if unclaimed else None  # the latest: backward runs the forward's calls in reverse
        following = None
        if at is not None and at > 0 and all(j in made[at - 1] for j in self.split.dynamo_indices):
            following = [made[at - 1][j] for j in self.split.dynamo_indices]
        return CallPlan(self._matches(inputs), following)

    def _learn(self, inputs: list[torch.Tensor], args: list) -> None:
        """A forward's order, for its next run, and its calls' shards, for its backward (a backward
        plans from those, and learns nothing)."""
        if self.kind != "forward":
            return
        place = self._place(inputs)
        if self.last_place is not None:
            self.learning[self.last_place] = inputs
        self.last_place = place
        self.seen[place[0]] = place[1] + 1
        self.calls.append({j: args[i] for j, i in self.shard_positions.items()})

    def _place(self, inputs: list[torch.Tensor]) -> RunPlace:
        key = _key(inputs)
        return key, self.seen.get(key, 0)

    def _matches(self, inputs: list[torch.Tensor]) -> bool:
        pending = self.pending
        return (
            pending is not None
            and len(pending.inputs) == len(inputs)
            and all(a is b for a, b in zip(pending.inputs, inputs))
            and pending.stamp == _stamp(inputs)
        )

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
