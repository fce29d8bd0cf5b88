"""Train the small GPT with ZeRO through ``torch.compile(backend="zero")``.

    torchrun --nproc-per-node 2 examples/train_gpt.py            # stage 3, CPU, gloo
    torchrun --nproc-per-node 2 examples/train_gpt.py --stage 2 --steps 50
    torchrun --nproc-per-node 2 examples/train_gpt.py --steps 20 --save ckpt --save-every 10 --clip 1.0
    torchrun --nproc-per-node 4 examples/train_gpt.py --steps 40 --resume ckpt   # 2 -> 4 ranks, step 20 on
    torchrun --nproc-per-node 4 examples/train_gpt.py --tp 2     # tensor parallelism 2 x ZeRO over 2

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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt import GPT, GPTConfig, parallelize, synthetic_batch  # noqa: E402

import zcompile  # noqa: E402
from zcompile.common.comm_volume import step_collectives, summarize  # noqa: E402
from zcompile.common.dumps import report_path  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch, split across ranks")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--compiler", default="auto", choices=("auto", "eager", "inductor"))
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=1.0,
        help="bucket size of the graphs' collectives: 1 MiB gives about one layer per bucket here, so "
        "gathers are prefetched under the previous layer's compute and the gathered peak stays a few "
        "layers",
    )
    parser.add_argument(
        "--dump", default=None, help="directory for graph dumps and report.json (see `python -m zcompile inspect`)"
    )
    parser.add_argument("--param-dtype", default=None, help="e.g. bf16 (compute and gather dtype)")
    parser.add_argument(
        "--keep-gathered-mb",
        type=float,
        default=0.0,
        help="stage 3: MiB of gathered weights kept from forward to backward instead of re-gathered",
    )
    parser.add_argument("--save", default=None, help="checkpoint directory (zcompile.checkpoint, DCP format)")
    parser.add_argument("--save-every", type=int, default=0, help="save every K steps (and at the end); 0: at the end")
    parser.add_argument(
        "--resume", default=None, help="checkpoint directory to resume from (any number of ranks, any stage)"
    )
    parser.add_argument("--clip", type=float, default=None, help="clip the global gradient 2-norm to this value")
    parser.add_argument(
        "--regional",
        action="store_true",
        help="trace the repeated block once (zcompile.mark_repeated_blocks): compile time for deep models",
    )
    parser.add_argument(
        "--compile-blocks",
        action="store_true",
        help="compile each block on its own, the rest eager: compile time flat in depth, steps slower "
        "(each layer's call prefetches the next layer's first gather; the embeddings and head replicated)",
    )
    parser.add_argument("--eval-every", type=int, default=0, help="evaluate on a held-out batch every K steps")
    parser.add_argument(
        "--shard-size",
        default=None,
        type=lambda value: value if value == "node" else int(value),
        help="hybrid sharding: shard inside groups of this many ranks (or 'node'), replicate across them",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor parallelism: split each block over this many ranks (a ('dp', 'tp') mesh), ZeRO over the rest",
    )
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp: the norms and the residual stream hold a slice of the sequence per tp rank",
    )
    args = parser.parse_args()
    if args.sequence_parallel and args.tp == 1:
        parser.error("--sequence-parallel splits the sequence over the tp ranks: give --tp 2 or more")
    if args.tp > 1 and (args.save or args.resume or args.shard_size):
        parser.error(
            "--tp with --save/--resume/--shard-size: zcompile.checkpoint and hybrid sharding do not take tensor-parallel "
            "models yet (docs/tensor-parallel.md saves them with torch.distributed.checkpoint)"
        )
    if args.regional and args.compile_blocks:
        parser.error("--regional and --compile-blocks are two ways to compile a block once: pick one")
    return args


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def peak_line(memory: dict, ddp_bytes: int) -> str:
    """This rank's peak by the report's parts, next to DDP's (its model states and the same activations)."""
    staging = memory.get("gather_staging_bytes", 0)  # gloo's copies of the gathers in flight (none on NCCL)
    buckets = memory.get("optimizer_buffers_bytes", 0)  # stages 1 and 2: the optimizer's bucketed collectives
    ours = (
        memory["model_states_bytes"]
        + memory["peak_gathered_bytes"]
        + staging
        + memory["saved_activation_bytes"]
        + buckets
    )
    ddp = ddp_bytes + memory["saved_activation_bytes"]
    return (
        f"per-rank peak: model states {mib(memory['model_states_bytes'])} + gathered parameters "
        f"{mib(memory['peak_gathered_bytes'])}"
        + (f" + gloo's copies of them {mib(staging)}" if staging else "")
        + f" + saved activations {mib(memory['saved_activation_bytes'])}"
        + (f" + the optimizer's bucket buffers {mib(buckets)}" if buckets else "")
        + " = "
        f"{mib(ours)}; DDP: {mib(ddp_bytes)} + the same activations = {mib(ddp)} ({ddp / ours:.2f}x ours)"
    )


