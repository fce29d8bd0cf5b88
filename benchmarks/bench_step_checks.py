"""Per-step cost of the runtime rank checks, on the example GPT (the main job's model).

    torchrun --nproc-per-node 2 benchmarks/bench_step_checks.py [--steps 30] [--out benchmarks/results/step_checks_2.json]

For each stage, the example GPT (``examples/gpt.py`` defaults: 4 layers, n_embd 128, the
``train_gpt.py`` global batch of 16) trains ``--steps`` AdamW steps with the defaults: the ranks
agree through the store before every ``optimizer.step()`` (``zcompile.step_agreement``) and, at
stage 3, before every compiled call; ``skip_nonfinite=True`` adds its all-reduced flag. The time
spent inside those checks is measured directly (each check function is timed where the optimizer
and the backend call it), so the ratio check time / step time is not drowned in the run-to-run
noise of whole steps (up to 30% on this shared 2-core machine). The step time is the median over
steps of the slowest rank's wall clock; the check time per step is the total over the timed steps
divided by their number, slowest rank. Goal (issue 14): below 1% of a step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "examples")]

import zcompile  # noqa: E402
import zcompile.backend  # noqa: E402
import zcompile.optim  # noqa: E402
from common import print_table, start_gloo_benchmark  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402


class CheckTimer:
    """Wraps the check functions where their callers look them up, and adds up their time."""

    def __init__(self):
        self.seconds = 0.0

    def timed(self, function):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return wrapper

    def install(self) -> None:
        zcompile.backend.agree_on_call = self.timed(zcompile.backend.agree_on_call)
        zcompile.optim.agree_before_step = self.timed(zcompile.optim.agree_before_step)
        if hasattr(zcompile.optim, "nonfinite_flag"):
            zcompile.optim.nonfinite_flag = self.timed(zcompile.optim.nonfinite_flag)


def run_stage(stage: int, steps: int, warmup: int, rank: int, world: int, timer: CheckTimer) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = GPTConfig(n_layer=4, n_embd=128)
    model = GPT(config)
    compiled = torch.compile(model, backend="zero", options={"stage": stage})
    optimizer = zcompile.optim.AdamW(model.parameters(), lr=3e-3, skip_nonfinite=True)
    step_times = []
    for step in range(warmup + steps):
        tokens, targets = synthetic_batch(step, 16, config)
        local = slice(rank * 16 // world, (rank + 1) * 16 // world)
        if step == warmup:
            timer.seconds = 0.0
        start = time.perf_counter()
        compiled(tokens[local], targets[local]).backward()
        optimizer.step()
        optimizer.zero_grad()
        step_times.append(time.perf_counter() - start)
    measured = torch.tensor([statistics.median(step_times[warmup:]), timer.seconds / steps], dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    step_s, check_s = measured.tolist()
    return {"stage": stage, "step_ms": step_s * 1e3, "checks_ms": check_s * 1e3, "checks_percent": 100 * check_s / step_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rank, world, cores = start_gloo_benchmark()
    timer = CheckTimer()
    timer.install()
    rows = [run_stage(stage, args.steps, args.warmup, rank, world, timer) for stage in (1, 2, 3)]
    if rank == 0:
        print_table(f"runtime checks per step, example GPT, {world} gloo ranks, {cores} cores",
                    ("stage", "median step ms", "checks ms/step", "checks % of step"),
                    [(str(r["stage"]), f"{r['step_ms']:.1f}", f"{r['checks_ms']:.3f}", f"{r['checks_percent']:.2f}")
                     for r in rows])
        if args.out:
            with open(args.out, "w") as handle:
                json.dump({"world": world, "cores": cores, "torch": torch.__version__, "rows": rows}, handle, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
