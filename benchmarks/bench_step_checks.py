"""Per-step cost of the runtime rank checks, on the example GPT (the main job's model).

    torchrun --nproc-per-node 2 benchmarks/bench_step_checks.py [--steps 30] [--out benchmarks/results/step_checks_2.json]

For each stage, the example GPT (``examples/gpt.py`` defaults: 4 layers, n_embd 128, the
``train_gpt.py`` global batch of 16) trains ``--steps`` AdamW steps with the defaults: the ranks
agree through the store before every ``optimizer.step()`` (``zcompile.agreement.step_agreement``) and, at
stage 3, before every compiled call; ``skip_nonfinite=True`` adds each rank's finiteness check of
its gradients (the flags ride on the step's exchange). One compiled model trains with the checks
off (``check_timeout_s=None``, ``skip_nonfinite=False``, no per-call agreement), on (defaults) and
on with ``skip_nonfinite``, in steps that cycle through the three, each timed from a barrier on
the slowest rank. Reported per mode: (1) the median step against the median step without checks
(a ratio within one run; an A/A run of this loop moves by 1-3%, the noise floor); (2) the critical
path: per step, the least time any rank spent inside the check functions (timed where the
optimizer and the backend call them). The rank that arrives last at an exchange waits for nobody,
so its time is what the checks add to the step; the other ranks' time there is waiting for it,
which the next collective would wait otherwise (also shown, as the slowest rank's time inside);
(3) one store exchange with the ranks in step (a barrier first). Goal (issue 14): below 1% of a
step.
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

from common import print_table, start_gloo_benchmark, timed_training_step  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

import zcompile  # noqa: E402
import zcompile.backend  # noqa: E402
import zcompile.optim  # noqa: E402


class CheckTimer:
    """Wraps the check functions where their callers look them up and adds up their time; with
    ``enabled`` False the stage-3 per-call agreement is skipped (the optimizer's checks are
    switched by its own ``check_timeout_s`` and ``skip_nonfinite``)."""

    def __init__(self):
        self.seconds = 0.0
        self.enabled = True

    def timed(self, function, switchable: bool = False):
        def wrapper(*args, **kwargs):
            if switchable and not self.enabled:
                return None
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return wrapper

    def install(self) -> None:
        zcompile.backend.agree_on_call = self.timed(zcompile.backend.agree_on_call, switchable=True)
        zcompile.optim.sharded.agree_before_step = self.timed(zcompile.optim.sharded.agree_before_step)
        zcompile.optim.sharded.nonfinite_flag = self.timed(zcompile.optim.sharded.nonfinite_flag)
        zcompile.optim.sharded.local_grads_finite = self.timed(zcompile.optim.sharded.local_grads_finite)


def _train_step(compiled, optimizer, step: int, config, rank: int, world: int) -> float:
    tokens, targets = synthetic_batch(step, 16, config)
    local = slice(rank * 16 // world, (rank + 1) * 16 // world)
    return timed_training_step(compiled, optimizer, tokens[local], targets[local])


MODES = ("off", "checks", "checks + skip_nonfinite")
BLOCK = 4  # consecutive steps per mode: what a check skips depends on the step before (stage 3)


def run_stage(stage: int, steps: int, warmup: int, rank: int, world: int, timer: CheckTimer) -> dict:
    """One compiled model whose steps cycle, in blocks of BLOCK, through the modes: no checks; the
    default checks (the store agreement before each step and, at stage 3, before a compiled call
    that is not the first since the last step); those plus ``skip_nonfinite``. Cycling lets drift
    of the machine's speed hit every mode alike; a block's first step is not counted. ``steps``
    counted per mode."""
    torch._dynamo.reset()
    config = GPTConfig(n_layer=4, n_embd=128)
    torch.manual_seed(0)
    model = GPT(config)
    compiled = torch.compile(model, backend="zero", options={"stage": stage})
    optimizer = zcompile.optim.AdamW(model.parameters(), lr=3e-3)
    times = {mode: [] for mode in MODES}
    inside = {mode: [] for mode in MODES}  # per step: (most, least) seconds a rank spent in the checks
    for step in range(warmup + steps * len(MODES) * BLOCK // (BLOCK - 1)):
        block = step // BLOCK
        mode = MODES[block % len(MODES)]
        timer.enabled = mode != "off"
        optimizer.check_timeout_s = None if mode == "off" else 60.0
        # the default (None: off for these fp32 parameters, decided per step), or on
        optimizer.skip_nonfinite = {"off": False, "checks": None}.get(mode, True)
        before = timer.seconds
        elapsed = _train_step(compiled, optimizer, step, config, rank, world)
        spent = torch.tensor([timer.seconds - before], dtype=torch.float64)
        most, least = spent.clone(), spent.clone()
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
        if step >= warmup and step % BLOCK:  # a block's first step still follows the last mode's
            times[mode].append(elapsed)
            inside[mode].append((most.item(), least.item()))
    medians = {mode: statistics.median(times[mode]) * 1e3 for mode in MODES}
    checked = MODES[1:]
    return {
        "stage": stage,
        "step_ms": medians,
        "overhead_percent": {mode: 100 * (medians[mode] / medians["off"] - 1) for mode in checked},
        "inside_checks_ms": {mode: statistics.median(most for most, _ in inside[mode]) * 1e3 for mode in checked},
        "critical_path_ms": {mode: statistics.median(least for _, least in inside[mode]) * 1e3 for mode in checked},
        "critical_path_percent": {
            mode: 100 * statistics.median(least for _, least in inside[mode]) * 1e3 / medians["off"] for mode in checked
        },
    }


def exchange_cost_ms(calls: int = 200) -> float:
    """One store agreement when the ranks are in step (no waiting for a slower rank), median ms."""
    from zcompile.agreement.store_exchange import exchange_on_store
    from zcompile.common.process_group import DataParallelGroup

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
    parser.add_argument("--steps", type=int, default=60, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rank, world, cores = start_gloo_benchmark()
    timer = CheckTimer()
    timer.install()
    rows = [run_stage(stage, args.steps, args.warmup, rank, world, timer) for stage in (1, 2, 3)]
    exchange_ms = exchange_cost_ms()
    if rank == 0:
        print_table(
            f"runtime checks per step, example GPT, {world} gloo ranks, {cores} cores",
            (
                "stage",
                "step ms, off",
                *(f"{m}: step ms (A/B %), critical path ms (% of step), slowest rank inside ms" for m in MODES[1:]),
            ),
            [
                (
                    str(r["stage"]),
                    f"{r['step_ms']['off']:.1f}",
                    *(
                        f"{r['step_ms'][m]:.1f} ({r['overhead_percent'][m]:+.1f}), {r['critical_path_ms'][m]:.2f} "
                        f"({r['critical_path_percent'][m]:.2f}), {r['inside_checks_ms'][m]:.2f}"
                        for m in MODES[1:]
                    ),
                )
                for r in rows
            ],
        )
        print(f"one store agreement with the ranks in step: {exchange_ms:.3f} ms (median of 200)")
        if args.out:
            with open(args.out, "w") as handle:
                json.dump(
                    {
                        "world": world,
                        "cores": cores,
                        "torch": torch.__version__,
                        "rows": rows,
                        "exchange_ms": exchange_ms,
                    },
                    handle,
                    indent=1,
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
