"""Does gloo survive all-gathers in flight together? The evidence for ``passes/all_gather_lowering.py``.

    python benchmarks/bench_gloo_gather_crash.py [--launches 16] [--rounds 300] [--out benchmarks/results/gloo_gather_crash.json]

Each launch is 2 fresh gloo ranks on this machine (``tests/support/launch.run_ranks``). A round
issues 8 all-gathers of 4,096 fp32 elements (16 KiB) and then waits on them, while this thread
allocates a little (what a graph does between a gather's issue and its wait); ``--rounds`` rounds
per launch. A launch crashed when a rank died of a signal (heap corruption: ``malloc(): unaligned
tcache chunk detected``, a general protection fault in ``pt_gloo_runloop``) or lost its peer to
one. Nothing of zcompile runs: only torch's collectives, in four forms:

- ``functional``: ``_c10d_functional.all_gather_into_tensor`` (what traced graphs call; gloo on
  torch 2.13 runs it as a coalesced all-gather), 8 in flight;
- ``functional_out``: ``_c10d_functional.all_gather_into_tensor_out`` into a buffer allocated first
  (what zcompile's graphs run on gloo), 8 in flight;
- ``dist_async``: ``torch.distributed.all_gather_single(..., async_op=True)`` (2.11:
  ``all_gather_into_tensor``), 8 in flight;
- ``functional_one_at_a_time``: the functional op, each waited before the next is issued;
- ``coalesced_with_all_to_all``: what the sharded optimizer's step ran at stage 1 on gloo
  (``zcompile.optim.buckets``): the process group's coalesced all-gather into given outputs
  (``process_group.all_gather_coalesced_into``) in flight beside an ``all_to_all_single(async_op=True)``;
- ``flat_with_all_to_all``: the same with ``all_gather_single(async_op=True)`` per output.
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
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests")]

from common import print_table  # noqa: E402

from support.launch import run_ranks  # noqa: E402

# torch 2.13's name for the flat all-gather; 2.11's
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
FORMS = (
    "functional",
    "functional_out",
    "dist_async",
    "functional_one_at_a_time",
    "coalesced_with_all_to_all",
    "flat_with_all_to_all",
)
NUMEL, IN_FLIGHT = 4096, 8


def _gather_rounds(rank: int, world: int, form: str, rounds: int) -> bool:
    ops = torch.ops._c10d_functional
    name = dist.group.WORLD.group_name
    shards = [torch.randn(NUMEL) for _ in range(IN_FLIGHT)]
    process_group = dist.group.WORLD
    coalesced = getattr(process_group, "all_gather_single_coalesced", None) or getattr(
        process_group, "allgather_into_tensor_coalesced", None
    )
    for _ in range(rounds):
        pending, works = [], []
        if form in ("coalesced_with_all_to_all", "flat_with_all_to_all"):
            rows = torch.randn(world, NUMEL)
            works.append(dist.all_to_all_single(torch.empty_like(rows), rows, async_op=True))
            outputs = [torch.empty(NUMEL * world) for _ in shards]
            if form == "coalesced_with_all_to_all":
                works.append(coalesced(outputs, shards))
            else:
                works += [_all_gather_flat(out, s, async_op=True) for out, s in zip(outputs, shards)]
        elif form == "functional":
            pending = [ops.all_gather_into_tensor(s, world, name) for s in shards]
        elif form == "functional_out":
            pending = [ops.all_gather_into_tensor_out(s, world, name, out=torch.empty(NUMEL * world)) for s in shards]
        elif form == "dist_async":
            works = [_all_gather_flat(torch.empty(NUMEL * world), s, async_op=True) for s in shards]
        elif form == "functional_one_at_a_time":
            for s in shards:
                ops.wait_tensor(ops.all_gather_into_tensor(s, world, name))
        [torch.randn(1000) * 2 for _ in range(50)]  # the main thread allocates while the gathers run
        for tensor in pending:
            ops.wait_tensor(tensor)
        for work in works:
            work.wait()
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--forms", nargs="*", default=list(FORMS), choices=FORMS)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "gloo_gather_crash.json"))
    args = parser.parse_args()
    results = {}
    for form in args.forms:
        crashed, start, first_error = 0, time.perf_counter(), None
        for _ in range(args.launches):
            try:
                run_ranks(2, _gather_rounds, form, args.rounds, timeout_s=300)
            except (RuntimeError, TimeoutError) as error:
                crashed += 1
                first_error = first_error or str(error).splitlines()[0][:200]
        results[form] = {
            "launches": args.launches,
            "crashed": crashed,
            "seconds": round(time.perf_counter() - start, 1),
            "first_error": first_error,
        }
    with open(args.out, "w") as f:
        json.dump(
            {
                "torch": torch.__version__,
                "rounds": args.rounds,
                "in_flight": IN_FLIGHT,
                "numel": NUMEL,
                "forms": results,
            },
            f,
            indent=1,
        )
    print_table(
        f"2 gloo ranks, {IN_FLIGHT} all-gathers of {NUMEL} fp32 per round, {args.rounds} rounds per launch "
        f"(torch {torch.__version__})",
        ["form", "launches", "crashed"],
        [[form, str(r["launches"]), str(r["crashed"])] for form, r in results.items()],
    )


if __name__ == "__main__":
    main()
