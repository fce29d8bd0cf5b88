"""Fits the ``cpu-local`` hardware profile on this machine (``zcompile/hardware_profiles/cpu-local.json``).

    torchrun --nproc-per-node 2 benchmarks/measure_cpu_profile.py [--out PATH] [--fits 3] [--repeats 15]

The cost model's own measurements (``cost_model.measure_compute_costs`` in fp32 and bf16,
``measure_collective_costs`` on the gloo group) turned into the profile's form: a link's bus
bandwidth from the all-gather's fitted seconds per byte (``bus = (N - 1) / N / seconds_per_byte``,
nccl-tests' rule, which ``zcompile.hardware`` inverts) and its latency per ``log2 N`` step. One
machine is one node: both links are the same.

The all-gather is timed at 4 KiB to 4 MiB in steps of 4x (``SIZES``), ``--repeats`` rounds: with
the cost model's default four sizes and five rounds the least-squares line hangs on the 4 MiB
point, and one slow round there moved the fitted latency from 0.4 to 3.4 ms on this machine.
Two fits a minute apart on the quiet machine still differed 2.5x in matmul FLOP/s (39-102 GFLOP/s:
the other engineers' jobs on the 2 shared cores) and 3x in latency, so the profile keeps each
figure's best over ``--fits`` fits (``BEST``: load only slows a micro-benchmark down; every fit is
kept in the file under ``measured``). A first, discarded round of the compute micro-benchmarks warms the
allocator: the 4 MiB clone that measures memory bandwidth ran at 2.5-4.8 GB/s in a fresh process
(every output freshly mapped, page faults) and at 49-68 GB/s once glibc's allocator had adapted,
which is the state of a training step after its first steps and of ``zcompile.tune``'s own
measurement; without it the figure depended on which fit came first. The reduce-scatter is timed
too: gloo runs it as an all-reduce, so the link's ``bus_factor`` for it is its bus bandwidth over
the all-gather's (about 2). The compute figures are measured on every rank at once, as training
runs them; the overlap slowdown is the contention factor that reproduces an all-gather's overlap
with compute (``cost_model._overlap_slowdown``). ``--out``: write there instead of the shipped profile.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import start_gloo_benchmark  # noqa: E402

from zcompile.cost_model import measure_collective_costs, measure_compute_costs  # noqa: E402
from zcompile.hardware import PROFILE_DIR, load_profile  # noqa: E402

SIZES = tuple(2**k for k in range(12, 23, 2))  # bytes: 4 KiB to 4 MiB
# the figure kept from several fits: other processes only ever slow a micro-benchmark down, so the
# fastest fit is the machine's own (rates: the most; latencies and overheads: the least; the median
# of the slowdown, a ratio of two timings); a link's bandwidth and latency are one fitted line, kept
# together from the fit that moves 1 MiB fastest
BEST = {"fp32": max, "bf16": max, "memory_bytes_per_s": max, "op_overhead_s": min,
        "attention_efficiency": statistics.median, "transcendental_bytes_per_s": max,
        "overlap_slowdown": statistics.median}
LINK_PROBE_BYTES = 2**20


def fastest_link(fits: list[dict], prefix: str, world: int) -> dict:
    """The (bus bandwidth, latency) pair of the fit that moves ``LINK_PROBE_BYTES`` fastest."""
    best = min(fits, key=lambda f: f[f"{prefix}latency_s"] * math.ceil(math.log2(world))
               + LINK_PROBE_BYTES * (world - 1) / world / f[f"{prefix}bus_bytes_per_s"])
    return {"bus_bytes_per_s": best[f"{prefix}bus_bytes_per_s"], "latency_s": best[f"{prefix}latency_s"]}


def as_link(cost, world: int) -> dict:
    """A fitted ``CollectiveCost`` in the profile's link form (bus bandwidth, latency per log2 N step)."""
    return {"bus_bytes_per_s": (world - 1) / world / cost.seconds_per_byte,
            "latency_s": cost.latency_s / math.ceil(math.log2(world))}


