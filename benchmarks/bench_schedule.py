"""Scheduling passes of the zero backend (bucketing, prefetch, overlap, memory budget) on N gloo ranks.

    torchrun --nproc-per-node 2 benchmarks/bench_schedule.py [--layers 4 8] [--steps 10]
        [--out benchmarks/results/schedule_2.json]

The example GPT (``examples/gpt.py``) at each depth, the same per-rank batch in every
configuration; each configuration is a fresh model and a fresh Dynamo (``torch._dynamo.reset()``),
with ``zcompile.optim.AdamW`` created before ``torch.compile``. Measured in one run, rank 0 prints
four tables and writes them, with every per-rank figure, as JSON:

1. collectives per step at stage 3 with ``bucket_mb`` 0 (one per parameter), 0.01 and the default
   4.0, counted from ``zcompile.step_report`` (the compiled graphs) and cross-checked against what
   the profiler saw issued (``zcompile.timeline.record_step``, ``TimelineResult.count``);
2. exposed communication per step: ``TimelineResult.wait_us``, the time the step blocked in
   ``wait_tensor``, median over ``--profile-steps`` profiled steps (a barrier before each), with
   ``overlap=False`` against the default ``overlap=True``, and with no scheduling at all
   (``bucket_mb=0, overlap=False``); beside it the time gloo spent moving data (union of its events);
   and (2b) the same wait, step time and peak gathered bytes at prefetch depths 0, 1 and 2;
3. step time, median over ``--steps`` timed steps (each the slowest rank's time, after a barrier),
   of zero stage 3 and stage 2 (default options) and stage 3 keeping ``KEEP_MB`` of gathered weights
   for backward (``keep_gathered_mb``) against eager DDP and FSDP2 (``fully_shard`` on
   each block, then the root) with ``torch.optim.AdamW``. The baselines are built once per depth and
   stepped in rounds with the zero model, order rotated each round; a ratio is the median over
   rounds of zero's time over the baseline's, so both sides come from the same seconds of a shared,
   noisy machine;
4. gathered-parameter bytes per rank with the default schedule and with ``prefetch=2`` under
   ``memory_budget_mb``, per depth: ``report.memory["peak_gathered_bytes"]`` (per storage, the rule
   the schedule's budget uses) and, read from the same graphs with the storages of
   ``zcompile.passes.liveness``, each all-gather's output held from its issue to its last reader,
   counted per whole bucket (a bucket until the last use of any piece) and per storage (a bucket's
   buffer until its pieces are copied out, each piece until its own last use: what the allocator
   holds; the report's rule, so the two columns agree by construction).

Every rank runs one intra-op thread (``torch.set_num_threads(1)``). On CPU, gloo runs a
reduce-scatter as an all-reduce and moves data on its own threads, which compete with compute for
the cores: with as many ranks as cores (or more) that contention, not the schedule, sets how much
communication can hide. Traces of the last profiled step of each configuration: ``--trace-dir``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

from common import print_table, start_gloo_benchmark  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

import zcompile  # noqa: E402
from zcompile.passes.collectives import ALL_GATHER, ALL_REDUCE, COLLECTIVE_KINDS, REDUCE_SCATTER  # noqa: E402
from zcompile.passes.liveness import dependency_graph, gathered_peak_bytes, node_bytes, peak_bytes, storages  # noqa: E402
from zcompile.reports.step_report import compiled_graphs_of  # noqa: E402
from zcompile.reports.timeline import record_step  # noqa: E402

LR, WEIGHT_DECAY = 3e-4, 0.01
KINDS = tuple(COLLECTIVE_KINDS[op] for op in (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE))  # the kinds ZeRO issues
BUDGET_MB = 8.0
KEEP_MB = 8.0


@dataclass(frozen=True)
class Config:
    name: str
    stage: int
    options: dict
    profiled: bool  # several profiled steps (wait) instead of one (counts only)
    timed: bool  # timed steps
    baselines: bool = False  # DDP and FSDP2 stepped in turn with it


CONFIGS = [
    Config("s3 bucket 0, no overlap", 3, {"bucket_mb": 0, "overlap": False}, True, True),  # no scheduling at all
    Config("s3 bucket 0.01", 3, {"bucket_mb": 0.01}, False, False),
    Config("s3 no overlap", 3, {"overlap": False}, True, True),
    Config("s3 default", 3, {}, True, True, baselines=True),
    Config(f"s3 prefetch 2, budget {BUDGET_MB:g} MiB", 3, {"prefetch": 2, "memory_budget_mb": BUDGET_MB}, False, False),
    Config("s3 prefetch 0", 3, {"prefetch": 0}, True, True),
    Config("s3 prefetch 2", 3, {"prefetch": 2}, True, True),
    Config(f"s3 keep {KEEP_MB:g} MiB", 3, {"keep_gathered_mb": KEEP_MB}, True, True, baselines=True),
    Config("s2 default", 2, {}, False, True, baselines=True),
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--steps", type=int, default=10, help="measured steps per configuration (median)")
    parser.add_argument("--warmup", type=int, default=3, help="steps before measuring (the first compiles)")
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=5,
        help="profiled steps of the configurations whose wait is compared (median)",
    )
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--out", default=None, help="JSON results (default benchmarks/results/schedule_N.json)")
    parser.add_argument(
        "--configs",
        nargs="+",
        default=None,
        metavar="NAME",
        help=f"run only these configurations (no tables then): {[c.name for c in CONFIGS]}",
    )
    parser.add_argument("--trace-dir", default=os.path.join(tempfile.gettempdir(), "zcompile_bench_schedule"))
    return parser.parse_args()


def gpt_config(layers: int, args) -> GPTConfig:
    return GPTConfig(vocab_size=512, block_size=64, n_layer=layers, n_head=4, n_embd=args.embd)


def new_model(config: GPTConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(config)


def local_batch(step: int, config: GPTConfig, args, rank: int, world: int):
    tokens, targets = synthetic_batch(step, args.batch * world, config)
    local = slice(rank * args.batch, (rank + 1) * args.batch)
    return tokens[local], targets[local]


def train_step(model, optimizer, batch) -> None:
    model(*batch).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed(fn) -> float:
    """Seconds of ``fn()`` on this rank, started together on every rank."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def slowest(times: list[float]) -> list[float]:
    """Per step, the slowest rank's time (the step is done when every rank is)."""
    values = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.tolist()


