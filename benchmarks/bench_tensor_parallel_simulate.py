"""Llama-3 70B as tp 8 x ZeRO-3 at 256 and 1,024 H100s, simulated (``zcompile.simulate(...,
tensor_parallel=8)``, one CPU process), beside torchtitan's published 2-D (FSDP + TP) run.

    python benchmarks/bench_tensor_parallel_simulate.py   # writes results/tensor_parallel_simulate.json

torchtitan's figure (``benchmarks/llama3_h100_202412_torchtitan.md`` in torchtitan, Table 4): Llama
3.1 70B on 256 H100s as FSDP 32 x TP 8, local batch 16 of 8,192 tokens, full activation checkpointing,
torch.compile and Float8: 829 tokens/s per GPU (876 with async TP), 71.9 GiB (67.6). Each row here
compiles the model on fake tensors through the real zero backend (stage 3, bf16, 64 MiB buckets),
the model split by its declared plan (``zcompile.apply_tp_plan``: q/k/v, gate/up column-wise; o,
down row-wise; no sequence parallelism), and predicts with the ``h100-sxm`` profile.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import print_table  # noqa: E402

from zcompile.predict.simulate import simulate  # noqa: E402

LLAMA3_70B = dict(
    hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8
)
SEQ = 8192
TP = 8
# (GPUs, local batch per dp rank, activation_memory_budget, shard_size): torchtitan's batch with
# everything recomputed (its full activation checkpointing), one sequence with the default partition,
# and that with hybrid sharding on top (shard groups of 8 dp ranks: 64 GPUs, 8 nodes)
RUNS = [
    (256, 16, 0.0, None),
    (256, 1, None, None),
    (1024, 16, 0.0, None),
    (1024, 1, None, None),
    (1024, 1, None, 8),
]
ONLY = os.environ.get("ONLY")  # a comma-separated subset of RUNS' indices, appended to the results file
# each row from shallow copies extrapolated to the 80 layers (zcompile.predict.depth); WHOLE=1: the whole model
EXTRAPOLATE = os.environ.get("WHOLE") != "1"


def run(world: int, batch: int, budget: float | None, shard_size: int | None) -> dict:
    import transformers

    config = transformers.LlamaConfig(vocab_size=128256, max_position_embeddings=SEQ, use_cache=False, **LLAMA3_70B)
    ids = torch.zeros(batch, SEQ, dtype=torch.long)
    options = {"stage": 3, "param_dtype": "bf16", "bucket_mb": 64}
    if budget is not None:
        options["activation_memory_budget"] = budget
    if shard_size is not None:
        options["shard_size"] = shard_size
    start = time.perf_counter()
    result = simulate(
        lambda: transformers.LlamaForCausalLM(config),
        {"input_ids": ids, "labels": ids},
        world_size=world,
        options=options,
        hardware="h100-sxm",
        tensor_parallel=TP,
        extrapolate=EXTRAPOLATE,
    )
    return {
        "world": world,
        "tp": TP,
        "local_batch": batch,
        "seq": SEQ,
        "options": options,
        **result.to_dict(),
        "tokens_per_s_per_gpu": result.tokens_per_s_per_rank,
        "wall_s": time.perf_counter() - start,
        "host_max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def main() -> None:
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "tensor_parallel_simulate.json")
    results, rows = [], []
    runs = RUNS
    if ONLY:
        with open(out) as f:
            results = json.load(f)
        runs = [RUNS[int(i)] for i in ONLY.split(",")]
    for world, batch, budget, shard_size in runs:
        r = run(world, batch, budget, shard_size)
        results.append(r)
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
        gib = {k: v / 2**30 for k, v in r["memory"].items()}
        rows.append(
            (
                f"dp {world // TP} x tp {TP}" + (f", shard {shard_size}" if shard_size else ""),
                str(batch),
                "all" if budget == 0.0 else "default",
                f"{r['step_peak_bytes'] / 2**30:.1f}",
                f"{gib['model_states_bytes']:.1f}",
                f"{gib['peak_gathered_bytes']:.1f}",
                f"{gib['saved_activation_bytes']:.1f}",
                f"{r['step_s']:.2f}",
                f"{r['exposed_comm_s']:.2f}",
                f"{100 * r['mfu']:.0f}%",
                f"{r['tokens_per_s_per_gpu']:,.0f}",
                f"{r['wall_s']:.0f}",
            )
        )
        print(rows[-1], flush=True)
    print_table(
        "Llama-3 70B simulated on one CPU process: stage 3, bf16, h100-sxm, seq 8192",
        [
            "layout",
            "batch",
            "recompute",
            "peak GiB",
            "states",
            "gathered",
            "activations",
            "step s",
            "exposed s",
            "MFU",
            "tokens/s/GPU",
            "sim s",
        ],
        rows,
    )
    print("wrote", out)


if __name__ == "__main__":
    main()
