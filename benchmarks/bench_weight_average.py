"""A momentum teacher's update at stage 3: ``zcompile.lerp_weights_`` against ``gathered``.

    torchrun --nproc-per-node 2 benchmarks/bench_weight_average.py    # results/weight_average_2.json

The example GPT (n_embd 128) as student and as its frozen teacher, both compiled at stage 3 and
called once. Then, alternating, the teacher's update ``t += 0.01 (s - t)``: inside
``zcompile.gathered(student), zcompile.gathered(teacher)`` over the full weights, the only way
before, and by ``lerp_weights_`` over this rank's shards. Median ms of the slowest rank over the
rounds, and the most memory one update allocated on top of what was live (torch's profiler, rank 0),
against the model's fp32 bytes.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import depth_sweep_arguments, print_table, slowest_ms, start_gloo_benchmark  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

import zcompile  # noqa: E402
from zcompile.reports.timeline import record_step  # noqa: E402

MOMENTUM = 0.01


def _through_gathered(student: torch.nn.Module, teacher: torch.nn.Module) -> None:
    with zcompile.gathered(student), zcompile.gathered(teacher), torch.no_grad():
        for t, s in zip(teacher.parameters(), student.parameters()):
            t.lerp_(s, MOMENTUM)


def _on_shards(student: torch.nn.Module, teacher: torch.nn.Module) -> None:
    zcompile.lerp_weights_(teacher, student, MOMENTUM)


def measure(layers: int, rounds: int, rank: int, trace_dir: str) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    student = GPT(GPTConfig(n_layer=layers, n_embd=128, n_head=4, block_size=128, vocab_size=512))
    teacher = copy.deepcopy(student).requires_grad_(False)
    tokens = torch.randint(0, 512, (2, 128))
    for model in (student, teacher):
        with torch.no_grad():
            torch.compile(model, backend="zero", options={"stage": 3})(tokens)  # compiles and shards it
    ways = {"gathered": _through_gathered, "lerp_weights_": _on_shards}
    times = {name: [] for name in ways}
    for _ in range(rounds):
        for name, way in ways.items():
            times[name].append(slowest_ms(lambda: way(student, teacher)))
    model_bytes = sum(p.numel() * 4 for p in student.parameters())
    row = {"layers": layers, "model_MiB": model_bytes / 2**20}
    for name, way in ways.items():
        row[f"{name}_ms"] = statistics.median(times[name])
        row[f"{name}_peak_MiB"] = record_step(lambda: way(student, teacher), trace_dir, rank).peak_bytes / 2**20
    return row


def main() -> None:
    args = depth_sweep_arguments(__doc__, "weight_average_2.json")
    rank, world, cores = start_gloo_benchmark()
    trace_dir = os.path.join("/tmp", f"bench_weight_average_{os.getpid()}")
    rows = [measure(layers, args.rounds, rank, trace_dir) for layers in args.layers]
    if rank == 0:
        print_table(
            f"teacher update at stage 3, {world} ranks ({cores} cores): median ms / peak MiB added",
            ["layers", "model MiB", "gathered ms", "lerp_weights_ ms", "gathered peak", "lerp_weights_ peak"],
            [
                [
                    str(r["layers"]),
                    f"{r['model_MiB']:.2f}",
                    f"{r['gathered_ms']:.2f}",
                    f"{r['lerp_weights__ms']:.2f}",
                    f"{r['gathered_peak_MiB']:.2f}",
                    f"{r['lerp_weights__peak_MiB']:.2f}",
                ]
                for r in rows
            ],
        )
        with open(args.out, "w") as handle:
            json.dump({"world_size": world, "cores": cores, "rounds": args.rounds, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
