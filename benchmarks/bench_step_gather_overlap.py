"""What the stage-1/2 step's all-gather would save if it moved behind the next forward, measured.

    torchrun --nproc-per-node 2 benchmarks/bench_step_gather_overlap.py    # results/step_gather_overlap_2.json

At stages 1 and 2 the optimizer all-gathers the updated shards into the replicated weights at the end
of ``step()``, where nothing runs beside it; that all-gather is most of the difference between a stage-2
step and DDP's on a CPU (README, Compile time and step time). Deferring it to the next forward (each
bucket waited just before its first use, as FSDP2 without resharding does) would hide what the
forward's compute can cover. This measures that bound before building it, on the example GPT with the
optimizer's 4 MiB buckets, the median over ``--repeats`` rounds (each phase after a barrier, the
slowest rank's time; phases interleaved by round):

- ``forward``: a training forward (autograd recording), eager;
- ``gather``: the step's all-gathers of every parameter, one per bucket into a flat buffer, waited;
- ``gather_landed``: the same as the optimizer runs it (``process_group.all_gather_coalesced_into``,
  each bucket's all-gather started once the one before it is waited): into each parameter's own
  padded storage, so gloo copies every member's piece out of its flat buffer. Less ``gather``, it is what
  landing costs: what a flat-parameter layout (parameters as views of the gathered buffer, FSDP1's)
  would save, where every shard is a slice of a flat bucket instead of each parameter's own 1/N;
- ``serial``: the gathers waited, then the forward (today's order);
- ``overlapped``: the gathers started, the forward, then their waits (the best a deferral could do:
  no bucket waited before the forward ends).

And the step's communication against DDP's, the model's fp32 gradients once: ``all_reduce`` (DDP) and
``reduce_scatter`` (as zcompile runs it on gloo: an all-to-all and a sum) plus ``gather``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

from common import print_table, slowest_ms, start_gloo_benchmark  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

from zcompile.common.process_group import DataParallelGroup, all_gather_coalesced_into  # noqa: E402

PHASES = ("forward", "gather", "gather_landed", "serial", "overlapped", "all_reduce", "reduce_scatter")
BUCKET_BYTES = 4 * 2**20  # zcompile.optim's default bucket_mb


def phases(layers: int, world: int) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, block_size=128, n_layer=layers, n_head=4, n_embd=128))
    tokens, targets = torch.randint(0, 512, (4, 128)), torch.randint(0, 512, (4, 128))
    numel = sum(p.numel() for p in model.parameters())
    per_bucket = BUCKET_BYTES // 4 // world * world
    sizes = [min(per_bucket, numel - start) for start in range(0, numel, per_bucket)]
    sizes = [size + (-size) % world for size in sizes]
    outputs = [torch.empty(size) for size in sizes]
    inputs = [torch.randn(size // world) for size in sizes]
    grads, received = torch.randn(sum(sizes)), torch.empty(sum(sizes))
    shard = torch.empty(sum(sizes) // world)

    # gather_landed: the optimizer's buckets over each parameter's padded storage ([N * s_i], this
    # rank's s_i its shard), consecutive parameters up to BUCKET_BYTES of full parameter
    group = DataParallelGroup.resolve()
    shard_numels = [-(-p.numel() // world) for p in model.parameters()]
    landed_buckets, size = [[]], 0
    for shard_numel in shard_numels:
        if landed_buckets[-1] and size + shard_numel * world * 4 > BUCKET_BYTES:
            landed_buckets.append([])
            size = 0
        landed_buckets[-1].append(torch.empty(shard_numel * world))
        size += shard_numel * world * 4
    rank = dist.get_rank()

    def gather_landed():
        in_flight = None
        for storages in landed_buckets:
            shards = [storage.view(world, -1)[rank] for storage in storages]
            work = all_gather_coalesced_into(storages, shards, group)
            if in_flight is not None:
                in_flight.wait()
            in_flight = work
        in_flight.wait()

    def forward():
        model(tokens, targets)

    def gather(async_op=False):
        return [dist.all_gather_into_tensor(out, inp, async_op=async_op) for out, inp in zip(outputs, inputs)]

    def overlapped():
        works = gather(async_op=True)
        forward()
        for work in works:
            work.wait()

    def reduce_scatter():
        dist.all_to_all_single(received, grads)
        torch.sum(received.view(world, -1), 0, out=shard)

    return {
        "forward": forward,
        "gather": gather,
        "gather_landed": gather_landed,
        "serial": lambda: (gather(), forward()),
        "overlapped": overlapped,
        "all_reduce": lambda: dist.all_reduce(grads),
        "reduce_scatter": reduce_scatter,
        "_numel": numel,
        "_buckets": len(sizes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rank, world, cores = start_gloo_benchmark()
    rows = []
    for layers in args.layers:
        ways = phases(layers, world)
        for phase in PHASES:
            ways[phase]()  # warm-up: buffers and connections
        times = {phase: [] for phase in PHASES}
        for _ in range(args.repeats):
            for phase in PHASES:
                times[phase].append(slowest_ms(ways[phase]))
        medians = {phase: statistics.median(times[phase]) for phase in PHASES}
        hidden = (medians["serial"] - medians["overlapped"]) / medians["gather"]
        rows.append(
            {
                "layers": layers,
                "params": ways["_numel"],
                "buckets": ways["_buckets"],
                **{f"{phase}_ms": medians[phase] for phase in PHASES},
                "gather_hidden_fraction": hidden,
                "zero_comm_over_ddp": (medians["reduce_scatter"] + medians["gather"]) / medians["all_reduce"],
            }
        )
    if rank == 0:
        print_table(
            f"gloo, {world} ranks on {cores} cores, fp32: median ms of the slowest rank",
            ["layers", "params", *PHASES, "gather hidden", "(RS + AG) / AR"],
            [
                [
                    str(r["layers"]),
                    f"{r['params'] / 1e6:.2f}M",
                    *(f"{r[f'{p}_ms']:.1f}" for p in PHASES),
                    f"{r['gather_hidden_fraction']:.0%}",
                    f"{r['zero_comm_over_ddp']:.2f}",
                ]
                for r in rows
            ],
        )
        out = os.path.join(HERE, "results", f"step_gather_overlap_{world}.json")
        with open(out, "w") as handle:
            json.dump(
                {
                    "world_size": world,
                    "cores": cores,
                    "torch": torch.__version__,
                    "repeats": args.repeats,
                    "load_average_at_end": os.getloadavg(),
                    "rows": rows,
                },
                handle,
                indent=1,
            )
        print(f"wrote {out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
