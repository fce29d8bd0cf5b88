"""How many requests a second the process group's store serves: what the ranks' agreements cost at scale.

    for n in 1 4 16; do torchrun --nproc-per-node $n benchmarks/bench_store_throughput.py --out benchmarks/results/store_throughput_$n.json; done

Every agreement (``zcompile.agreement.store_exchange.exchange_through``) waits for 5 answers from the store per
rank, and one process (torchrun's agent, or rank 0's) serves every rank's. Each rank here sends
``--requests`` answered requests (``store.add`` on a key of its own) back to back, from a barrier;
requests served a second = ranks x requests / the slowest rank's time. On a machine where the
clients share the cores with the store's process this is a floor, not the store's own limit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import slowest_ms, start_gloo_benchmark  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000, help="answered requests per rank")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rank, world, cores = start_gloo_benchmark()
    from zcompile.common.process_group import default_store  # the one place zcompile reads torch's default store

    store = default_store()

    def requests() -> None:
        for _ in range(args.requests):
            store.add(f"bench_store_throughput/{rank}", 1)

    slowest_s = slowest_ms(requests) / 1e3
    served = world * args.requests / slowest_s
    if rank == 0:
        row = {
            "ranks": world,
            "cores": cores,
            "requests_per_rank": args.requests,
            "served_per_s": served,
            "us_per_request_per_rank": 1e6 * slowest_s / args.requests,
            "exchange_ms_at_1024_ranks": 1e3 * 5 * 1024 / served,
        }
        print(
            f"{world} ranks x {args.requests} requests: {served:.0f} served a second, "
            f"{row['us_per_request_per_rank']:.0f} us a request per rank; at this rate one agreement at "
            f"1,024 ranks (5 answered requests each) takes {row['exchange_ms_at_1024_ranks']:.0f} ms"
        )
        if args.out:
            with open(args.out, "w") as f:
                json.dump(row, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
