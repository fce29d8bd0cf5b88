"""Per-step cost of the runtime rank checks, on the example GPT (the main job's model).

    torchrun --nproc-per-node 2 benchmarks/bench_step_checks.py [--steps 30] [--out benchmarks/results/step_checks_2.json]

For each stage, the example GPT (``examples/gpt.py`` defaults: 4 layers, n_embd 128, the
``train_gpt.py`` global batch of 16) trains ``--steps`` AdamW steps with the defaults: the ranks
agree through the store before every ``optimizer.step()`` (``zcompile.step_agreement``) and, at
stage 3, before every compiled call; ``skip_nonfinite=True`` adds its all-reduced flag. The time
overhead is measured three ways in one run: (1) the same model without any check
(``check_ranks=False``, ``check_timeout_s=None``, ``skip_nonfinite=False``) trained in steps
alternating with the checked one, medians over steps of the slowest rank, compared; (2) the time
spent inside the check functions (timed where the optimizer and the backend call them), which
also counts waiting there for the slower rank, time the next collective would otherwise wait;
(3) one store agreement with the ranks in step (a barrier first), the pure cost of a check. Whole
steps move by up to 30% between runs on this shared 2-core machine; (1) is a ratio within one run.
Goal (issue 14): below 1% of a step.
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


def _train_step(compiled, optimizer, step: int, config, rank: int, world: int) -> float:
    tokens, targets = synthetic_batch(step, 16, config)
    local = slice(rank * 16 // world, (rank + 1) * 16 // world)
    start = time.perf_counter()
    compiled(tokens[local], targets[local]).backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - start


def run_stage(stage: int, steps: int, warmup: int, rank: int, world: int, timer: CheckTimer) -> dict:
    """Two copies of the model, with and without the checks, trained in alternating steps (so drift
    of the machine's speed hits both alike)."""
    torch._dynamo.reset()
    config = GPTConfig(n_layer=4, n_embd=128)
    runs = {}
    for checked in (True, False):
        torch.manual_seed(0)
        model = GPT(config)
        options = {"stage": stage} if checked else {"stage": stage, "check_ranks": False}
        compiled = torch.compile(model, backend="zero", options=options)
        optimizer = zcompile.optim.AdamW(model.parameters(), lr=3e-3, skip_nonfinite=checked,
                                         check_timeout_s=60.0 if checked else None)
        runs[checked] = (compiled, optimizer, [])
    inside = 0.0
    for step in range(warmup + steps):
        for checked, (compiled, optimizer, times) in runs.items():
            before = timer.seconds
            elapsed = _train_step(compiled, optimizer, step, config, rank, world)
            if step >= warmup:
                times.append(elapsed)
                inside += (timer.seconds - before) if checked else 0.0
    medians = [statistics.median(runs[checked][2]) for checked in (True, False)]
    measured = torch.tensor([*medians, inside / steps], dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    with_checks, without, inside_s = measured.tolist()
    return {"stage": stage, "step_ms": with_checks * 1e3, "step_ms_without_checks": without * 1e3,
            "overhead_percent": 100 * (with_checks / without - 1), "inside_checks_ms": inside_s * 1e3}


def exchange_cost_ms(calls: int = 200) -> float:
    """One store agreement when the ranks are in step (no waiting for a slower rank), median ms."""
    from zcompile.process_group import DataParallelGroup
    from zcompile.rank_check import exchange_on_store

    group = DataParallelGroup.resolve(None)
    times = []
    for _ in range(calls):
        dist.barrier()
        start = time.perf_counter()
        exchange_on_store("bench", group, 60.0, "bench", "bench", "")
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


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
    exchange_ms = exchange_cost_ms()
    if rank == 0:
        print_table(f"runtime checks per step, example GPT, {world} gloo ranks, {cores} cores",
                    ("stage", "step ms, checks", "step ms, none", "overhead %", "inside checks ms/step"),
                    [(str(r["stage"]), f"{r['step_ms']:.1f}", f"{r['step_ms_without_checks']:.1f}",
                      f"{r['overhead_percent']:+.1f}", f"{r['inside_checks_ms']:.2f}") for r in rows])
        print(f"one store agreement with the ranks in step: {exchange_ms:.3f} ms (median of 200)")
        if args.out:
            with open(args.out, "w") as handle:
                json.dump({"world": world, "cores": cores, "torch": torch.__version__, "rows": rows,
                           "exchange_ms": exchange_ms}, handle, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
