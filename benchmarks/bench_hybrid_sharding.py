"""Hybrid sharding at scale, simulated: Llama-3 8B and 70B shapes at 64, 512 and 1,024 H100s.

    python benchmarks/bench_hybrid_sharding.py          # writes results/hybrid_sharding.json

Each row is ``bench_simulate.run`` (stage 3, bf16, 64 MiB buckets, sequence 8,192, local batch 1,
the ``h100-sxm`` profile: 8 GPUs a node) with full sharding or ``shard_size`` 8 / 16 / 32: memory
per GPU, the bytes each GPU sends or receives across nodes per step (collectives whose group spans
nodes), the predicted step, tokens/s per GPU and MFU.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_simulate import run  # noqa: E402
from common import print_table  # noqa: E402

SHARD_SIZES = (None, 8, 16, 32)
RUNS = [
    (shape, world, size) for shape in ("llama3-8b", "llama3-70b") for world in (64, 512, 1024) for size in SHARD_SIZES
]


def main() -> None:
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "hybrid_sharding.json")
    results, rows = [], []
    for shape, world, size in RUNS:
        r = run(shape, world, 1, {} if size is None else {"shard_size": size})
        across = sum(entry["across_nodes_bytes"] for entry in r["collectives"].values())
        r["bytes_across_nodes"] = across
        r["shard_size"] = size or world
        results.append(r)
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
        rows.append(
            (
                shape,
                str(world),
                "full" if size is None else str(size),
                f"{r['per_rank_bytes'] / 2**30:.1f}",
                f"{r['memory']['model_states_bytes'] / 2**30:.1f}",
                f"{across / 2**30:.2f}",
                f"{r['step_s']:.2f}",
                f"{r['exposed_comm_s']:.2f}",
                f"{r['tokens_per_s_per_gpu']:,.0f}",
                f"{100 * r['mfu']:.0f}%",
                f"{r['wall_s']:.0f}",
            )
        )
        print(rows[-1], flush=True)
    print_table(
        "simulated hybrid sharding: stage 3, bf16, h100-sxm (8 a node), seq 8192, local batch 1",
        [
            "model",
            "GPUs",
            "shard",
            "GiB/GPU",
            "states",
            "GiB across",
            "step s",
            "exposed s",
            "tok/s/GPU",
            "MFU",
            "sim s",
        ],
        rows,
    )
    print("wrote", out)


if __name__ == "__main__":
    main()
