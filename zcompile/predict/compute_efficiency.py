"""How much of its micro-benchmarked rates a training step's compute reaches on this machine.

``cost_model.measure_compute_costs`` times one op at a time: a 512x512 matmul, a 4 MiB clone, an
add of one element. A compiled training step runs hundreds of ops of other shapes through the
graphs' generated code, on every rank of the host at once. On a CPU that step's graphs reach less
than the rates the micro-benchmarks give (the ranks' matmuls share the host, the generated code
adds its own Python and allocations), so a roofline on the micro-benchmarks alone predicts steps
shorter than they are.

``measure_compute_efficiency`` measures that fraction on a reference workload that is none of the
models it is used to predict: two of torch's ``TransformerEncoderLayer`` (pre-norm, d_model 96, 4
heads, sequence 128), compiled with ``backend="zero"`` at stage 1 (whose graphs hold no collective),
forward and backward run on every rank at once and timed, against the cost model's prediction for
the same compiled graphs. The hardware profile keeps it as ``compute_efficiency``, and
``HardwareProfile.compute_costs`` divides every op's predicted time by it. A GPU profile leaves it
out (1): its figures are datasheet peaks (README, Simulate).
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
import torch.distributed as dist

from zcompile.common.process_group import DataParallelGroup, all_gather_eager
from zcompile.predict.cost_model import CollectiveCosts, ComputeCosts, predict_step

log = logging.getLogger(__name__)

REFERENCE_SHAPE = (4, 128, 96)  # batch, sequence, d_model of the reference workload
REFERENCE_LAYERS = 2


def reference_model(shape: tuple[int, int, int] = REFERENCE_SHAPE, layers: int = REFERENCE_LAYERS) -> torch.nn.Module:
    """The reference workload's model for inputs of ``shape`` (batch, sequence, d_model; d_model a
    multiple of 4): ``layers`` of torch's ``TransformerEncoderLayer`` (12 parameters each), no dropout."""
    torch.manual_seed(0)
    layer = dict(
        d_model=shape[2], nhead=4, dim_feedforward=4 * shape[2], dropout=0.0, batch_first=True, norm_first=True
    )
    return torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(**layer) for _ in range(layers)])


def reference_loss(output: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


def measure_compute_efficiency(
    compute: ComputeCosts, group: dist.ProcessGroup | None = None, repeats: int = 15, graph_call_overhead_s: float = 0.0
) -> float:
    """Predicted over measured time of the reference workload's compiled forward and backward (module
    docstring), run on every rank of ``group`` at once (a barrier before each run), the median of
    ``repeats`` runs after two warm-up runs on the slowest rank, less ``graph_call_overhead_s`` per
    graph call (a profile's host time, priced apart; not its per-parameter time, most of which is the
    optimizer's, which this does not run); at most 1. The same on every rank: every rank of ``group``
    must call it. Each call compiles the reference model again: a caller that measures more often
    than Dynamo's recompile limit allows resets Dynamo between calls (``measure_cpu_profile``)."""
    resolved = DataParallelGroup.resolve(group)
    graphs: list = []
    model = reference_model()
    compiled = torch.compile(model, backend="zero", options={"stage": 1, "on_compile": graphs.append})
    inputs = torch.randn(REFERENCE_SHAPE)
    times = []
    for run in range(repeats + 2):
        if resolved.world_size > 1:
            dist.barrier(group=resolved.process_group)
        start = time.perf_counter()
        reference_loss(compiled(inputs)).backward()
        if run >= 2:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    measured = statistics.median(times)
    if resolved.world_size > 1:
        # the slowest rank's: a step goes at its pace (its collectives wait for it), and with more ranks
        # than cores the scheduler leaves some ranks behind
        local = torch.tensor([measured], dtype=torch.float64)
        every = torch.empty(resolved.world_size, dtype=torch.float64)
        all_gather_eager(every, local, resolved)
        measured = max(every.tolist())
    calls = 2 * len(graphs)  # a forward and a backward graph each
    predicted = predict_step(graphs, CollectiveCosts(resolved.world_size), compute).step_s
    efficiency = min(predicted / max(measured - calls * graph_call_overhead_s, 1e-9), 1.0)
    log.info(
        "compute efficiency: reference step %.2f ms measured (%d graph calls), %.2f ms predicted: %.2f",
        measured * 1e3,
        calls,
        predicted * 1e3,
        efficiency,
    )
    return efficiency