def baselines(config: GPTConfig, world: int) -> dict:
    """Eager DDP and FSDP2 models of the same initialization, each with ``torch.optim.AdamW``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(new_model(config))
    fsdp = new_model(config)
    mesh = init_device_mesh("cpu", (world,))
    for block in fsdp.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    return {
        name: (model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY))
        for name, model in (("DDP", ddp), ("FSDP2", fsdp))
    }


@contextlib.contextmanager
def without_profiler_chatter():
    """Drops the ``USDT: ... profiler_start/stop`` lines kineto writes to fd 2; keeps everything else."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode(errors="replace")
            sys.stderr.write("".join(line for line in text.splitlines(True) if not line.startswith("USDT:")))


def held_gathered_bytes(gm, by_storage: bool = False) -> int:
    """Most gathered-parameter bytes held at once in ``gm``'s order, each all-gather's output counted
    from its issue (the buffer exists while the data moves) to its last reader, walking through the
    ops that prepare a gathered buffer for its reader (``zcompile.passes.op_sets.PREP_OPS``).

    ``by_storage=False``: a bucket is held until the last compute that reads any piece of it (the
    rule ``plan_schedule`` used before it counted per storage; kept for comparison): the latest
    last reader of any storage the gather's data lives in (``zcompile.passes.liveness.storages``).
    ``by_storage=True``: every storage on its own, the bucket's buffer until its pieces are copied
    out and each copied piece until its own last reader, which is what the allocator holds: the rule
    of ``zcompile.passes.liveness.gathered_peak_bytes``, the one the report's peak uses.
    """
    if gm is None:
        return 0
    if by_storage:
        return gathered_peak_bytes(gm)
    dag = dependency_graph(gm)
    position = dict(dag.nodes(data="position"))
    held = []
    for gather in gm.graph.find_nodes(op="call_function", target=ALL_GATHER):
        last = max(last for _, _, last, _ in storages(dag, position, gather))
        held.append((position[gather], last, node_bytes(gather)))
    return peak_bytes(held)


def union_ms(events) -> float:
    """Milliseconds covered by ``events`` (overlapping ones counted once)."""
    total, reach = 0.0, float("-inf")
    for event in sorted(events, key=lambda e: e.start_us):
        end = event.start_us + event.duration_us
        if end > reach:
            total += end - max(event.start_us, reach)
            reach = end
    return total / 1e3


