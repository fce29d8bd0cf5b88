"""Train the small GPT with ZeRO through ``torch.compile(backend="zero")``.

    torchrun --nproc-per-node 2 examples/train_gpt.py            # stage 3, CPU, gloo
    torchrun --nproc-per-node 2 examples/train_gpt.py --stage 2 --steps 50

Each rank trains on its slice of the same global batch. Per step, rank 0 prints the loss
(averaged over ranks), the model-state bytes this rank holds (measured from live tensors) next to
what plain data parallelism (DDP) holds, and the elements communicated per rank in units of Ψ.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zcompile  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402
from zcompile.comm_volume import step_collectives, summarize  # noqa: E402
from zcompile.dumps import report_path  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch, split across ranks")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--compiler", default="eager", choices=("eager", "inductor"))
    parser.add_argument("--dump", default=None, help="directory for graph dumps and report.json (see `python -m zcompile inspect`)")
    parser.add_argument("--param-dtype", default=None, help="e.g. bf16 (compute and gather dtype)")
    parser.add_argument("--keep-gathered-mb", type=float, default=0.0,
                        help="stage 3: MiB of gathered weights kept from forward to backward instead of re-gathered")
    return parser.parse_args()


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def main() -> None:
    args = parse_args()
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the {world} ranks")

    torch.manual_seed(0)
    config = GPTConfig(n_layer=args.layers, n_embd=args.embd)
    model = GPT(config).to(device)
    num_params = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    graphs = []
    options = {"stage": args.stage, "compiler": args.compiler, "param_dtype": args.param_dtype, "on_compile": graphs.append,
               "dump": args.dump, "keep_gathered_mb": args.keep_gathered_mb}
    compiled = torch.compile(model, backend="zero", options=options)
    optimizer = zcompile.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    ddp_bytes = zcompile.zero_formula_bytes(num_params, world, stage=None)
    if rank == 0:
        print(f"GPT {args.layers} layers, Ψ = {num_params:,} parameters, ZeRO stage {args.stage}, {world} rank(s), "
              f"{args.compiler} compiler, device {device.type}", flush=True)

    start = time.perf_counter()
    for step in range(args.steps):
        tokens, targets = synthetic_batch(step, args.batch_size, config)
        local = slice(rank * args.batch_size // world, (rank + 1) * args.batch_size // world)
        loss = compiled(tokens[local].to(device), targets[local].to(device))
        loss.backward()
        optimizer.step()
        states = zcompile.model_state_bytes(model, optimizer)
        optimizer.zero_grad()
        mean_loss = loss.detach().clone()
        if distributed:
            dist.all_reduce(mean_loss)
            mean_loss /= world
        comm = summarize(step_collectives(graphs, optimizer)).get("total", 0)
        if rank == 0:
            print(f"step {step:3d} | loss {mean_loss.item():.4f} | model states {mib(states.total)}/rank "
                  f"(DDP {mib(ddp_bytes)}, {ddp_bytes / states.total:.1f}x less) | "
                  f"comm {comm / 1e6:.2f}M elements/rank = {comm / num_params:.2f} Ψ", flush=True)
    if rank == 0:
        print(f"{args.steps} steps in {time.perf_counter() - start:.1f}s", flush=True)
    report = zcompile.step_report(model, optimizer)
    if args.dump:
        report.to_json(str(report_path(args.dump, rank)))
    if rank == 0:
        report.print()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
