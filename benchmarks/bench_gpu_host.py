"""Is a world-1 zero step on a GPU waiting on the host? Step time against the host's time to enqueue it.

    python benchmarks/bench_gpu_host.py [--configs s2bf16 s3bf16 ...] [--per-shard] [--profile]
    python benchmarks/bench_gpu_host.py --allow-cpu      # small, on a CPU (checks the script)

For each configuration (the example GPT, 12 layers, n_embd 768, seq 512, batch 8, AdamW): the
median wall time of a step (synchronized) and the host's time to enqueue one (``step()`` returning,
before synchronizing). When the two are equal the GPU waits on Python: the step is host-bound and
cutting host work is what makes it faster. ``--per-shard`` adds each configuration again with the
optimizer's update launched per shard (as before the multi-tensor launch), on the same machine;
``--profile`` writes torch profiler tables (by self CPU and self CUDA time) and the Python profile
(cProfile, by own and cumulative time) of 3 steps next to the JSON file.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "examples")]

from common import print_table  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

import zcompile.optim  # noqa: E402

CONFIGS = {
    "s1fp32": {"stage": 1},
    "s2bf16": {"stage": 2, "param_dtype": "bf16"},
    "s3bf16": {"stage": 3, "param_dtype": "bf16"},
    "s3fp32": {"stage": 3},
    "s2bf16_inductor": {"stage": 2, "param_dtype": "bf16", "compiler": "inductor"},
    "s3bf16_inductor": {"stage": 3, "param_dtype": "bf16", "compiler": "inductor"},
}


def measure(name: str, options: dict, device: str, per_shard: bool, steps: int, profile_dir: str | None) -> dict:
    optimizer = zcompile.optim.ShardedOptimizer
    multi = optimizer.__dict__["_multi_tensor_launch"]
    if per_shard:  # the launch per shard that the multi-tensor launch replaced
        optimizer._multi_tensor_launch = staticmethod(lambda batch: False)
    try:
        return _measure(name, options, device, steps, profile_dir)
    finally:
        optimizer._multi_tensor_launch = multi


def _measure(name: str, options: dict, device: str, steps: int, profile_dir: str | None) -> dict:
    cuda = device == "cuda"
    config = (
        GPTConfig(vocab_size=50304, n_layer=12, n_head=12, n_embd=768, block_size=512)
        if cuda
        else GPTConfig(n_layer=2, n_embd=64, block_size=64)
    )
    batch = 8 if cuda else 2
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(config).to(device)
    compiled = torch.compile(model, backend="zero", options=options)
    opt = zcompile.optim.AdamW(model.parameters(), lr=1e-4)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def step(i):
        tokens, targets = (t.to(device) for t in synthetic_batch(i, batch, config))
        compiled(tokens, targets).backward()
        opt.step()
        opt.zero_grad()

    wall, enqueue = [], []
    for i in range(steps + 2):  # two warm-up steps (compile)
        sync()
        start = time.perf_counter()
        step(i)
        enqueued = time.perf_counter()
        sync()
        if i >= 2:
            wall.append(time.perf_counter() - start)
            enqueue.append(enqueued - start)
    row = {
        "config": name,
        "options": options,
        "median_step_ms": statistics.median(wall) * 1e3,
        "median_enqueue_ms": statistics.median(enqueue) * 1e3,
    }
    row["host_bound"] = row["median_enqueue_ms"] > 0.9 * row["median_step_ms"]
    if profile_dir is not None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for i in range(3):
                step(i)
            sync()
        # the Python side too: the torch profiler sees ops, not the interpreter's time between them
        python_profile = cProfile.Profile()
        python_profile.enable()
        for i in range(3):
            step(i)
        sync()
        python_profile.disable()
        with open(os.path.join(profile_dir, f"host_profile_{name}.txt"), "w") as handle:
            for key in (["self_cuda_time_total"] if cuda else []) + ["self_cpu_time_total"]:
                handle.write(prof.key_averages().table(sort_by=key, row_limit=30) + "\n")
            for key in ("tottime", "cumulative"):
                stats = pstats.Stats(python_profile, stream=handle)
                stats.sort_stats(key).print_stats(40)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--per-shard", action="store_true", help="each configuration again, updated per shard")
    parser.add_argument("--profile", action="store_true", help="profiler tables next to the JSON file")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--allow-cpu", action="store_true", help="run small on a CPU (checks the script)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "gpu_host.json"))
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.allow_cpu:
        print("bench_gpu_host: no CUDA device here; pass --allow-cpu to check the script on a CPU", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    rows = []
    for name in args.configs:
        for per_shard in [False, True] if args.per_shard else [False]:
            label = name + (" per shard" if per_shard else "")
            row = measure(
                label.replace(" ", "_"),
                CONFIGS[name],
                device,
                per_shard,
                args.steps,
                os.path.dirname(os.path.abspath(args.out)) if args.profile and not per_shard else None,
            )
            row["config"], row["optimizer_launch"] = name, "per shard" if per_shard else "multi-tensor"
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as handle:
        json.dump(
            {
                "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                "torch": torch.__version__,
                "rows": rows,
            },
            handle,
            indent=1,
        )
    print_table(
        "bench_gpu_host",
        ("config", "optimizer launch", "median step ms", "enqueue ms", "host-bound"),
        [
            (
                r["config"],
                r["optimizer_launch"],
                f"{r['median_step_ms']:.1f}",
                f"{r['median_enqueue_ms']:.1f}",
                "yes" if r["host_bound"] else "no",
            )
            for r in rows
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