def run_config(cfg: Config, config: GPTConfig, args, rank: int, world: int, others: dict, warmed: set) -> dict:
    """One zero configuration: compile, report, profiled steps, timed steps (``others`` in turn)."""
    torch._dynamo.reset()
    model = new_model(config)
    optimizer = zcompile.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    compiled = torch.compile(model, backend="zero", options={"stage": cfg.stage, **cfg.options})
    steppers = {"zero": lambda i: train_step(compiled, optimizer, local_batch(i, config, args, rank, world))}
    for other, (other_model, other_opt) in others.items():
        steppers[other] = (lambda m, o: lambda i: train_step(m, o, local_batch(i, config, args, rank, world)))(
            other_model, other_opt
        )

    compile_s = timed(lambda: steppers["zero"](0))  # the first step compiles
    for i in range(1, args.warmup):
        steppers["zero"](i)
    report = zcompile.step_report(model, optimizer)
    counted = {kind: sum(c["kind"] == kind for c in report.collectives) for kind in KINDS}
    graphs = compiled_graphs_of(model)
    held = max(held_gathered_bytes(getattr(g, where)) for g in graphs for where in ("forward", "backward"))
    held_storage = max(
        held_gathered_bytes(getattr(g, where), by_storage=True) for g in graphs for where in ("forward", "backward")
    )

    slug = cfg.name.replace(" ", "_").replace(",", "")
    trace_dir = os.path.join(args.trace_dir, f"n{world}", f"L{config.n_layer}_{slug}")
    profiled = []
    for i in range(args.warmup, args.warmup + (args.profile_steps if cfg.profiled else 1)):
        dist.barrier()  # the previous step's trace export ends at different times on each rank
        with without_profiler_chatter():
            profiled.append(record_step(lambda i=i: steppers["zero"](i), trace_dir, rank))
    last = profiled[-1]
    first = args.warmup + len(profiled)

    step_ms, step_ratio = {}, {}
    if cfg.timed:
        for other in [o for o in others if o not in warmed]:  # warm-up once per depth, in the same order on every rank
            for i in range(args.warmup):
                steppers[other](i)
            warmed.add(other)
        names = list(steppers)
        times = {n: [] for n in names}
        for k in range(args.steps):
            for j in range(len(names)):  # rotate the order each step
                n = names[(k + j) % len(names)]
                times[n].append(timed(lambda: steppers[n](first + k)))
        times = {n: slowest(t) for n, t in times.items()}
        step_ms = {n: 1e3 * statistics.median(t) for n, t in times.items()}
        # each step's zero time over the baseline's time of the same round: robust to the load drifting
        step_ratio = {n: statistics.median(z / b for z, b in zip(times["zero"], times[n])) for n in others}
    waits = [p.wait_us / 1e3 for p in profiled]
    return {
        "name": cfg.name,
        "stage": cfg.stage,
        "options": cfg.options,
        "layers": config.n_layer,
        "rank": rank,
        "compile_and_first_step_s": compile_s,
        "graphs": len(graphs),
        "report_counts": counted,
        "timeline_counts": {kind: last.count(kind) for kind in (*KINDS, "wait")},
        "timeline_counts_stable": all(p.count(kind) == last.count(kind) for p in profiled for kind in KINDS),
        "wait_ms": statistics.median(waits),
        "wait_ms_min": min(waits),
        "wait_ms_steps": waits,
        "transfer_ms": statistics.median(union_ms(p.transfers) for p in profiled),
        "profiled_step_ms": statistics.median(p.step_us for p in profiled) / 1e3,
        "exposed_in_graph": sum(s.overlapped_ops == 0 for s in report.schedule),
        "collectives_in_graph": len(report.schedule),
        "report_peak_gathered_bytes": report.memory["peak_gathered_bytes"],
        "held_gathered_bytes": held,
        "held_gathered_storage_bytes": held_storage,
        "largest_gather_bytes": max((c["bytes"] for c in report.collectives if c["kind"] == "all_gather"), default=0),
        "model_states_bytes": report.memory["model_states_bytes"],
        "elements_per_step": report.totals.get("total", 0),
        "num_params": report.num_params,
        "backward_gathered_params": sum(
            len(c["params"]) for c in report.collectives if c["kind"] == "all_gather" and c["where"] == "backward"
        ),
        "kept_gathered_bytes": report.memory["kept_gathered_bytes"],
        "step_ms": step_ms,
        "step_ratio": step_ratio,
        "trace": last.trace_path,
    }


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def print_tables(results: list[dict], setup: str) -> dict:
    """The four tables on rank 0; returns the ratios they show."""
    by = {(r["layers"], r["name"]): r for r in results}
    depths = sorted({r["layers"] for r in results})
    ratios = {}

    rows = []
    for layers in depths:
        base_total = sum(by[(layers, "s3 bucket 0, no overlap")]["report_counts"].values())
        for name, label in (
            ("s3 bucket 0, no overlap", "0"),
            ("s3 bucket 0.01", "0.01"),
            ("s3 default", "4.0 (default)"),
        ):
            r = by[(layers, name)]
            total = sum(r["report_counts"].values())
            ratios[f"L{layers} collectives bucket_mb 0 / bucket_mb {label.split()[0]}"] = base_total / total
            rows.append(
                (
                    f"{layers}",
                    label,
                    f"{r['report_counts']['all_gather']} / {r['timeline_counts']['all_gather']}",
                    f"{r['report_counts']['reduce_scatter']} / {r['timeline_counts']['reduce_scatter']}",
                    f"{total}",
                    f"{base_total / total:.1f}x",
                )
            )
    print_table(
        f"1. Collectives per step, stage 3 (report / profiler), {setup}",
        ("layers", "bucket_mb", "all_gather", "reduce_scatter", "total", "bucket 0 / this"),
        rows,
    )

    rows = []
    for layers in depths:
        none, off, on = (by[(layers, n)] for n in ("s3 bucket 0, no overlap", "s3 no overlap", "s3 default"))
        ratios[f"L{layers} wait overlap=True / overlap=False"] = on["wait_ms"] / off["wait_ms"]
        ratios[f"L{layers} wait default / bucket 0 no overlap"] = on["wait_ms"] / none["wait_ms"]
        ratios[f"L{layers} step overlap=True / overlap=False"] = on["step_ms"]["zero"] / off["step_ms"]["zero"]
        for r in (none, off, on):
            rows.append(
                (
                    f"{layers}",
                    r["name"],
                    f"{r['wait_ms']:.0f}",
                    f"{r['wait_ms_min']:.0f}",
                    f"{r['transfer_ms']:.0f}",
                    f"{r['profiled_step_ms']:.0f}",
                    f"{r['exposed_in_graph']}/{r['collectives_in_graph']}",
                    f"{r['step_ms']['zero']:.0f}",
                    f"{r['wait_ms'] / off['wait_ms']:.2f}",
                )
            )
    print_table(
        f"2. Exposed communication per step: wait_tensor ms (median and min of profiled steps, mean of "
        f"ranks), gloo transfer ms, {setup}",
        (
            "layers",
            "config",
            "wait",
            "wait min",
            "transfer",
            "step (prof.)",
            "exposed in graph",
            "step (timed)",
            "wait / no overlap",
        ),
        rows,
    )

    rows = []
    for layers in depths:
        for name in ("s3 prefetch 0", "s3 default", "s3 prefetch 2"):
            r = by[(layers, name)]
            depth = r["options"].get("prefetch", 1)
            ratios[f"L{layers} wait prefetch {depth} / prefetch 1"] = (
                r["wait_ms"] / by[(layers, "s3 default")]["wait_ms"]
            )
            ratios[f"L{layers} step prefetch {depth} / prefetch 1"] = (
                r["step_ms"]["zero"] / by[(layers, "s3 default")]["step_ms"]["zero"]
            )
            rows.append(
                (
                    f"{layers}",
                    f"{depth}",
                    f"{r['wait_ms']:.0f}",
                    f"{r['step_ms']['zero']:.0f}",
                    mib(r["report_peak_gathered_bytes"]),
                )
            )
    print_table(
        f"2b. Prefetch depth (stage 3, 4 MiB buckets): wait ms, step ms, peak gathered MiB, {setup}",
        ("layers", "prefetch", "wait", "step (timed)", "peak gathered"),
        rows,
    )

    rows = []
    for layers in depths:
        for name in ("s3 default", f"s3 keep {KEEP_MB:g} MiB", "s2 default"):
            r = by[(layers, name)]
            ms, per_step = r["step_ms"], r["step_ratio"]
            ratios[f"L{layers} {name} / DDP"] = per_step["DDP"]
            ratios[f"L{layers} {name} / FSDP2"] = per_step["FSDP2"]
            rows.append(
                (
                    f"{layers}",
                    name,
                    f"{ms['zero']:.0f}",
                    f"{ms['DDP']:.0f}",
                    f"{ms['FSDP2']:.0f}",
                    f"{per_step['DDP']:.2f}",
                    f"{per_step['FSDP2']:.2f}",
                    f"{r['backward_gathered_params']}",
                    mib(r["kept_gathered_bytes"]),
                )
            )
    print_table(
        f"3. Step time, median ms of the slowest rank, zero vs eager DDP and FSDP2 stepped in turn; ratios: "
        f"median over rounds of zero / baseline; parameters re-gathered in backward, {setup}",
        ("layers", "zero", "zero ms", "DDP ms", "FSDP2 ms", "zero/DDP", "zero/FSDP2", "bw re-gathered", "kept MiB"),
        rows,
    )

    rows = []
    for layers in depths:
        for name in (
            "s3 bucket 0, no overlap",
            "s3 default",
            f"s3 prefetch 2, budget {BUDGET_MB:g} MiB",
            f"s3 keep {KEEP_MB:g} MiB",
        ):
            r = by[(layers, name)]
            budget = r["options"].get("memory_budget_mb")
            ratios[f"L{layers} {name} held gathered MiB"] = r["held_gathered_bytes"] / 2**20
            rows.append(
                (
                    f"{layers}",
                    name,
                    f"{r['options'].get('prefetch', 1)}",
                    "-" if budget is None else f"{budget:g}",
                    mib(r["largest_gather_bytes"]),
                    mib(r["report_peak_gathered_bytes"]),
                    mib(r["held_gathered_bytes"]),
                    mib(r["held_gathered_storage_bytes"]),
                    mib(r["model_states_bytes"]),
                )
            )
    print_table(
        f"4. Gathered parameters per rank (MiB, read from the compiled graphs), {setup}",
        (
            "layers",
            "config",
            "prefetch",
            "budget",
            "largest gather",
            "report peak",
            "held (whole bucket)",
            "held (per storage)",
            "model states",
        ),
        rows,
    )
    return ratios


