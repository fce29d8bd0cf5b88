"""``step_peak``: the most bytes one rank holds during a training step, read from its compiled graphs.

``step_report``'s memory parts (model states, gathered peak, kept weights, saved activations) are
what a step holds for long. Its peak also holds backward's transients (activation gradients, the
logits' gradient, the zeros autograd makes as the gradient of an output the loss does not read),
forward's intermediates while they live and the gradients made so far. This walks the graphs of
one step in the order they run (``passes.liveness.live_peak_bytes``: each value from its node to
its last reader, as the generated code frees it) and gives each phase's peak, model states included:

- ``forward<i>``: parameters and optimizer state, the storages every earlier graph saved for
  backward (activations and kept gathered weights, ``liveness.saved_storages``), and graph i's
  forward walk (its outputs to its end);
- ``backward<i>`` (the last graph's first): the same states and earlier graphs' saved storages, the
  gradients the later graphs' backward made (their share of the gradient bytes by parameter count),
  and graph i's backward walk with its saved storages and tangents from its start, each freed after
  its last reader: both inner compilers run the backward in the boxed calling convention, which
  clears the argument list AOTAutograd hands over (``zcompile.backend.aot.boxed_graph_function``,
  where ``make_boxed_func`` would keep every input to the end). Inductor's fusions keep fewer
  intermediates than the FX graph walked here holds, so there the walk is an upper bound;
- ``optimizer``: the model states with the gradients and the step's own buffers
  (``optimizer_buffers_bytes``: ``optim.buckets.replayed_step_buffer_peak`` in ``simulate``).

On gloo (``gather_staging``) each all-gather's second buffer is counted too: gloo gathers into a flat
buffer of its own and copies out of it. Not counted: the update's intermediates; with several graphs (graph
breaks), the tensors eager code carries between them (a hidden state and its gradient); the batch;
forward outputs kept through backward (taken as dropped: ``loss = model(x).loss; loss.backward()``).
Checked against torch's ``MemTracker`` over the same compiled step (``tests/unit/test_step_peak.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from zcompile.passes.liveness import live_peak_bytes, node_bytes, saved_for_backward, saved_storages, storage_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepPeak:
    """Bytes per rank at each phase's peak (module doc), model states included."""

    states_bytes: int  # parameters and optimizer state: held through the whole step
    phases: dict[str, int]  # "forward0", "backward0", "optimizer" -> bytes

    @property
    def peak_bytes(self) -> int:
        return max(self.phases.values(), default=self.states_bytes)

    @property
    def where(self) -> str:
        """The phase that holds the peak."""
        return max(self.phases, key=self.phases.get, default="")


def step_peak(
    graphs: list,
    params_bytes: int,
    grads_bytes: int,
    optimizer_bytes: int,
    hold_backward_inputs: bool = False,
    gather_staging: bool = False,
    optimizer_buffers_bytes: int = 0,
) -> StepPeak:
    """The step's peak from the ``CompiledGraphs`` of one step (``on_compile``'s, in compile order, a
    graph the step runs several times once per call) and this rank's model states (``estimate_memory``'s or ``model_state_bytes``' parts).
    ``hold_backward_inputs``: the peak if each backward kept its saved values and tangents until it
    returned, as ``make_boxed_func`` does (what the boxed call saves).
    ``gather_staging``: the graphs' all-gathers run on gloo, which holds each gathered output twice
    until its wait (``liveness.live_peak_bytes``)."""
    states = params_bytes + optimizer_bytes
    saved = [_saved(g) for g in graphs]
    grads_after = _grads_made_after(graphs, grads_bytes)
    phases: dict[str, int] = {}
    for i, g in enumerate(graphs):
        if g.forward is not None:
            phases[f"forward{i}"] = (
                states + sum(map(_total, saved[:i])) + live_peak_bytes(g.forward, gather_staging=gather_staging)
            )
    for i, g in reversed(list(enumerate(graphs))):
        if g.forward is not None and g.backward is not None:
            walk = live_peak_bytes(
                g.backward, _backward_preloaded(g), hold_inputs=hold_backward_inputs, gather_staging=gather_staging
            )
            phases[f"backward{i}"] = states + sum(map(_total, saved[:i])) + grads_after[i] + walk
    phases["optimizer"] = states + grads_bytes + optimizer_buffers_bytes
    result = StepPeak(states, phases)
    if sum(g.forward is not None for g in graphs) > 1:  # graphs: one entry per call (simulate's walk)
        log.warning(
            "zcompile: the step peak of %d compiled graphs, %d calls (graph breaks), does not count the tensors "
            "eager code carries between them (a hidden state and its gradient)",
            len({id(g) for g in graphs}),
            len(graphs),
        )
    log.info(
        "step peak %.1f MiB in %s (parameters and optimizer state %.1f MiB)",
        result.peak_bytes / 2**20,
        result.where,
        states / 2**20,
    )
    return result


def _saved(g) -> dict:
    """Graph ``g``'s saved storages (``liveness.saved_storages``; none for a graph with no backward)."""
    if g.forward is None or g.backward is None:
        return {}
    return saved_storages(g.forward, g.backward)


def _total(storages: dict) -> int:
    return sum(nbytes for _, nbytes in storages.values())


def _backward_preloaded(g) -> dict:
    """The backward's placeholders alive from its start: each saved value's storage (placeholders of
    one storage share its key; saved inputs and views of them have none) and the tangents."""
    preloaded = {}
    placeholders = list(g.backward.graph.find_nodes(op="placeholder"))
    arriving = [p for p in placeholders if not p.name.startswith("tangents")]
    for placeholder, value in zip(arriving, saved_for_backward(g.forward, g.backward)):
        key, nbytes = storage_of(g.forward, value)
        if key is not None:
            preloaded[placeholder] = (key, nbytes)
    preloaded.update({p: (p, node_bytes(p)) for p in placeholders if p.name.startswith("tangents")})
    return preloaded


def _grads_made_after(graphs: list, grads_bytes: int) -> list[int]:
    """Per graph, the gradient bytes the graphs after it have made when its backward starts: the
    share of ``grads_bytes`` of the parameters those graphs train (by element count; a graph without
    a sharding plan trains none it can name)."""
    trained = [
        {p.name: torch.Size(p.shape).numel() for p in (g.plan.params if g.plan else []) if p.requires_grad}
        for g in graphs
    ]
    total = sum({name: n for t in trained for name, n in t.items()}.values())
    out = []
    for i in range(len(graphs)):
        later = {name: n for t in trained[i + 1 :] for name, n in t.items()}
        out.append(grads_bytes * sum(later.values()) // total if total else 0)
    return out
