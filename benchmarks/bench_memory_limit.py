"""``memory_limit_mb`` measured on this machine: the plan's step against the fastest configuration
that fits, found by measuring every candidate.

    torchrun --nproc-per-node 2 benchmarks/bench_memory_limit.py     # writes results/memory_limit_2.json
    torchrun --nproc-per-node 2 benchmarks/bench_memory_limit.py --model llama   # memory_limit_llama_2.json

The example GPT (2 layers, 128 wide, 8 sequences of 64 tokens a step) on gloo ranks. Every candidate
of the plan's space (stage x activation budget, with ``bucket_mb`` 64, ``prefetch`` 1 and nothing
kept fixed: the space ``tests/test_memory_limit.py`` plans in) is compiled once and timed in turn,
``ROUNDS`` rounds of ``STEPS`` steps each, interleaved so that the machine's load falls on all alike;
its peak per rank is measured once (the allocator's, through torch.profiler). ``--model llama``: a
transformers Llama (2 layers, 128 wide, grouped-query attention) instead, under a ladder of limits
made from the candidates' measured peaks (each rung just admits one more). Then for each limit
the backend plans (``memory_limit_mb``) and the plan's choice is compared with the fastest
candidate whose measured peak is within the limit: the ratio of their median steps; and with the
fastest whose measured peak is within the limit less the planner's headroom (``PREDICTION_HEADROOM``,
which the plan keeps free for what no prediction sees: the allocator's rounding, fragmentation).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

import zcompile  # noqa: E402
from zcompile.timeline import record_step  # noqa: E402
from zcompile.tune.plan import PREDICTION_HEADROOM  # noqa: E402

CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128)
GLOBAL_BATCH = 8
FIXED = {"bucket_mb": 64, "prefetch": 1, "keep_gathered_mb": 0}
CANDIDATES = [
    {"stage": stage, "activation_memory_budget": budget} for stage in (1, 2, 3) for budget in (None, 0.5, 0.0)
]
LIMITS_MB = (200.0, 10.0, 9.5, 7.5)
ROUNDS, STEPS = 15, 10


MODEL = sys.argv[sys.argv.index("--model") + 1] if "--model" in sys.argv else "gpt"


def build_model() -> torch.nn.Module:
    if MODEL == "gpt":
        return GPT(CONFIG)
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=CONFIG.vocab_size,
        hidden_size=CONFIG.n_embd,
        intermediate_size=2 * CONFIG.n_embd,
        num_hidden_layers=CONFIG.n_layer,
        num_attention_heads=CONFIG.n_head,
        num_key_value_heads=CONFIG.n_head // 2,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)


def ladder(peaks: list[int]) -> tuple[float, ...]:
    """The GPT's limits; for another model, rungs just above each measured peak plus the planner's headroom."""
    if MODEL == "gpt":
        return LIMITS_MB
    rungs = {round(peak / (1 - PREDICTION_HEADROOM) / 2**20 + 0.01, 2) for peak in peaks}
    return (200.0, *sorted(rungs, reverse=True))


class Run:
    def __init__(self, options: dict, rank: int, world: int):
        torch.manual_seed(0)
        self.model = build_model()
        self.optimizer = zcompile.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.compiled = torch.compile(self.model, backend="zero", options=options)
        self.rank, self.n, self.step_index = rank, GLOBAL_BATCH // world, 0

    def step(self) -> None:
        tokens, targets = synthetic_batch(self.step_index, GLOBAL_BATCH, CONFIG)
        part = slice(self.rank * self.n, (self.rank + 1) * self.n)
        self.loss(tokens[part], targets[part]).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.step_index += 1

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if MODEL == "gpt":
            return self.compiled(tokens, targets)
        return self.compiled(input_ids=tokens, labels=targets).loss

    def peak(self) -> int:
        """Bytes alive before each phase plus the phase's peak above them, the most of the two."""
        tokens, targets = synthetic_batch(0, GLOBAL_BATCH, CONFIG)
        part = slice(self.rank * self.n, (self.rank + 1) * self.n)
        with tempfile.TemporaryDirectory() as trace_dir:
            before = zcompile.model_state_bytes(self.model, self.optimizer).total
            backward = record_step(lambda: self.loss(tokens[part], targets[part]).backward(), trace_dir, self.rank)
            middle = zcompile.model_state_bytes(self.model, self.optimizer).total
            stepped = record_step(lambda: (self.optimizer.step(), self.optimizer.zero_grad()), trace_dir, self.rank)
        return max(before + backward.peak_bytes, middle + stepped.peak_bytes)