def main() -> None:
    args = parse_args()
    rank, world, cores = start_gloo_benchmark()
    setup = (
        f"{world} gloo ranks on {cores} CPU cores{' (oversubscribed)' if world > cores else ''}, "
        f"1 thread/rank, batch {args.batch}/rank, n_embd {args.embd}, block 64"
    )
    load = os.getloadavg()[0]
    if rank == 0:
        print(
            f"bench_schedule: {setup}; torch {torch.__version__}; {args.steps} timed steps after "
            f"{args.warmup} warm-up, {args.profile_steps} profiled; load average {load:.1f} at start; "
            f"traces in {args.trace_dir}",
            flush=True,
        )
    start = time.perf_counter()
    results = []
    for layers in args.layers:
        config = gpt_config(layers, args)
        others, warmed = baselines(config, world), set()
        for cfg in [c for c in CONFIGS if args.configs is None or c.name in args.configs]:
            mine = run_config(cfg, config, args, rank, world, others if cfg.baselines else {}, warmed)
            everyone = [None] * world
            dist.all_gather_object(everyone, mine)
            if rank == 0:
                per_rank = ("wait_ms", "wait_ms_min", "transfer_ms", "profiled_step_ms")
                merged = dict(
                    everyone[0],
                    **{key: statistics.mean(r[key] for r in everyone) for key in per_rank},
                    **{f"{key}_per_rank": [r[key] for r in everyone] for key in per_rank},
                    counts_same_on_ranks=all(r["timeline_counts"] == mine["timeline_counts"] for r in everyone),
                )
                results.append(merged)
                step = merged["step_ms"].get("zero")
                print(
                    f"  L{layers} {cfg.name}: compile+first step {mine['compile_and_first_step_s']:.1f}s, "
                    f"step {'-' if step is None else f'{step:.0f}'} ms, wait {merged['wait_ms']:.0f} ms "
                    f"[{time.perf_counter() - start:.0f}s]",
                    flush=True,
                )
        del others
    if rank == 0:
        ratios = print_tables(results, setup) if args.configs is None else {}
        out = args.out or os.path.join(HERE, "results", f"schedule_{world}.json")
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as handle:
            json.dump(
                {
                    "setup": setup,
                    "world": world,
                    "cpu_cores": cores,
                    "torch": torch.__version__,
                    "load_average_start_end": [load, os.getloadavg()[0]],
                    "args": vars(args),
                    "ratios": ratios,
                    "results": results,
                },
                handle,
                indent=1,
            )
        print(
            f"wrote {out} ({time.perf_counter() - start:.0f}s, load average {os.getloadavg()[0]:.1f} at end)",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
