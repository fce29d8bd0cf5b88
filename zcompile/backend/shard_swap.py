"""The runtime half of a compile: at every call, the parameters Dynamo passes are swapped for their shards.

``ShardSwap`` looks each shard up on its parameter, so one graph reused for every block (regional
compilation) gets each block's shards; it refuses, with the fix, a parameter whose ``requires_grad``
or hooks changed after the graph was built for it."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch._C import DisableTorchFunctionSubclass

from zcompile.agreement.abort_note import leave_abort_note, raise_if_aborted, raise_naming_the_others
from zcompile.agreement.heartbeat import heartbeat
from zcompile.agreement.step_agreement import agree_on_call, take_free_call
from zcompile.backend.call_prefetch import CallChain
from zcompile.backend.compiled import CompiledGraphs
from zcompile.common.process_group import DataParallelGroup
from zcompile.passes.grad_hooks import hooked_params
from zcompile.passes.param_collectives import ShardingPlan, gradient_leaves_parameter
from zcompile.routes import install as install_routes
from zcompile.sharding.shards import (
    ShardedParam,
    shard_of,
    shard_parameter,
)

log = logging.getLogger(__name__)


class ShardSwap:
    """Replaces, in a call's arguments, each parameter by what the rewritten graph takes instead.

    stage 3: the shard at the parameter's position; stage 2: a detached alias of the replicated
    parameter (its gradient goes to the shard) plus the shards appended; stage 1: nothing, or the
    low-precision replica (``param_dtype``), whose gradient is then the local full gradient.

    The shard is looked up on the parameter passed at each call, not fixed at compile time:
    Dynamo reuses one graph for every instance of a module class (each transformer block), so
    the same graph position sees a different parameter per call. A parameter reaching a graph
    for the first time at run time is sharded then, identically on every rank.
    """

    def __init__(self, plan: ShardingPlan, group: DataParallelGroup):
        self.plan = plan
        self.group = group
        # the parameters whose gradient the graph takes away from them: autograd runs none of their
        # hooks, so those the graph was not built for are refused at every call (check_hooks)
        self._gradient_moved = [p for p in plan.params if gradient_leaves_parameter(plan, p)]
        self._hooked = {p.index for p in hooked_params(plan)}  # each takes its hooks token, appended last

    def sharded(self, param: torch.nn.Parameter, name: str, mark: bool = True) -> ShardedParam:
        existing = shard_of(param)
        if existing is not None and existing.stage == self.plan.stage and existing.group.name == self.group.name:
            existing.follow_replaced_storage()
            return existing
        # new, or sharded for another stage or group: shard_parameter raises with the fix
        install_routes()  # before the first shard: torch's functions must route zcompile parameters
        return shard_parameter(
            param, name, self.plan.stage, self.group, self.plan.reduce_dtype, self.plan.param_dtype, mark=mark
        )

    def swap(self, args: list, counted: bool = True, mark: bool = True) -> list:
        # calls, and calls with gradients, are counted on their parameters' shards (zcompile.agreement.step_agreement)
        training = int(counted and torch.is_grad_enabled())
        appended, tokens = [], []
        _check_requires_grad(self.plan, self.group, args)
        if self._gradient_moved:
            self.check_hooks(args)
        for p in self.plan.params:
            sharded = self.sharded(args[p.index], p.name, mark)
            sharded.training_calls += training
            if p.index in self._hooked:
                tokens.append(sharded.hooks_token)
            if self.plan.stage == 1:
                if sharded.replica is not None:
                    _follow_requires_grad(sharded.replica, p.requires_grad)
                    args[p.index] = sharded.replica  # its gradient is stage 1's full gradient
                continue
            if self.plan.stage == 3:
                _follow_requires_grad(sharded.shard, p.requires_grad)
                args[p.index] = sharded.shard
            else:
                _follow_requires_grad(sharded.grad_target, p.requires_grad)
                args[p.index] = sharded.replicated_alias
                appended.append(sharded.grad_target)
        return args + appended + tokens if appended or tokens else args

    def check_hooks(self, args: list) -> None:
        """Raises ``ValueError`` for a hook this graph cannot run: a post-accumulate-grad hook on a
        parameter whose gradient never accumulates on it, or a gradient hook registered after the
        graph was compiled without a place for it (Dynamo does not guard hooks: no recompile). Read
        with torch-function subclasses disabled, as ``passes.param_collectives.tensor_hooks`` reads them."""
        message = None
        with DisableTorchFunctionSubclass():  # one context for all the reads, not one per parameter
            for p in self._gradient_moved:
                param = args[p.index]
                if param._post_accumulate_grad_hooks:
                    message = _post_accumulate_message(p, self.plan)
                elif not p.grad_hooks and param._backward_hooks:
                    message = _late_hook_message(p)
                if message is not None:
                    break
        if message is not None:
            leave_abort_note(self.group, message)
            raise ValueError(message)

    def first_call_since_agreed_step(self, args: tuple) -> bool:
        """Whether this call is the first compiled call with collectives since the ranks agreed on a
        step, all its parameters members of that step: the ranks then left that agreement together and
        this is where each goes next, so the call needs no agreement of its own (the common case: the
        forward right after ``optimizer.step()``; one store exchange per step instead of two). Takes the
        step's one such call either way (``take_free_call``): the calls after it are not where every
        rank goes next (blocks compiled one by one are one graph called per layer: a rank that skipped
        a layer calls the next one, whose collectives pair with another call's)."""
        return take_free_call([shard_of(args[p.index]) for p in self.plan.params])

    def swap_for_tracing(self, example_inputs: list) -> list:
        """``swap`` with the new inputs as static-shape fake tensors of Dynamo's fake mode.

        AOTAutograd would otherwise give tensors it has no Dynamo source for symbolic sizes,
        and guards on those symbols cannot be expressed by Dynamo.
        """
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        originals = {id(a) for a in example_inputs}
        args = self.swap(list(example_inputs), counted=False, mark=False)
        if fake_mode is None:
            return args
        return [a if id(a) in originals else fake_mode.from_tensor(a, static_shapes=True) for a in args]

    def wrap(
        self,
        compiled: Callable,
        agreed_call: str | None = None,
        timeout_s: float = 60.0,
        graph_id: str = "?",
        chain: CallChain | None = None,
        graphs: CompiledGraphs | None = None,
        agreement_group: DataParallelGroup | None = None,
    ) -> Callable:
        """The compiled graph taking the shards; ``agreed_call``: what every rank must be calling
        before it runs (``zcompile.agreement.step_agreement.agree_on_call``), None for no agreement. ``chain``:
        the forward's cross-call prefetch (``zcompile.backend.call_prefetch``), whose plan the agreement
        compares too: a rank that takes a prefetched gather while another gathers its own, or issues
        one the other does not, would pair its collectives with others. ``graphs``: counts its training
        calls (``CompiledGraphs.note_training_call``). ``agreement_group``: the ranks that agree on each
        call instead of the data-parallel group, at every call (a tensor-parallel model: its tp peers run
        the model's own collectives with it, and the step agreement is the dp group's)."""
        if not self.plan.params:
            return compiled

        beat = heartbeat()  # a rank stuck in this graph's collectives is not busy with work of its own
        what = f"compiled graph {graph_id}"

        def run_swapped(args: list):
            if graphs is not None and torch.is_grad_enabled():
                graphs.note_training_call()
            try:
                if beat is None:
                    return compiled(*args)
                with beat.blocked(what):
                    return compiled(*args)
            except Exception as error:  # a collective failed: maybe another rank left, saying why
                raise_if_aborted(self.group, error)
                raise_naming_the_others(self.group, what, error)
                raise

        if agreed_call is None:
            return lambda *args: run_swapped(self.swap(list(args)))
        if chain is not None:
            chain.agreed = True  # its calls take and issue prefetches only as agreed

        def run_agreed(*args):
            free = self.first_call_since_agreed_step(args) and agreement_group is None
            swapped = self.swap(list(args))
            if not free:
                plan = "" if chain is None else chain.plan(chain.inputs_of_call(swapped)).describe()
                agree_on_call(agreement_group or self.group, agreed_call + plan, timeout_s)
            return run_swapped(swapped)

        return run_agreed


class StaleGraphError(RuntimeError):
    """A compiled graph was called with a parameter whose ``requires_grad`` changed since it was traced."""


def _check_requires_grad(plan: ShardingPlan, group: DataParallelGroup, args: list) -> None:
    """Raises ``StaleGraphError`` if a parameter's ``requires_grad`` is not the one the graph was traced
    with, leaving the message for the other ranks (one rank alone may have switched the flag: they
    would read "connection closed" in their collectives). Read with torch-function subclasses
    disabled: through a stage-3 parameter's ``__torch_function__`` every read is a Python call, paid
    for each parameter at every call."""
    with DisableTorchFunctionSubclass():
        stale = next((p for p in plan.params if args[p.index].requires_grad != p.requires_grad), None)
    if stale is not None:
        message = _stale_message(stale, not stale.requires_grad)
        leave_abort_note(group, message)
        raise StaleGraphError(message)


# the fix of a graph that no longer fits its parameters, shared by the messages below
_RESET_FIX = "call torch.compiler.reset() (the next call recompiles; the shards and the optimizer's state are kept)"


def _stale_message(param, requires_grad: bool) -> str:
    version = torch.__version__.split("+")[0]
    upgrade = (
        "" if tuple(map(int, version.split(".")[:2])) >= (2, 13) else ", or use torch 2.13 or newer (it guards it)"
    )
    return (
        f"zcompile: parameter {param.name!r} has requires_grad={requires_grad}, but its graph was traced with "
        f"requires_grad={param.requires_grad} and not recompiled, so it would train as traced, silently. After "
        f"freezing or unfreezing parameters, {_RESET_FIX}{upgrade}; where blocks compiled one by one share a graph, "
        "compile the whole model."
    )


def _post_accumulate_message(param, plan: ShardingPlan) -> str:
    where = (
        f"ZeRO stage {plan.stage}"
        if plan.stage != 1
        else f"stage 1 with param_dtype={plan.param_dtype} (the graphs take a low-precision replica)"
    )
    return (
        f"zcompile: parameter {param.name!r} has a post-accumulate-grad hook, which would never run: at {where} "
        "the compiled backward reduce-scatters its gradient onto this rank's shard, never into the parameter's "
        ".grad. Use param.register_hook(fn) (run on the local gradient before the reduction, as DDP does), "
        "stage 1 without param_dtype, or do the hook's work after optimizer.step()"
    )


def _late_hook_message(param) -> str:
    return (
        f"zcompile: parameter {param.name!r} got a gradient hook (register_hook) after its graph was compiled "
        "without one; Dynamo does not recompile for a new hook, so it would never run. Register gradient hooks "
        f"before the first compiled call, or {_RESET_FIX} after registering them; where blocks compiled one by "
        "one share a graph, give every block the hooks"
    )


def _follow_requires_grad(leaf: torch.Tensor, requires_grad: bool) -> None:
    """The tensor that takes a parameter's gradient in its place (the shard, stage 2's grad target, a
    low-precision replica) requires grad exactly when the parameter did as this graph was traced.

    Freezing or unfreezing a parameter between steps (``p.requires_grad_(False)``) makes Dynamo
    recompile, since its guards check ``requires_grad``; but the graphs take the stand-in, and one
    left as it was when first sharded would keep a frozen parameter training (or an unfrozen one
    frozen), with no error. Set here at every call, not only when tracing: a graph compiled earlier, for the
    other setting, runs again when the parameter is switched back. A plain tensor's flag: no cost."""
    if leaf.requires_grad != requires_grad:
        leaf.requires_grad_(requires_grad)