def slowest_rank(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def main() -> None:
    # one compiled model per candidate and plan, all of GPT.forward: past Dynamo's default of 8 the
    # later ones would run eagerly
    torch._dynamo.config.recompile_limit = 64
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = [Run({**FIXED, **c}, rank, world) for c in CANDIDATES]
    for run in runs:
        for _ in range(2):  # compile and warm up
            run.step()
    peaks = [dist_max(run.peak()) for run in runs]
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(ROUNDS):
        for index, run in enumerate(runs):
            dist.barrier()
            started = time.perf_counter()
            for _ in range(STEPS):
                run.step()
            times[index].append(slowest_rank(time.perf_counter() - started) / STEPS)
    medians = [statistics.median(t) for t in times]
    spreads = [(max(t) - min(t)) / statistics.median(t) for t in times]
    plans = []
    for limit in ladder(peaks):
        planned = Run({**FIXED, "memory_limit_mb": limit}, rank, world)
        planned.step()
        chosen = {k: planned.model._zcompile_memory_plan.options[k] for k in ("stage", "activation_memory_budget")}
        fitting = [i for i, peak in enumerate(peaks) if peak <= limit * 2**20]
        fastest = min(fitting, key=medians.__getitem__) if fitting else None
        with_headroom = [i for i in fitting if peaks[i] <= limit * 2**20 * (1 - PREDICTION_HEADROOM)]
        fastest_with_headroom = min(with_headroom, key=medians.__getitem__) if with_headroom else None
        index = CANDIDATES.index(chosen)
        plans.append(
            {
                "limit_mb": limit,
                "plan": chosen,
                "plan_predicted_peak_bytes": planned.model._zcompile_memory_plan.chosen.peak_bytes,
                "plan_measured_peak_bytes": peaks[index],
                "plan_step_s": medians[index],
                "fastest_fitting": None if fastest is None else CANDIDATES[fastest],
                "fastest_fitting_step_s": None if fastest is None else medians[fastest],
                "ratio": None if fastest is None else medians[index] / medians[fastest],
                "fastest_within_headroom": None if fastest_with_headroom is None else CANDIDATES[fastest_with_headroom],
                "ratio_within_headroom": None
                if fastest_with_headroom is None
                else medians[index] / medians[fastest_with_headroom],
            }
        )
    if rank == 0:
        result = {
            "model": MODEL,
            "world": world,
            "rounds": ROUNDS,
            "steps": STEPS,
            "candidates": [
                {"options": c, "measured_peak_bytes": p, "median_step_s": m, "spread": s, "steps_s": t}
                for c, p, m, s, t in zip(CANDIDATES, peaks, medians, spreads, times)
            ],
            "plans": plans,
        }
        name = f"memory_limit_{world}.json" if MODEL == "gpt" else f"memory_limit_{MODEL}_{world}.json"
        out = os.path.join(HERE, "results", name)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        for row in result["candidates"]:
            print(
                f"{row['options']}: peak {row['measured_peak_bytes'] / 2**20:.2f} MiB, step "
                f"{row['median_step_s'] * 1e3:.1f} ms (spread {100 * row['spread']:.0f}%)"
            )
        for row in plans:
            print(json.dumps(row))
    dist.destroy_process_group()


def dist_max(value: int) -> int:
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


if __name__ == "__main__":
    main()
