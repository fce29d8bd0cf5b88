"""Gloo's ways of reducing and scattering a buffer, timed side by side on this machine's ranks.

    torchrun --nproc-per-node 2 benchmarks/bench_gloo_collectives.py      # results/gloo_collectives_2.json
    torchrun --nproc-per-node 4 benchmarks/bench_gloo_collectives.py

Why zcompile runs a reduce-scatter as an all-to-all on gloo (``passes/reduce_scatter_lowering.py``,
the option ``reduce_scatter``): for each size (fp32, MiB of the full input), the median over
``--repeats`` calls, each after a barrier, of the slowest rank's time for

- ``reduce_scatter``: ``dist.reduce_scatter_tensor`` (gloo all-reduces a clone of the input);
- ``all_reduce``: ``dist.all_reduce`` of the input in place (the stage-1 optimizer's way until now);
- ``all_to_all_sum``: ``dist.all_to_all_single`` into a second buffer, then the sum of the ``N`` rows
  received (what zcompile runs; the same result);
- ``all_gather``: ``dist.all_gather_into_tensor`` of one rank's share into the full size, for scale
  (the step's all-gather at stages 1 and 2);
- ``all_gather_by_all_to_all``: the same result as an all-to-all: the share copied into each of the
  ``N`` rows sent, the rows received the gathered buffer.

The calls are interleaved by round, so the machine's drift falls on each alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import print_table, slowest_ms, start_gloo_benchmark  # noqa: E402

WAYS = ("reduce_scatter", "all_reduce", "all_to_all_sum", "all_gather", "all_gather_by_all_to_all")
# torch 2.13 renamed the flat collectives (*_single); 2.11 has the old names
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def calls(numel: int, world: int) -> dict:
    full, out = torch.randn(numel), torch.empty(numel // world)
    received, gathered, sent = torch.empty(numel), torch.empty(numel), torch.empty(world, numel // world)
    return {
        "reduce_scatter": lambda: _reduce_scatter(out, full),
        "all_reduce": lambda: dist.all_reduce(full),
        "all_to_all_sum": lambda: (
            dist.all_to_all_single(received, full),
            torch.sum(received.view(world, -1), 0, out=out),
        ),
        "all_gather": lambda: _all_gather(gathered, out),
        "all_gather_by_all_to_all": lambda: (sent.copy_(out.expand(world, -1)), dist.all_to_all_single(gathered, sent)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=float, nargs="+", default=[0.25, 1, 4, 16])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    rank, world, cores = start_gloo_benchmark()
    rows = []
    for mib in args.mib:
        numel = int(mib * 2**20) // 4 // world * world
        ways = calls(numel, world)
        for fn in ways.values():
            fn()  # warm-up: buffers and connections
        times = {way: [] for way in WAYS}
        for _ in range(args.repeats):
            for way in WAYS:
                times[way].append(slowest_ms(ways[way]))
        rows.append({"mib": mib, **{f"{way}_ms": statistics.median(times[way]) for way in WAYS}})
    if rank == 0:
        print_table(
            f"gloo, {world} ranks on {cores} cores, fp32: median ms of the slowest rank",
            ["MiB", *WAYS, "reduce_scatter / all_to_all_sum"],
            [
                [
                    f"{r['mib']:g}",
                    *(f"{r[f'{w}_ms']:.2f}" for w in WAYS),
                    f"{r['reduce_scatter_ms'] / r['all_to_all_sum_ms']:.2f}",
                ]
                for r in rows
            ],
        )
        out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"gloo_collectives_{world}.json")
        with open(out, "w") as handle:
            json.dump(
                {
                    "world_size": world,
                    "cores": cores,
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
