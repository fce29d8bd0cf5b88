"""The cost model's predicted step time and exposed communication against measured ones.

    torchrun --nproc-per-node 2 benchmarks/bench_cost_model.py [--layers 4 8] [--steps 5]

For each number of layers and ``overlap`` on and off: the example GPT trained with
``backend="zero"`` (stage 3, eager inner compiler, small buckets so that each block gathers its
own), a few warm-up steps, then the prediction of ``zcompile.predict.cost_model.predict_step`` over the
forward and backward graphs, from collective and compute costs measured once at the start
(agreed across ranks). Measured, medians over ``--steps`` steps: forward + backward under
``zcompile.timeline.record_step`` (time inside the compiled graphs, and in ``wait_tensor`` = the
exposed communication; graphs minus waits is the compute stream's own work, compared with the
predicted compute + issue), and the same forward + backward unprofiled (wall clock: no profiler
cost per op, but the autograd engine and Python between the graphs, which the model leaves out).
The optimizer step is not timed: the prediction covers the graphs only.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from common import print_table  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

import zcompile  # noqa: E402
from zcompile.passes.collectives import ALL_GATHER, COLLECTIVE_KINDS, REDUCE_SCATTER  # noqa: E402
from zcompile.predict.cost_model import measure_collective_costs, measure_compute_costs, predict_step  # noqa: E402
from zcompile.reports.timeline import record_step  # noqa: E402

PRINTED_KINDS = (COLLECTIVE_KINDS[ALL_GATHER], COLLECTIVE_KINDS[REDUCE_SCATTER])  # the measured costs printed
GRAPH_EVENTS = ("CompiledFunction", "CompiledFunctionBackward")  # AOTAutograd's forward and backward graphs


def graph_seconds(trace_path: str) -> float:
    """Time inside the compiled graphs in a trace: what ``predict_step`` models (no autograd engine,
    Dynamo guards or Python between the graphs)."""
    with open(trace_path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return sum(e.get("dur", 0.0) for e in events if e.get("ph") == "X" and e.get("name") in GRAPH_EVENTS) / 1e6


def measure_config(
    args, layers: int, overlap: bool, collective_costs, compute_costs, trace_dir: str, device: torch.device
):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = GPTConfig(n_layer=layers, n_embd=args.embd)
    model = GPT(config).to(device)
    graphs = []
    options = {"stage": 3, "overlap": overlap, "bucket_mb": args.bucket_mb, "on_compile": graphs.append}
    compiled = torch.compile(model, backend="zero", options=options)
    optimizer = zcompile.optim.AdamW(model.parameters(), lr=1e-3)
    local = slice(rank * args.batch_size // world, (rank + 1) * args.batch_size // world)
    step = {"n": 0}

    def forward_backward():
        tokens, targets = synthetic_batch(step["n"], args.batch_size, config)
        compiled(tokens[local].to(device), targets[local].to(device)).backward()

    def optimizer_step():
        optimizer.step()
        optimizer.zero_grad()
        step["n"] += 1

    for _ in range(args.warmup):
        forward_backward()
        optimizer_step()
    prediction = predict_step(graphs, collective_costs, compute_costs)
    in_graphs, waited, wall = [], [], []
    for _ in range(args.steps):
        dist.barrier()  # the ranks start the step together: waits measure communication, not skew
        result = record_step(forward_backward, trace_dir)
        in_graphs.append(graph_seconds(result.trace_path))
        waited.append(result.wait_us / 1e6)
        optimizer_step()
        dist.barrier()
        start = time.perf_counter()
        forward_backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall.append(time.perf_counter() - start)
        optimizer_step()
    measured = {
        name: statistics.median(values)
        for name, values in (("in_graphs", in_graphs), ("waited", waited), ("wall", wall))
    }
    every_rank = [None] * world
    dist.all_gather_object(every_rank, measured)  # waits differ by rank: a rank also waits for a slower peer
    return prediction, every_rank


def row(layers: int, overlap: bool, p, every_rank: list[dict]) -> tuple[str, ...]:
    """One table row: rank 0's measurements, and each rank's time waited."""
    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    m = every_rank[0]
    predicted_busy = p.compute_s + p.issue_s  # the compute stream's own work, waits left out
    busy = m["in_graphs"] - m["waited"]
    return (
        str(layers),
        "on" if overlap else "off",
        str(len(p.collectives)),
        ms(predicted_busy),
        ms(busy),
        error(predicted_busy, busy),
        ms(p.comm_s),
        ms(p.exposed_comm_s),
        " / ".join(ms(r["waited"]) for r in every_rank),
        error(p.exposed_comm_s, m["waited"]),
        ms(p.step_s),
        ms(m["wall"]),
        error(p.step_s, m["wall"]),
        ms(m["in_graphs"]),
        error(p.step_s, m["in_graphs"]),
    )


def error(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured * 100:+.0f}%" if measured > 0 else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--steps", type=int, default=5, help="measured steps per configuration (median)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch, split across ranks")
    parser.add_argument("--bucket-mb", type=float, default=0.25)
    parser.add_argument("--trace-dir", default=None, help="where record_step writes its traces (default: a temp dir)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    collective_costs = measure_collective_costs()
    compute_costs = measure_compute_costs(device)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layers in args.layers:
            for overlap in (True, False):
                prediction, every_rank = measure_config(
                    args, layers, overlap, collective_costs, compute_costs, args.trace_dir or tmp, device
                )
                rows.append(row(layers, overlap, prediction, every_rank))
    if rank == 0:
        print(
            f"costs agreed over {world} ranks: "
            + ", ".join(
                f"{kind} {c.latency_s * 1e6:.0f} us + {c.seconds_per_byte * 1e9:.2f} ns/B (issue {c.issue_latency_s * 1e6:.0f} us"
                f" + {c.issue_seconds_per_byte * 1e9:.2f} ns/B)"
                for kind, c in collective_costs.costs.items()
                if kind in PRINTED_KINDS
            )
            + f"; compute {compute_costs.flops_per_s / 1e9:.1f} GFLOP/s, "
            f"{compute_costs.bytes_per_s / 1e9:.1f} GB/s, {compute_costs.op_overhead_s * 1e6:.1f} us/op",
            flush=True,
        )
        title = (
            f"{device.type}: GPT stage 3, embd {args.embd}, batch {args.batch_size} over {world} ranks, bucket "
            f"{args.bucket_mb} MiB; forward+backward in ms, median of {args.steps} steps. P: predicted; "
            f"graphs, waited: under record_step (rank 0; waited for each rank); wall: unprofiled; "
            f"err: P against the measured column before it"
        )
        os.environ.setdefault("COLUMNS", "220")  # rich: one line per row even when not on a terminal
        print_table(
            title,
            (
                "layers",
                "overlap",
                "colls",
                "P compute+issue",
                "graphs-waited",
                "err",
                "P comm",
                "P exposed",
                "waited",
                "err",
                "P step",
                "wall",
                "err",
                "graphs",
                "err",
            ),
            rows,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
