"""Hugging Face Trainer's whole run, ZeroTrainer against the plain DDP Trainer, on gloo CPU ranks.

    torchrun --nproc-per-node 2 benchmarks/bench_trainer.py
    torchrun --nproc-per-node 2 benchmarks/bench_trainer.py --steps 20 --rounds 3

A tiny transformers Llama (2 layers, hidden 32) on ``examples/hf_trainer.py``'s data (arithmetic
progressions of 16 tokens), ``--steps`` optimizer steps of 8 sequences with an evaluation every
``--eval-every``: the time of ``trainer.train()`` (compiles included: on a model this small they are
nearly all of it) for the DDP Trainer (eager), the DDP Trainer compiled (``torch_compile=True``,
``torch_compile_backend="aot_eager"``: Dynamo's default, static shapes), ``ZeroTrainer`` (which
compiles with ``dynamic=True``) at stages 2 and 3, ``zero3+static`` with ``ZeroTrainer(dynamic=None)``
(Dynamo's default shapes, as the compiled DDP Trainer has them), and the same
``ZeroTrainer`` with its compiles under Dynamo's default float handling (``+float_inputs``: Python
floats symbolic under ``dynamic=True``, what ``ZeroTrainer`` did before it traced them as
constants). Rounds take the configurations in turn; each run reports the most attempts one of its
compiles took (Dynamo's ``compile_attempt_N`` records: 2 where it traced a frame a second time). Results:
``results/trainer_<world>.json``; only ratios within one run mean anything on a shared machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

from common import print_table, start_gloo_benchmark  # noqa: E402

CONFIGS = ("ddp", "ddp+compile", "zero2", "zero3", "zero3+static", "zero2+float_inputs", "zero3+float_inputs")
VOCAB, SEQ = 128, 16


def _llama():
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


def run(config: str, steps: int, eval_every: int, world: int, out_dir: str) -> dict:
    """One ``trainer.train()``: seconds on the slowest rank, compile attempts, the logged losses."""
    import torch
    import torch.distributed as dist
    import transformers
    from torch._dynamo.utils import compilation_time_metrics

    import zcompile.integrations.hf as hf

    torch._dynamo.reset()
    compilation_time_metrics.clear()
    args = transformers.TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=8 // world,
        per_device_eval_batch_size=4,
        max_steps=steps,
        learning_rate=3e-3,
        max_grad_norm=1.0,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        eval_strategy="steps",
        eval_steps=eval_every,
        seed=0,
        data_seed=0,
        **({"torch_compile": True, "torch_compile_backend": "aot_eager"} if config == "ddp+compile" else {}),
    )
    from hf_trainer import Progressions  # the example's data (examples/hf_trainer.py)

    common = dict(
        model=_llama(),
        args=args,
        train_dataset=Progressions(8 * steps, SEQ, VOCAB, seed=0),
        eval_dataset=Progressions(16, SEQ, VOCAB, seed=1),
    )
    stage = int(config[len("zero")]) if config.startswith("zero") else None
    trainer = (
        transformers.Trainer(**common)
        if stage is None
        else hf.ZeroTrainer(
            **common, zero_options={"stage": stage}, dynamic=None if config.endswith("+static") else True
        )
    )
    trainer.remove_callback(transformers.PrinterCallback)  # its log lines on stdout
    # "+float_inputs": the compiles without ZeroTrainer's float specialization (torch's default)
    unspecialized = contextlib.nullcontext if config.endswith("+float_inputs") else hf.floats_specialized
    original, hf.floats_specialized = hf.floats_specialized, unspecialized
    try:
        dist.barrier()
        start = time.perf_counter()
        trainer.train()
        elapsed = torch.tensor([time.perf_counter() - start])
    finally:
        hf.floats_specialized = original
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    attempts = sum(1 for name in compilation_time_metrics if name.startswith("compile_attempt_"))
    return {"seconds": elapsed.item(), "compile_attempts": attempts, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None)
    options = parser.parse_args()
    import logging

    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("zcompile").setLevel(logging.WARNING)
    rank, world, cores = start_gloo_benchmark()
    results: dict[str, list[dict]] = {config: [] for config in options.configs}
    with tempfile.TemporaryDirectory() as out_dir:
        for _ in range(options.rounds):
            for config in options.configs:
                results[config].append(
                    run(config, options.steps, options.eval_every, world, os.path.join(out_dir, config))
                )
    if rank != 0:
        return
    reference = statistics.median(r["seconds"] for r in results[options.configs[0]])
    rows, summary = [], {}
    for config, runs in results.items():
        median = statistics.median(r["seconds"] for r in runs)
        losses = runs[0]["losses"]
        summary[config] = {
            "seconds": [round(r["seconds"], 2) for r in runs],
            "median_s": round(median, 2),
            "compile_attempts": [r["compile_attempts"] for r in runs],
            "first_loss": losses[0],
            "last_loss": losses[-1],
        }
        rows.append(
            [
                config,
                " / ".join(f"{r['seconds']:.1f}" for r in runs),
                f"{median:.1f}",
                f"{median / reference:.1f}x",
                ",".join(str(r["compile_attempts"]) for r in runs),
                f"{losses[0]:.4f} .. {losses[-1]:.4f}",
            ]
        )
    print_table(
        f"Trainer.train(), {options.steps} steps, {world} ranks, {cores} cores (seconds, slowest rank)",
        ["config", "runs", "median", f"x {options.configs[0]}", "most compile attempts", "losses"],
        rows,
    )
    out = options.out or os.path.join(HERE, "results", f"trainer_{world}.json")
    with open(out, "w") as handle:
        json.dump(
            {
                "world": world,
                "cores": cores,
                "steps": options.steps,
                "eval_every": options.eval_every,
                "configs": summary,
            },
            handle,
            indent=1,
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
