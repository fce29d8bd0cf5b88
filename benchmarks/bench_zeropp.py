"""ZeRO++ over a few hundred steps: loss of qwZ + hpZ + qgZ against plain stage 3, same data.

    torchrun --nproc-per-node 4 benchmarks/bench_zeropp.py --node-size 2 --steps 300

Trains the example GPT twice from the same seed (plain stage 3; then quantize_weights, hpz_size
and quantize_grads), gathers in bf16, on simulated nodes of ``--node-size`` ranks. Rank 0 prints
the final losses (mean of the last 10 steps) and their relative difference (target: within 2%),
writes both curves to ``--out`` (JSON) and, with matplotlib installed, a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

import zcompile  # noqa: E402

CONFIGS = {
    "stage 3": {},
    "ZeRO++ (qwZ + hpZ + qgZ)": {"quantize_weights": True, "hpz_size": "node", "quantize_grads": True},
}


def train(options: dict, args, rank: int, world: int) -> tuple[list[float], float]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = GPTConfig(n_layer=args.layers, n_embd=args.embd, block_size=64)
    model = GPT(config)
    opts = {"stage": 3, "param_dtype": "bf16", "node_size": args.node_size, "quantize_block": args.block, **options}
    compiled = torch.compile(model, backend="zero", options=opts)
    optimizer = zcompile.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        tokens, targets = synthetic_batch(step, args.batch_size, config)
        local = slice(rank * args.batch_size // world, (rank + 1) * args.batch_size // world)
        loss = compiled(tokens[local], targets[local])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().float()
        dist.all_reduce(value)
        losses.append(value.item() / world)
    return losses, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--node-size", type=int, default=2)
    parser.add_argument("--block", type=int, default=128, help="quantize_block: elements per scale")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "zeropp_loss.json"))
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    curves, seconds = {}, {}
    for name, options in CONFIGS.items():
        curves[name], seconds[name] = train(options, args, rank, world)
    if rank == 0:
        (base_name, base), (plus_name, plus) = curves.items()
        tail = 10
        end_base, end_plus = sum(base[-tail:]) / tail, sum(plus[-tail:]) / tail
        print(
            f"{world} ranks as {world // args.node_size} nodes of {args.node_size}, GPT {args.layers} layers "
            f"n_embd {args.embd}, {args.steps} steps, AdamW lr {args.lr}, bf16 gathers, quantize_block {args.block}"
        )
        for name in curves:
            print(
                f"  {name:28s} first loss {curves[name][0]:.4f}  last-{tail} mean {sum(curves[name][-tail:]) / tail:.4f}"
                f"  ({seconds[name]:.0f} s)"
            )
        print(f"  relative difference at the end: {(end_plus - end_base) / end_base:+.2%} (target: within 2%)")
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "world": world, "losses": curves, "seconds": seconds}, f)
        try:
            from matplotlib.figure import Figure
        except ImportError:
            print("  (install matplotlib for the plot: pip install -e '.[inspect]')")
        else:
            fig = Figure(figsize=(8, 4.5), layout="constrained")
            ax = fig.subplots()
            for name, losses in curves.items():
                ax.plot(losses, label=name, linewidth=1)
            ax.set_xlabel("step")
            ax.set_ylabel("training loss")
            ax.set_title(f"ZeRO++ vs stage 3: {world} ranks as {world // args.node_size} nodes of {args.node_size}")
            ax.legend()
            png = os.path.splitext(args.out)[0] + ".png"
            fig.savefig(png, dpi=100)
            print(f"  curves: {args.out}, plot: {png}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
