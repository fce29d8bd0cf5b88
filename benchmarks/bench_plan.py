"""``zcompile.plan`` at scale and across limits, predicted (no GPU needed).

    python benchmarks/bench_plan.py table      # Llama-3 8B / 70B at 64, 512, 1,024 H100s: results/plan.json
    python benchmarks/bench_plan.py ladder     # step against memory limit: results/plan_ladder.json + .png
    python benchmarks/bench_plan.py ladder gpt # the example GPT only (minutes; the 8B shape takes half an hour)

``table``: each shape and world planned for the ``h100-sxm`` profile with ``memory_limit_mb="auto"``
(80 GB less 10%), ``param_dtype`` bf16 fixed, sequence 8,192, one sequence per data-parallel rank
(a tp group shares it), the tp degree planned among 1, 2, 4, 8: the chosen options and degree, the
predicted peak by parts, tokens/s/GPU, how many candidates were simulated (from shallow copies,
the chosen one whole) and the planner's wall time.

``ladder``: the example GPT (on ``cpu-local``, 2 ranks) and the Llama-3 8B shape (64 H100s) planned
under a ladder of limits with one shared cache of simulations; the plot draws every simulated
candidate (memory, step), the plan's step at each limit, and the limits.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

from bench_simulate import SEQ, SHAPES  # noqa: E402

import zcompile  # noqa: E402
from zcompile.tune.plan import PREDICTION_HEADROOM  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
GIB = 2**30
FIXED = {"param_dtype": "bf16"}


def llama(shape: str, batch: int = 1):
    import transformers

    config = transformers.LlamaConfig(vocab_size=128256, max_position_embeddings=SEQ, use_cache=False, **SHAPES[shape])
    ids = torch.zeros(batch, SEQ, dtype=torch.long)
    return (lambda: transformers.LlamaForCausalLM(config)), {"input_ids": ids, "labels": ids}


def gpt():
    from gpt import GPT, GPTConfig, synthetic_batch

    config = GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=128)

    def make():
        torch.manual_seed(0)
        return GPT(config)

    return make, synthetic_batch(0, 8, config)


def plan_row(shape: str, world: int, max_simulations: int) -> dict:
    make, batch = llama(shape)
    started = time.perf_counter()
    try:
        plan = zcompile.plan(
            make, batch, world_size=world, hardware="h100-sxm", options=FIXED, max_simulations=max_simulations
        )
    except zcompile.PlanError as error:
        return {"shape": shape, "world": world, "error": str(error), "wall_s": time.perf_counter() - started}
    chosen = plan.chosen
    return {
        "shape": shape,
        "world": world,
        "options": plan.to_dict()["options"],
        "tensor_parallel": plan.tensor_parallel,
        "peak_bytes": chosen.peak_bytes,
        "memory_parts": chosen.memory_parts,
        "step_s": chosen.step_s,
        "tokens_per_s_per_gpu": SEQ / plan.tensor_parallel / chosen.step_s,  # a tp group shares its tokens
        "simulated": sum(c.step_s is not None for c in plan.candidates),
        "candidates": len(plan.candidates),
        "summary": plan.summary(),
        "plan": plan.to_dict(),
        "wall_s": time.perf_counter() - started,
    }


def table(max_simulations: int) -> None:
    rows = []
    for shape in SHAPES:
        for world in (64, 512, 1024):
            rows.append(plan_row(shape, world, max_simulations))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "plan"}), flush=True)
            with open(os.path.join(RESULTS, "plan.json"), "w") as f:
                json.dump(rows, f, indent=1)


def ladder(only: str | None = None) -> None:
    out = {}
    # the 8B shape's schedule knobs fixed (bucket 64 MiB, prefetch 2, nothing kept): its layouts
    # (activation budget x tp degree x stage x shard group), each from shallow copies
    lean = {**FIXED, "bucket_mb": 64, "prefetch": 2, "keep_gathered_mb": 0}
    for name, (make, batch), settings, fixed in (
        ("gpt (cpu-local, 2 ranks)", gpt(), {"world_size": 2, "hardware": "cpu-local"}, FIXED),
        ("llama3-8b (h100-sxm, 64 GPUs)", llama("llama3-8b"), {"world_size": 64, "hardware": "h100-sxm"}, lean),
    ):
        if only is not None and not name.startswith(only):
            continue
        cache: dict = {}
        # every candidate simulated once (a generous limit, every simulation allowed), then the ladder
        # of limits planned from the cache
        full = zcompile.plan(
            make, batch, memory_limit_mb=1e9, options=fixed, max_simulations=10**6, simulated=cache, **settings
        )
        peaks = sorted(c.peak_bytes for c in full.candidates if c.peak_bytes is not None)
        # each rung just fits a candidate's peak with the plan's headroom
        limits = sorted({int(peaks[round(i * (len(peaks) - 1) / 7)] * (1 + PREDICTION_HEADROOM)) + 1 for i in range(8)})
        steps = []
        for limit in limits:
            plan = zcompile.plan(
                make,
                batch,
                memory_limit_mb=limit / 2**20,
                options=fixed,
                max_simulations=10**6,
                simulated=cache,
                **settings,
            )
            steps.append(
                {
                    "limit_bytes": limit,
                    "step_s": plan.chosen.pace_s,  # per rank's batch: a tp group's step counted tp times
                    "tensor_parallel": plan.tensor_parallel,
                    "options": plan.to_dict()["options"],
                    "extrapolated": plan.chosen.extrapolated,
                }
            )
        points = [(c.peak_bytes, c.pace_s) for c in full.candidates if c.peak_bytes is not None]
        out[name] = {"fixed": fixed, "points": points, "plans": steps, "wall_s": full.wall_s}
        print(name, json.dumps(steps), flush=True)
    path = os.path.join(RESULTS, "plan_ladder.json")
    if only is not None and os.path.exists(path):  # one model again: the other's results kept
        with open(path) as f:
            out = {**json.load(f), **out}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    draw(out, os.path.join(RESULTS, "plan_ladder.png"))


def draw(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(out), figsize=(6 * len(out), 4.2), dpi=90, squeeze=False)
    for axis, (name, data) in zip(axes[0], out.items()):
        unit, scale = ("MiB", 2**20) if "gpt" in name else ("GiB", GIB)
        axis.scatter(
            [m / scale for m, _ in data["points"]],
            [s * 1e3 for _, s in data["points"]],
            s=14,
            color="lightgrey",
            label="candidates simulated",
        )
        # the fastest simulated candidate that fits each limit (its peak and the plan's headroom)
        limits = sorted({m * (1 + PREDICTION_HEADROOM) for m, _ in data["points"]})
        fastest = [min(s for m, s in data["points"] if m * (1 + PREDICTION_HEADROOM) <= limit) for limit in limits]
        axis.step(
            [limit / scale for limit in limits],
            [s * 1e3 for s in fastest],
            where="post",
            color="tab:blue",
            label="fastest simulated that fits",
        )
        axis.scatter(
            [p["limit_bytes"] / scale for p in data["plans"]],
            [p["step_s"] * 1e3 for p in data["plans"]],
            s=30,
            color="tab:green",
            zorder=3,
            label="zcompile.plan's choice",
        )
        axis.set_xlabel(f"memory limit / peak per rank ({unit})")
        axis.set_ylabel("predicted step per rank's batch (ms)")
        axis.set_title(name, fontsize=10)
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "table"
    if what == "draw":  # the plot again from results/plan_ladder.json
        with open(os.path.join(RESULTS, "plan_ladder.json")) as f:
            draw(json.load(f), os.path.join(RESULTS, "plan_ladder.png"))
    elif what == "table":
        table(int(sys.argv[2]) if len(sys.argv) > 2 else 4)
    else:
        ladder(sys.argv[2] if len(sys.argv) > 2 else None)  # "gpt" or "llama3-8b": that model only
