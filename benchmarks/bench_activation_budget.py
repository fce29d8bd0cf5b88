"""Saved activations and step time against ``activation_memory_budget``, on the example GPT.

    torchrun --nproc-per-node 2 benchmarks/bench_activation_budget.py [--out benchmarks/results/activation_budget_2.json]

The example GPT with 8 layers, n_embd 128 and sequences of 256 tokens (4 per rank), at stages 2 and
3, compiled with each budget; AdamW steps. Saved activations are what the partitioned forward
hands the backward (``step_report().memory["saved_activation_bytes"]``); step time is the median
over ``--steps`` steps of the slowest rank, budgets trained in alternating steps so that drift of
this shared machine hits them alike. Goal (issue 15): at 0.5, saved activations <= 55% of the
default's, with the step-time cost stated.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "examples")]

from common import print_table, start_gloo_benchmark, timed_training_step  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

import zcompile  # noqa: E402
import zcompile.optim  # noqa: E402

BUDGETS = (None, 0.75, 0.5, 0.25, 0.0)
CONFIG = GPTConfig(n_layer=8, n_embd=128, block_size=256)
PER_RANK = 4


def _step(compiled, optimizer, step: int, rank: int) -> float:
    tokens, targets = synthetic_batch(step, PER_RANK * dist.get_world_size(), CONFIG)
    local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return timed_training_step(compiled, optimizer, tokens[local], targets[local])


def run_stage(stage: int, steps: int, rank: int) -> list[dict]:
    runs = []
    for budget in BUDGETS:
        torch._dynamo.reset()  # each model its own compiled graphs (a fresh cache for the options)
        torch.manual_seed(0)
        model = GPT(CONFIG)
        compiled = torch.compile(model, backend="zero", options={"stage": stage, "activation_memory_budget": budget})
        optimizer = zcompile.optim.AdamW(model.parameters(), lr=3e-3)
        _step(compiled, optimizer, 0, rank)  # compile
        runs.append((budget, model, compiled, optimizer, []))
    for step in range(1, steps + 1):
        for budget, model, compiled, optimizer, times in runs:
            times.append(_step(compiled, optimizer, step, rank))
    rows = []
    default_saved = None
    for budget, model, compiled, optimizer, times in runs:
        memory = zcompile.step_report(model, optimizer).memory
        saved = memory["saved_activation_bytes"]
        default_saved = saved if budget is None else default_saved
        rows.append(
            {
                "stage": stage,
                "budget": budget,
                "saved_mib": saved / 2**20,
                "saved_vs_default": saved / default_saved,
                "step_ms": statistics.median(times) * 1e3,
                "peak_gathered_mib": memory["peak_gathered_bytes"] / 2**20,
            }
        )
    base = rows[0]["step_ms"]
    for row in rows:
        row["step_vs_default"] = row["step_ms"] / base
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rank, world, cores = start_gloo_benchmark()
    rows = [row for stage in (2, 3) for row in run_stage(stage, args.steps, rank)]
    if rank == 0:
        print_table(
            f"activation_memory_budget, example GPT 8x128, seq 256, {world} gloo ranks, {cores} cores",
            ("stage", "budget", "saved MiB", "x default", "step ms", "x default step", "peak gathered MiB"),
            [
                (
                    str(r["stage"]),
                    str(r["budget"]),
                    f"{r['saved_mib']:.2f}",
                    f"{r['saved_vs_default']:.2f}",
                    f"{r['step_ms']:.0f}",
                    f"{r['step_vs_default']:.2f}",
                    f"{r['peak_gathered_mib']:.2f}",
                )
                for r in rows
            ],
        )
        if args.out:
            with open(args.out, "w") as handle:
                json.dump({"world": world, "cores": cores, "torch": torch.__version__, "rows": rows}, handle, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