def fit_once(world: int, repeats: int, compute_repeats: int) -> dict:
    """One fit of every figure the profile holds (and the reduce-scatter, for the record), agreed across ranks.

    The compute micro-benchmarks start together on every rank (a barrier): training runs every rank
    of the host at once, and on this 2-vCPU VM a rank's matmuls ran at 45-63 GFLOP/s while the other
    rank computed against 88 alone."""
    dist.barrier()
    fp32 = measure_compute_costs(dtype=torch.float32, repeats=compute_repeats)
    dist.barrier()
    bf16 = measure_compute_costs(dtype=torch.bfloat16, repeats=compute_repeats)
    costs = measure_collective_costs(kinds=("all_gather", "reduce_scatter"), sizes=SIZES, repeats=repeats)
    gather, scatter = as_link(costs.cost("all_gather"), world), as_link(costs.cost("reduce_scatter"), world)
    issue = costs.cost("all_gather")
    return {"fp32": fp32.flops_per_s, "bf16": bf16.flops_per_s, "memory_bytes_per_s": fp32.bytes_per_s,
            "op_overhead_s": fp32.op_overhead_s, "attention_efficiency": fp32.attention_flops_per_s / fp32.flops_per_s,
            "transcendental_bytes_per_s": fp32.transcendental_bytes_per_s,
            "bus_bytes_per_s": gather["bus_bytes_per_s"], "latency_s": gather["latency_s"],
            "issue_latency_s": issue.issue_latency_s,
            "issue_bytes_per_s": 1.0 / issue.issue_seconds_per_byte if issue.issue_seconds_per_byte > 0 else 0.0,
            "reduce_scatter_bus_bytes_per_s": scatter["bus_bytes_per_s"],
            "reduce_scatter_latency_s": scatter["latency_s"], "overlap_slowdown": costs.overlap_slowdown}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(PROFILE_DIR / "cpu-local.json"))
    parser.add_argument("--repeats", type=int, default=15, help="rounds over the collective sizes per fit")
    parser.add_argument("--compute-repeats", type=int, default=5, help="runs of each compute micro-benchmark per fit")
    parser.add_argument("--fits", type=int, default=3, help="independent fits; the profile keeps the best (BEST)")
    args = parser.parse_args()
    rank, world, cores = start_gloo_benchmark()
    measure_compute_costs(dtype=torch.float32, repeats=args.compute_repeats)  # warm-up: see the module doc
    fits = [fit_once(world, args.repeats, args.compute_repeats) for _ in range(args.fits)]
    fit = {key: best(f[key] for f in fits) for key, best in BEST.items()}
    link = fastest_link(fits, "", world)
    issue = min(fits, key=lambda f: f["issue_latency_s"] + (LINK_PROBE_BYTES / f["issue_bytes_per_s"]
                                                          if f["issue_bytes_per_s"] > 0 else 0.0))
    link["issue_latency_s"] = issue["issue_latency_s"]
    if issue["issue_bytes_per_s"] > 0:
        link["issue_bytes_per_s"] = issue["issue_bytes_per_s"]
    scatter = fastest_link(fits, "reduce_scatter_", world)
    # gloo runs a reduce-scatter as an all-reduce: its bytes per byte moved, over the all-gather's
    link["bus_factor"] = {"reduce_scatter": max(1.0, link["bus_bytes_per_s"] / scatter["bus_bytes_per_s"])}
    profile = {
        "name": "cpu-local",
        "description": f"this development machine: {cores} CPU cores, {world} gloo ranks on one host",
        "sources": {
            "peak_flops_per_s": "zcompile.cost_model.measure_compute_costs: 512x512 matmul, fp32 and bf16, "
                                "every rank at once",
            "memory_bytes_per_s": "measure_compute_costs: clone of 4 MiB",
            "memory_bytes": "24 GiB, the machine's memory (shared by the ranks)",
            "op_overhead_s": "measure_compute_costs: aten.add of one element, per call",
            "attention_efficiency": "measure_compute_costs: causal scaled_dot_product_attention (4, 4, 128, 32) "
                                    "FLOP/s over the matmul's, fp32",
            "transcendental_bytes_per_s": "measure_compute_costs: median of GELU, exp, softmax, layer norm of 4 MiB",
            "links": f"measure_collective_costs: gloo all-gather, {world} ranks, 4 KiB-4 MiB, {args.repeats} rounds, "
                     "bus bandwidth by nccl-tests' rule; issue: the time until the call returns, same fit; "
                     "bus_factor: the reduce-scatter's bus bandwidth so measured, over the all-gather's",
            "overlap_slowdown": "measure_collective_costs: an all-gather of 4 MiB with a matmul loop of its length, "
                                "against each alone (cost_model._overlap_slowdown)",
            "fits": f"each figure the best of {args.fits} fits (benchmarks/measure_cpu_profile.py, BEST); "
                    "'measured' holds every fit and the reduce-scatter's own fit",
            "load": f"load average {os.getloadavg()[0]:.2f} when the fit ended",
        },
        "device_type": "cpu",
        "peak_flops_per_s": {"fp32": fit["fp32"], "bf16": fit["bf16"]},
        "memory_bytes_per_s": fit["memory_bytes_per_s"],
        "memory_bytes": 24 * 2**30,
        "op_overhead_s": fit["op_overhead_s"],
        "attention_efficiency": min(fit["attention_efficiency"], 1.0),
        "transcendental_bytes_per_s": fit["transcendental_bytes_per_s"],
        "overlap_slowdown": fit["overlap_slowdown"],
        "node_size": world,
        "links": {"intra_node": link, "inter_node": link},
        "measured": {"reduce_scatter": scatter, "fits": fits},
    }
    if rank == 0:
        path = Path(args.out)
        path.write_text(json.dumps(profile, indent=2) + "\n")
        load_profile(path)  # validates what was written
        print(json.dumps({k: v for k, v in profile.items() if k != "measured"}, indent=2))
        for f in fits:
            print(" ".join(f"{k} {v:.3g}" for k, v in f.items()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
