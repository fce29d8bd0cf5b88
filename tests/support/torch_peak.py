"""torch's own measure of zcompile's compiled step: ``MemTracker`` over the step under ``FakeTensorMode``.

The reference for ``zcompile.predict.step_peak`` (tests/unit/test_step_peak.py, benchmarks/bench_simulate_torch_peak.py):
the model built under ``FakeTensorMode``, compiled with ``backend="zero"`` in the fake process group
of ``world_size`` ranks that ``zcompile.simulate`` builds, trained with ``zcompile.optim.AdamW``: one
step to compile and make the optimizer's state, then one step (forward, backward, ``step``,
``zero_grad``) under torch's ``torch.distributed._tools.mem_tracker.MemTracker``, which counts every
storage the ops of the step make (each once) from its op to its last reference, on top of the model
states and the batch registered with ``track_external``.

Two things make torch's tracker see the compiled step rather than an eager one:

- Dynamo skips a frame, and so runs the model eagerly, when a dispatch mode that does not declare
  ``ignore_compile_internals`` is active at a cache miss; the tracker here declares it, the step is
  compiled before it is entered, and a recompile under it is an error (``error_on_recompile``);
- ``MemTracker`` does not know higher-order ops: a block subgraph call (``mark_repeated_blocks``'s
  ``invoke_subgraph``) runs its subgraph's ops under the tracker, as the HOP itself does at run time.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker

import zcompile
from zcompile.predict.estimate import fake_call
from zcompile.predict.simulate import fake_world
from zcompile.sharding.shards import shard_of

INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph


class CompiledStepTracker(MemTracker):
    """``MemTracker`` that lets Dynamo run its cached graphs and walks into block subgraph calls."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.functional_collectives = 0  # ops of torch's functional collectives seen: the graphs ran

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is INVOKE_SUBGRAPH:
            subgraph, _, *operands = args
            with self:
                return subgraph(*operands)
        if getattr(func, "namespace", "") == "_c10d_functional":
            self.functional_collectives += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


@dataclass
class TrackedStep:
    peak_bytes: int  # MemTracker's peak over the tracked step
    forward_peak_bytes: int  # its peak up to the end of the forward
    backward_peak_bytes: int  # up to the end of the backward: the optimizer's own temporaries left out
    peak_parts: dict[str, int]  # MemTracker's categories at the peak
    functional_collectives: int
    graphs: list = field(default_factory=list)  # the CompiledGraphs of the compile (on_compile)


def tracked_step(
    make_model: Callable[[], torch.nn.Module],
    batch: Any,
    world_size: int,
    options: dict,
    loss_fn: Callable[[Any], torch.Tensor],
) -> TrackedStep:
    """MemTracker's peak of one compiled step of ``make_model()`` on ``world_size`` fake ranks (module doc)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs: list = []
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_world(world_size, world_size):
        with fake_mode:
            model = make_model()
        optimizer = zcompile.optim.AdamW(model.parameters(), lr=1e-3, check_timeout_s=None)
        args, kwargs = fake_call(batch, fake_mode)
        torch._dynamo.reset()
        try:
            compiled = torch.compile(
                model,
                backend="zero",
                options={**options, "check_ranks": False, "sync_module_states": False, "on_compile": graphs.append},
            )

            def forward():
                return loss_fn(compiled(*args, **kwargs))

            loss = forward()  # compiles; the step makes the optimizer's state
            loss.backward()
            del loss
            optimizer.step()
            optimizer.zero_grad()
            tracker = CompiledStepTracker()
            shards = [s for s in map(shard_of, dict.fromkeys(model.parameters())) if s is not None]
            tracker.track_external(
                model,
                optimizer,
                *[s.shard for s in shards],
                *[s.replica for s in shards if s.replica is not None],
                *[v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)],
            )
            with torch._dynamo.config.patch(error_on_recompile=True), fake_mode, tracker, warnings.catch_warnings():
                # the tracker's module hooks are global: torch warns that compiled modules fire them twice
                warnings.filterwarnings("ignore", "Using `torch.compile.module.` when there are global hooks")
                loss = forward()
                forward_peak = _total(tracker.get_tracker_snapshot("peak"))
                loss.backward()
                del loss
                backward_peak = _total(tracker.get_tracker_snapshot("peak"))
                optimizer.step()
                optimizer.zero_grad()
        finally:
            torch._dynamo.reset()
    peak = _parts(tracker.get_tracker_snapshot("peak"))
    return TrackedStep(peak["Total"], forward_peak, backward_peak, peak, tracker.functional_collectives, graphs)


def _parts(snapshot: dict) -> dict[str, int]:
    """The one (CPU) device's snapshot: category name -> bytes."""
    (parts,) = snapshot.values()
    return {getattr(k, "value", k): int(v) for k, v in parts.items()}


def _total(snapshot: dict) -> int:
    return _parts(snapshot)["Total"]
