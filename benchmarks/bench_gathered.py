"""``zcompile.gathered(model)`` at stage 3, and at stage 2 with ``param_dtype``: what entering and leaving it costs.

    torchrun --nproc-per-node 2 benchmarks/bench_gathered.py    # results/gathered_2.json

The example GPT (n_embd 128), compiled at stage 3 (or at stage 2 with bf16 replicas, whose fp32
weights are master shards) and trained one step, then ``with
zcompile.gathered(model): pass`` (every weight gathered, written back and freed), and the same with
``writeback=False`` and with ``rank0_only=True``, and ``zcompile.checkpoint.full_state_dict(model)``
(every weight to rank 0's CPU memory: an export, ``ZeroTrainer.save_model``): median ms of the
slowest rank over ``--rounds``, the four alternating, against the model's fp32 bytes. An
evaluation, ``generate()`` or an export in eager code pays this each time.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import depth_sweep_arguments, print_table, slowest_ms, start_gloo_benchmark  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

import zcompile  # noqa: E402
import zcompile.optim  # noqa: E402
from zcompile.checkpoint.dcp import full_state_dict  # noqa: E402


def _enter_and_leave(model: torch.nn.Module, **arguments) -> None:
    with zcompile.gathered(model, **arguments):
        pass


WAYS = {
    "gathered": _enter_and_leave,
    "writeback=False": lambda model: _enter_and_leave(model, writeback=False),
    "rank0_only": lambda model: _enter_and_leave(model, rank0_only=True),
    "full_state_dict": full_state_dict,
}


CONFIGS = {"stage 3": {"stage": 3}, "stage 2, param_dtype bf16": {"stage": 2, "param_dtype": "bf16"}}


def measure(layers: int, rounds: int, config: str) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=layers, n_embd=128, n_head=4, block_size=128, vocab_size=512))
    compiled = torch.compile(model, backend="zero", options=CONFIGS[config])
    optimizer = zcompile.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 512, (2, 128))
    compiled(tokens, tokens).float().backward()
    optimizer.step()
    optimizer.zero_grad()

    times = {name: [] for name in WAYS}
    for _ in range(rounds):
        for name, way in WAYS.items():
            times[name].append(slowest_ms(lambda: way(model)))
    row = {
        "config": config,
        "layers": layers,
        "parameters": sum(1 for _ in model.parameters()),
        "model_MiB": sum(p.numel() * 4 for p in model.parameters()) / 2**20,
    }
    row.update({f"{name}_ms": statistics.median(values) for name, values in times.items()})
    return row


def main() -> None:
    args = depth_sweep_arguments(__doc__, "gathered_2.json")
    rank, world, cores = start_gloo_benchmark()
    rows = [measure(layers, args.rounds, config) for config in CONFIGS for layers in args.layers]
    if rank == 0:
        print_table(
            f"zcompile.gathered(model), {world} ranks ({cores} cores): median ms, enter and leave",
            ["config", "layers", "parameters", "model MiB", *WAYS],
            [
                [
                    r["config"],
                    str(r["layers"]),
                    str(r["parameters"]),
                    f"{r['model_MiB']:.2f}",
                    *(f"{r[f'{name}_ms']:.2f}" for name in WAYS),
                ]
                for r in rows
            ],
        )
        with open(args.out, "w") as handle:
            json.dump({"world_size": world, "cores": cores, "rounds": args.rounds, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
