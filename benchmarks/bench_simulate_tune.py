"""Tuning by simulation: the Llama-3-8B shape at 64 H100s over stage x bucket_mb x hpZ
(``zcompile.simulate_tune``, one CPU process; the README's worked example).

    python benchmarks/bench_simulate_tune.py     # results/simulate_tune_8b_64.json and simulate_pareto.png

The model and batch are ``bench_simulate``'s (seq 8192, local batch 1, bf16 mixed precision, the
``h100-sxm`` profile, nodes of 8). Stage 2 with hpZ is not a valid combination (hpZ acts on
stage 3's gathers) and is recorded as such, not simulated.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_simulate import SEQ, SHAPES  # noqa: E402

from zcompile.tune.simulated import simulate_tune  # noqa: E402

WORLD = 64
SPACE = {"stage": [2, 3], "bucket_mb": [16, 64], "hpz_size": [None, "node"]}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main() -> None:
    import transformers

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("zcompile").setLevel(logging.INFO)
    config = transformers.LlamaConfig(
        vocab_size=128256, max_position_embeddings=SEQ, use_cache=False, **SHAPES["llama3-8b"]
    )
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    result = simulate_tune(
        lambda: transformers.LlamaForCausalLM(config),
        {"input_ids": ids, "labels": ids},
        space=SPACE,
        world_size=WORLD,
        base_options={"param_dtype": "bf16"},
        hardware="h100-sxm",
    )
    result.print()
    result.to_json(os.path.join(RESULTS, "simulate_tune_8b_64.json"))
    result.plot(
        os.path.join(RESULTS, "simulate_pareto.png"),
        title=f"Llama-3-8B shape, {WORLD} H100s, seq {SEQ}: simulated step time against memory",
    )


if __name__ == "__main__":
    main()
