"""Fits the ``cpu-local`` hardware profile on this machine (``zcompile/hardware_profiles/cpu-local.json``).

    torchrun --nproc-per-node 2 benchmarks/measure_cpu_profile.py

The cost model's own measurements (``cost_model.measure_compute_costs`` in fp32 and bf16,
``measure_collective_costs`` on the gloo group) turned into the profile's form: a link's bus
bandwidth from the all-gather's fitted seconds per byte (``bus = (N - 1) / N / seconds_per_byte``,
nccl-tests' rule, which ``zcompile.hardware`` inverts) and its latency per ``log2 N`` step. One
machine is one node: both links are the same.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import start_gloo_benchmark  # noqa: E402

from zcompile.cost_model import measure_collective_costs, measure_compute_costs  # noqa: E402
from zcompile.hardware import PROFILE_DIR, load_profile  # noqa: E402


def main() -> None:
    rank, world, cores = start_gloo_benchmark()
    fp32 = measure_compute_costs(dtype=torch.float32)
    bf16 = measure_compute_costs(dtype=torch.bfloat16)
    gather = measure_collective_costs(kinds=("all_gather",), measure_overlap=False).cost("all_gather")
    link = {"bus_bytes_per_s": (world - 1) / world / gather.seconds_per_byte,
            "latency_s": gather.latency_s / math.ceil(math.log2(world))}
    profile = {
        "name": "cpu-local",
        "description": f"this development machine: {cores} CPU cores, {world} gloo ranks on one host",
        "sources": {
            "peak_flops_per_s": "zcompile.cost_model.measure_compute_costs: 512x512 matmul, fp32 and bf16",
            "memory_bytes_per_s": "measure_compute_costs: clone of 4 MiB",
            "memory_bytes": "24 GiB, the machine's memory (shared by the ranks)",
            "op_overhead_s": "measure_compute_costs: aten.add of one element, per call",
            "links": f"measure_collective_costs: gloo all-gather, {world} ranks, bus bandwidth by nccl-tests' rule",
        },
        "peak_flops_per_s": {"fp32": fp32.flops_per_s, "bf16": bf16.flops_per_s},
        "memory_bytes_per_s": fp32.bytes_per_s,
        "memory_bytes": 24 * 2**30,
        "op_overhead_s": fp32.op_overhead_s,
        "node_size": world,
        "links": {"intra_node": link, "inter_node": link},
    }
    if rank == 0:
        path = PROFILE_DIR / "cpu-local.json"
        path.write_text(json.dumps(profile, indent=2) + "\n")
        load_profile(path)  # validates what was written
        print(json.dumps(profile, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