def evaluate(compiled, batch, rank: int, world: int, data_rank: int, data_world: int, device, step: int) -> None:
    """Loss on the held-out batch (each data-parallel rank its slice), in eval mode without gradients."""
    tokens, targets = batch
    local = slice(data_rank * len(tokens) // data_world, (data_rank + 1) * len(tokens) // data_world)
    compiled.eval()
    with torch.no_grad():
        loss = compiled(tokens[local].to(device), targets[local].to(device)).detach().clone()
    compiled.train()
    if world > 1:
        dist.all_reduce(loss)
        loss /= world
    if rank == 0:
        print(f"eval after step {step + 1}: loss {loss.item():.4f}", flush=True)


def main() -> None:
    args = parse_args()
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} must divide the {world} ranks")
    data_world = world // args.tp  # the ranks that read different data: the tp ranks of one read the same
    if args.batch_size % data_world:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the {data_world} data-parallel ranks")

    torch.manual_seed(0)
    config = GPTConfig(n_layer=args.layers, n_embd=args.embd, fused_qkv=args.tp == 1)
    model = GPT(config).to(device)
    num_params = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    mesh, data_rank = None, rank
    if args.tp > 1:
        mesh = init_device_mesh(device.type, (data_world, args.tp), mesh_dim_names=("dp", "tp"))
        parallelize(model, mesh["tp"], sequence_parallel=args.sequence_parallel)
        data_rank = mesh["dp"].get_local_rank()
    # this rank's parameters: its tensor-parallel pieces (what ZeRO shards and DDP would hold per rank)
    rank_params = sum(
        p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in dict.fromkeys(model.parameters())
    )
    tp_group = mesh["tp"].get_group().group_name if mesh is not None else None
    if args.regional:
        zcompile.mark_repeated_blocks(model)
    graphs = []
    options = {
        "stage": args.stage,
        "shard_size": args.shard_size,
        "compiler": args.compiler,
        "param_dtype": args.param_dtype,
        "on_compile": graphs.append,
        "dump": args.dump,
        "keep_gathered_mb": args.keep_gathered_mb,
        "bucket_mb": args.bucket_mb,
        "mesh": mesh,
    }
    if args.compile_blocks:  # one graph for every block; the code around them runs eagerly
        for block in model.blocks:
            block.compile(backend="zero", options=options)
        compiled = model
    else:
        compiled = torch.compile(model, backend="zero", options=options)
    optimizer = zcompile.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, max_grad_norm=args.clip)
    first_step = 0
    if args.resume:
        first_step = zcompile.checkpoint.load(args.resume, model, optimizer).get("step", 0)
        if rank == 0:
            print(f"resumed from {args.resume} at step {first_step}", flush=True)
    held_out = synthetic_batch(-1, args.batch_size, config)  # a batch no step trains on
    ddp_bytes = zcompile.zero_formula_bytes(rank_params, world, stage=None)
    if rank == 0:
        print(
            f"GPT {args.layers} layers, Ψ = {num_params:,} parameters, ZeRO stage {args.stage}, {world} rank(s), "
            f"{args.compiler} compiler, device {device.type}",
            flush=True,
        )

    start = time.perf_counter()
    for step in range(first_step, args.steps):
        tokens, targets = synthetic_batch(step, args.batch_size, config)
        local = slice(data_rank * args.batch_size // data_world, (data_rank + 1) * args.batch_size // data_world)
        loss = compiled(tokens[local].to(device), targets[local].to(device))
        loss.backward()
        optimizer.step()
        states = zcompile.model_state_bytes(model, optimizer)
        optimizer.zero_grad()
        mean_loss = loss.detach().clone()
        if distributed:
            dist.all_reduce(mean_loss)
            mean_loss /= world
        # ZeRO's collectives; the model's own over the tp group (activations) are not parameter traffic
        records = [r for r in step_collectives(graphs, optimizer) if r.group != tp_group]
        comm = summarize(records).get("total", 0)
        clipped = "" if optimizer.last_grad_norm is None else f" | grad norm {optimizer.last_grad_norm:.3f}"
        if rank == 0:
            print(
                f"step {step:3d} | loss {mean_loss.item():.4f}{clipped} | model states {mib(states.total)}/rank "
                f"(DDP {mib(ddp_bytes)}, {ddp_bytes / states.total:.1f}x less) | "
                f"comm {comm / 1e6:.2f}M elements/rank = {comm / rank_params:.2f} Ψ",
                flush=True,
            )
        if args.eval_every and (step + 1) % args.eval_every == 0:
            evaluate(compiled, held_out, rank, world, data_rank, data_world, device, step)
        last = step + 1 == args.steps
        if args.save and (last or (args.save_every and (step + 1) % args.save_every == 0)):
            zcompile.checkpoint.save(args.save, compiled, optimizer, extra={"step": step + 1})
            if rank == 0:
                print(f"saved {args.save} at step {step + 1}", flush=True)
    if rank == 0:
        print(f"{args.steps - first_step} steps in {time.perf_counter() - start:.1f}s", flush=True)
    report = zcompile.step_report(model, optimizer)
    if args.dump:
        report.to_json(str(report_path(args.dump, rank)))
    if rank == 0:
        report.print()
        print(peak_line(report.memory, ddp_bytes), flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
