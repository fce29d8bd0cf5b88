"""Warm compile time: a job's first training step when inductor's caches are already full (its second run).

    python benchmarks/bench_warm_compile.py                       # ddp+compile zero1 zero2 zero3, 16 layers
    python benchmarks/bench_warm_compile.py --configs ddp+compile zero3 --layers 4 --runs 5

``bench_speed.py`` measures compiles cold: an empty inductor cache per configuration, every C++
kernel built. A user mostly meets the other case: the same job run again on the same machine, its
kernels and inductor's graphs in the cache, what is left being Dynamo, AOTAutograd's trace and
partition, zcompile's passes and checks, and inductor's cache lookups. Each (configuration, run)
here is a fresh ``torchrun`` job with the configuration's own ``TORCHINDUCTOR_CACHE_DIR``: the
first run of each fills it (its time is shown, not counted), the next ``--runs`` are warm. Runs go
round the configurations in turn, so the machine's drift (up to 30% between minutes) falls on each
alike; the ratios are of medians within one run of this script. The model, batch and inductor inner
compiler are ``bench_speed.py``'s (``build``: the example GPT, n_embd 128, seq 128, 4 sequences a
rank, AdamW). Results: ``results/warm_compile_<world>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import print_table  # noqa: E402

MARK = "WARM_COMPILE_RESULT "


def worker(config: str, layers: int) -> None:
    """One job (under torchrun): the configuration's first training step and the compile's phases."""
    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    import bench_speed
    import torch.distributed as dist
    from common import start_gloo_benchmark, timed_training_step
    from gpt import GPTConfig, synthetic_batch

    rank, world, _ = start_gloo_benchmark()
    graphs: list = []
    module, optimizer = bench_speed.build(config, layers, "inductor", graphs)
    cfg = GPTConfig(vocab_size=512, block_size=bench_speed.SEQ)
    tokens, targets = synthetic_batch(0, bench_speed.PER_RANK * world, cfg)
    first = timed_training_step(module, optimizer, tokens.chunk(world)[rank], targets.chunk(world)[rank])
    if rank == 0:
        parts = bench_speed.compile_parts(graphs)
        parts.pop("zero_passes_by_name_s")
        print(MARK + json.dumps({"first_step_s": first, **parts}), flush=True)
    dist.barrier()
    # out without tearing down: freeing DDP's reducer after the process group hung in gloo's destructor
    # here (a worker thread waiting for the GIL the joining thread holds), and the result is out already
    sys.stdout.flush()
    os._exit(0)


def run_job(config: str, layers: int, world: int, cache_dir: str, port: int) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    command = [
        "torchrun",
        f"--nproc-per-node={world}",
        f"--master-port={port}",
        os.path.abspath(__file__),
        "--worker",
        config,
        str(layers),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    for line in done.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    raise RuntimeError(f"{config} ({layers} layers) failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=["ddp+compile", "zero1", "zero2", "zero3"])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument(
        "--runs", type=int, default=3, help="warm runs of each configuration, after the one that fills its cache"
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--port", type=int, default=29741)
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "LAYERS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]))
        return
    import bench_speed

    unknown = [c for c in args.configs if c not in bench_speed.CONFIGS]
    if unknown:
        parser.error(f"unknown configurations {unknown}; choose from {bench_speed.CONFIGS}")
    root = tempfile.mkdtemp(prefix="bench_warm_compile_")
    runs: dict[str, list[dict]] = {config: [] for config in args.configs}
    try:
        for round_ in range(args.runs + 1):
            for config in args.configs:
                result = run_job(
                    config, args.layers, args.world, os.path.join(root, config.replace("+", "_")), args.port
                )
                runs[config].append(result)
                print(
                    f"{'fill' if round_ == 0 else f'warm {round_}'} {config}: {result['first_step_s']:.2f} s",
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = statistics.median(r["first_step_s"] for r in runs[args.configs[0]][1:])
    rows, table = [], []
    for config, results in runs.items():
        warm = [r["first_step_s"] for r in results[1:]]
        median = statistics.median(warm)
        rows.append(
            {
                "config": config,
                "layers": args.layers,
                "cold_first_step_s": results[0]["first_step_s"],
                "warm_first_steps_s": warm,
                "warm_median_s": median,
                "ratio": median / base,
                "warm_runs": results[1:],
            }
        )
        table.append(
            (
                config,
                f"{results[0]['first_step_s']:.2f}",
                " / ".join(f"{t:.2f}" for t in warm),
                f"{median:.2f}",
                f"{median / base:.2f}x",
            )
        )
    print_table(
        f"first training step, {args.layers} layers, {args.world} ranks, inductor (s)",
        ("config", "cache-filling run", "warm runs", "warm median", f"x {args.configs[0]}"),
        table,
    )
    out = args.out or os.path.join(HERE, "results", f"warm_compile_{args.world}.json")
    with open(out, "w") as handle:
        json.dump(
            {"world_size": args.world, "cores": os.cpu_count(), "layers": args.layers, "rows": rows}, handle, indent=1
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
