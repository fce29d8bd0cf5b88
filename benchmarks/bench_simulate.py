"""Llama-3-shaped models simulated at 8, 64 and 512 H100s (``zcompile.simulate``, one CPU process).

    python benchmarks/bench_simulate.py            # writes results/simulate.json
    python benchmarks/bench_simulate.py --at-1024  # adds both shapes at 1,024 GPUs to it (time, host memory)

Each row compiles the model on fake tensors under torch's fake process group through the real zero
backend (stage 3, bf16 mixed precision, 64 MiB buckets) and predicts memory per GPU, step time,
exposed communication and MFU with the ``h100-sxm`` profile; the wall time and the host memory
of the simulation itself are recorded. One extra row sets up torchtitan's published Llama 3.1 8B
FSDP run (8 H100, local batch 2 of 8,192 tokens, selective activation checkpointing, here
``activation_memory_budget=0.5``) for comparison with its 5,762 (eager) / 6,667 (compiled) tokens/s
per GPU (``benchmarks/llama3_h100_202412_torchtitan.md`` in torchtitan).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import print_table  # noqa: E402

from zcompile.predict.simulate import simulate  # noqa: E402

SHAPES = {
    "llama3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8
    ),
    "llama3-70b": dict(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8
    ),
}
RUNS = (
    [("llama3-8b", world, 1, {}) for world in (8, 64, 512)]
    + [("llama3-70b", world, 1, {}) for world in (8, 64, 512)]
    + [("llama3-8b", 8, 2, {"activation_memory_budget": 0.5})]
)  # torchtitan's setting
RUNS_AT_1024 = [(shape, 1024, 1, {}) for shape in SHAPES]  # the scale: how long, how much host memory
SEQ = 8192


def run(shape: str, world: int, batch: int, extra: dict) -> dict:
    import transformers

    config = transformers.LlamaConfig(vocab_size=128256, max_position_embeddings=SEQ, use_cache=False, **SHAPES[shape])
    ids = torch.zeros(batch, SEQ, dtype=torch.long)
    options = {"stage": 3, "param_dtype": "bf16", "bucket_mb": 64, **extra}
    start = time.perf_counter()
    result = simulate(
        lambda: transformers.LlamaForCausalLM(config),
        {"input_ids": ids, "labels": ids},
        world_size=world,
        options=options,
        hardware="h100-sxm",
    )
    return {
        "shape": shape,
        "world": world,
        "local_batch": batch,
        "seq": SEQ,
        "options": options,
        **result.to_dict(),
        "tokens_per_s_per_gpu": result.tokens_per_rank / result.step_s,
        "wall_s": time.perf_counter() - start,
        "host_max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def main() -> None:
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "simulate.json")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--at-1024", action="store_true", help="add both shapes at 1,024 GPUs to the results")
    at_1024 = parser.parse_args().at_1024
    results, rows = [], []
    if at_1024:  # the rows before are kept; rows at 1,024 GPUs replaced
        with open(out) as f:
            results = [r for r in json.load(f) if r["world_size"] != 1024]
    for shape, world, batch, extra in RUNS_AT_1024 if at_1024 else RUNS:
        r = run(shape, world, batch, extra)
        results.append(r)
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
        gib = {k: v / 2**30 for k, v in r["memory"].items()}
        rows.append(
            (
                f"{shape} b{batch}" + (" budget 0.5" if extra else ""),
                str(world),
                f"{r['per_rank_bytes'] / 2**30:.1f}",
                f"{gib['model_states_bytes']:.1f}",
                f"{gib['peak_gathered_bytes']:.1f}",
                f"{gib['saved_activation_bytes']:.1f}",
                f"{r['step_s']:.2f}",
                f"{r['exposed_comm_s']:.2f}",
                f"{100 * r['mfu']:.0f}%",
                f"{r['tokens_per_s_per_gpu']:,.0f}",
                f"{r['wall_s']:.0f}",
                f"{r['host_max_rss_gib']:.1f}",
            )
        )
        print(rows[-1], flush=True)
    print_table(
        "simulated on one CPU process: stage 3, bf16, h100-sxm, seq 8192",
        [
            "model",
            "GPUs",
            "GiB/GPU",
            "states",
            "gathered",
            "activations",
            "step s",
            "exposed s",
            "MFU",
            "tokens/s/GPU",
            "sim s",
            "host GiB",
        ],
        rows,
    )
    print("wrote", out)


if __name__ == "__main__":
    main()
