"""Fits the ``cpu-local`` hardware profile on this machine (``zcompile/hardware_profiles/cpu-local.json``).

    torchrun --nproc-per-node 2 benchmarks/measure_cpu_profile.py [--out PATH] [--fits 3] [--repeats 15]

The cost model's own measurements (``cost_model.measure_compute_costs`` in fp32 and bf16,
``measure_collective_costs`` on the gloo group) turned into the profile's form: a link's bus
bandwidth from the all-gather's fitted seconds per byte (``bus = (N - 1) / N / seconds_per_byte``,
nccl-tests' rule, which ``zcompile.hardware`` inverts) and its latency per ``log2 N`` step. One
machine is one node: both links are the same.

The all-gather is timed at 4 KiB to 4 MiB in steps of 4x (``SIZES``), ``--repeats`` rounds: with
the cost model's default four sizes and five rounds the least-squares line hangs on the 4 MiB
point, and one slow round there moved the fitted latency from 0.4 to 3.4 ms on this machine.
Two fits a minute apart on the quiet machine still differed 2.5x in matmul FLOP/s (39-102 GFLOP/s)
and 3x in latency. The profile keeps each figure's median over ``--fits`` fits (``TYPICAL``): it
predicts training steps, which meet the machine as it usually is, with the other rank's compute
and gloo's threads on the same two vCPUs. It kept the best fit's figures before (load only slows
a micro-benchmark down, so the fastest fit was taken as the machine's own); predicted steps then
came out 0.59-0.69x of the quietly measured ones at 2 ranks, the in-step matmuls running at 0.8x the best
fit's rate and every collective slower than the best fit. Every fit is kept in the file under
``measured``. A first, discarded round of the compute micro-benchmarks warms the
allocator: the 4 MiB clone that measures memory bandwidth ran at 2.5-4.8 GB/s in a fresh process
(every output freshly mapped, page faults) and at 49-68 GB/s once glibc's allocator had adapted,
which is the state of a training step after its first steps and of ``zcompile.tune``'s own
measurement; without it the figure depended on which fit came first. The reduce-scatter is timed
too, as the graphs run it on gloo (``passes/reduce_scatter_lowering.py``: an all-to-all; gloo's own
reduce-scatter was an all-reduce, a ``bus_factor`` of about 2): the link's ``bus_factor`` for it is
the all-gather's bus bandwidth over its own and its ``latency_factor`` its latency over the
all-gather's (0.8-0.9 and about 0.5: gloo's all-to-all outruns its all-gather here). The compute figures are measured on every rank at once, as training
runs them; the overlap slowdown is the contention factor that reproduces an all-gather's overlap
with compute (``cost_model._overlap_slowdown``). Then the host's time per compiled graph call,
and per parameter, which no op's price holds (``graph_call_overhead_s``, ``parameter_overhead_s``:
guards, wrappers, the autograd engine, per-parameter arguments, the optimizer's Python):
``zcompile.predict.compute_efficiency``'s reference model at a tiny size (``OVERHEAD_SHAPE``: its compute
negligible) with 1 and 4 layers, trained with ``backend="zero"`` at stages 1-3, each step's
measured time less ``simulate``'s prediction, fitted by least squares on graph calls and parameters. Last, with those
figures, ``compute_efficiency``: the fraction of the compute figures a compiled step reaches
(``zcompile.predict.compute_efficiency``: two of torch's ``TransformerEncoderLayer`` compiled at stage 1,
forward and backward on every rank at once, against their predicted time; the median of ``--fits``
measurements). ``--out``: write there instead of the shipped profile.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import start_gloo_benchmark  # noqa: E402

from zcompile.predict.compute_efficiency import measure_compute_efficiency, reference_loss, reference_model  # noqa: E402
from zcompile.predict.cost_model import measure_collective_costs, measure_compute_costs  # noqa: E402
from zcompile.predict.hardware import PROFILE_DIR, load_profile, profile_from_dict  # noqa: E402

SIZES = tuple(2**k for k in range(12, 25, 2))  # bytes: 4 KiB to 16 MiB
# the figure kept from several fits: the median (module docstring); a link's bandwidth and latency are
# one fitted line, kept together from the fit whose time to move ``LINK_PROBE_BYTES`` is the median
TYPICAL = {
    key: statistics.median
    for key in (
        "fp32",
        "bf16",
        "memory_bytes_per_s",
        "op_overhead_s",
        "attention_efficiency",
        "transcendental_bytes_per_s",
        "overlap_slowdown",
    )
}
LINK_PROBE_BYTES = 2**20
# the host overheads' fit: the reference model at a tiny size, where its compute is negligible and a
# step is what no op's price holds, with 1 and 4 layers (12 and 48 parameters, 2 graph calls), stages
# 1-3 (one bucket: the backend's default)
OVERHEAD_SHAPE, OVERHEAD_LAYERS, OVERHEAD_STAGES, OVERHEAD_STEPS = (1, 8, 8), (1, 4), (1, 2, 3), 41


def median_fit(fits: list[dict], seconds: Callable[[dict], float]) -> dict:
    """The fit whose ``seconds(fit)`` is the median (the lower middle one of an even number)."""
    ordered = sorted(fits, key=seconds)
    return ordered[(len(ordered) - 1) // 2]


def typical_link(fits: list[dict], prefix: str, world: int) -> dict:
    """The (bus bandwidth, latency) pair of the fit that moves ``LINK_PROBE_BYTES`` in the median time."""
    typical = median_fit(
        fits,
        lambda f: (
            f[f"{prefix}latency_s"] * math.ceil(math.log2(world))
            + LINK_PROBE_BYTES * (world - 1) / world / f[f"{prefix}bus_bytes_per_s"]
        ),
    )
    return {"bus_bytes_per_s": typical[f"{prefix}bus_bytes_per_s"], "latency_s": typical[f"{prefix}latency_s"]}


def as_link(cost, world: int) -> dict:
    """A fitted ``CollectiveCost`` in the profile's link form (bus bandwidth, latency per log2 N step)."""
    return {
        "bus_bytes_per_s": (world - 1) / world / cost.seconds_per_byte,
        "latency_s": cost.latency_s / math.ceil(math.log2(world)),
    }


def fit_once(world: int, repeats: int, compute_repeats: int) -> dict:
    """One fit of every figure the profile holds (and the reduce-scatter, for the record), agreed across ranks.

    The compute micro-benchmarks start together on every rank (a barrier): training runs every rank
    of the host at once, and on this 2-vCPU VM a rank's matmuls ran at 45-63 GFLOP/s while the other
    rank computed against 88 alone."""
    dist.barrier()
    fp32 = measure_compute_costs(dtype=torch.float32, repeats=compute_repeats)
    dist.barrier()
    bf16 = measure_compute_costs(dtype=torch.bfloat16, repeats=compute_repeats)
    costs = measure_collective_costs(kinds=("all_gather", "reduce_scatter"), sizes=SIZES, repeats=repeats)
    gather, scatter = as_link(costs.cost("all_gather"), world), as_link(costs.cost("reduce_scatter"), world)
    issue = costs.cost("all_gather")
    return {
        "fp32": fp32.flops_per_s,
        "bf16": bf16.flops_per_s,
        "memory_bytes_per_s": fp32.bytes_per_s,
        "op_overhead_s": fp32.op_overhead_s,
        "attention_efficiency": fp32.attention_flops_per_s / fp32.flops_per_s,
        "transcendental_bytes_per_s": fp32.transcendental_bytes_per_s,
        "bus_bytes_per_s": gather["bus_bytes_per_s"],
        "latency_s": gather["latency_s"],
        "issue_latency_s": issue.issue_latency_s,
        "issue_bytes_per_s": 1.0 / issue.issue_seconds_per_byte if issue.issue_seconds_per_byte > 0 else 0.0,
        "reduce_scatter_bus_bytes_per_s": scatter["bus_bytes_per_s"],
        "reduce_scatter_latency_s": scatter["latency_s"],
        "overlap_slowdown": costs.overlap_slowdown,
    }


def measure_overhead_steps() -> list[dict]:
    """Median step (forward, backward, ``optimizer.step``, ``zero_grad``; slowest rank) of the tiny
    reference model (``OVERHEAD_SHAPE``) per layer count and stage, ``OVERHEAD_STEPS`` steps after three
    warm-up ones. Every rank calls it."""
    import zcompile

    rows = []
    for layers, stage in ((layers, stage) for layers in OVERHEAD_LAYERS for stage in OVERHEAD_STAGES):
        torch._dynamo.reset()
        model = reference_model(OVERHEAD_SHAPE, layers)
        optimizer = zcompile.optim.AdamW(model.parameters(), lr=1e-3)
        compiled = torch.compile(model, backend="zero", options={"stage": stage})
        inputs = torch.randn(OVERHEAD_SHAPE)
        times = []
        for step in range(OVERHEAD_STEPS + 3):
            dist.barrier()
            start = time.perf_counter()
            reference_loss(compiled(inputs)).backward()
            optimizer.step()
            optimizer.zero_grad()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step >= 3:
                times.append(elapsed.item())
        rows.append(
            {
                "shape": list(OVERHEAD_SHAPE),
                "layers": layers,
                "stage": stage,
                "parameters": sum(1 for _ in model.parameters()),
                "measured_s": statistics.median(times),
            }
        )
    torch._dynamo.reset()
    return rows


def simulate_overhead_runs(rows: list[dict], profile: dict, world: int) -> None:
    """Adds ``simulate``'s step and graph calls to each row, in a fresh Python (no process group there:
    ``simulate`` makes its own fake one)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec, "w") as f:
            json.dump({"rows": rows, "profile": profile, "world": world}, f)
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
        }
        subprocess.run([sys.executable, os.path.abspath(__file__), "--simulate-runs", spec, out], check=True, env=env)
        with open(out) as f:
            rows[:] = json.load(f)


def _simulate_rows(spec_path: str, out_path: str) -> None:
    from zcompile.predict.simulate import simulate

    with open(spec_path) as f:
        spec = json.load(f)
    profile = profile_from_dict(spec["profile"])
    for row in spec["rows"]:
        result = simulate(
            lambda: reference_model(tuple(row["shape"]), row["layers"]),
            torch.randn(row["shape"]),
            world_size=spec["world"],
            node_size=spec["world"],
            options={"stage": row["stage"]},
            hardware=profile,
            loss_fn=reference_loss,
        )
        row.update(simulated_s=result.step_s, graph_calls=result.graph_calls)  # the profile has no overheads yet
    with open(out_path, "w") as f:
        json.dump(spec["rows"], f)


HOST_OVERHEAD_FEATURES = ("graph_calls", "parameters")


def fit_host_overheads(rows: list[dict]) -> tuple[float, float]:
    """(per graph call, per parameter) seconds: least squares of ``measured - simulated`` over the rows
    on their graph calls and parameters, no intercept, each at least 0 (a negative one is 0 and the
    other refitted alone)."""
    residual = torch.tensor([r["measured_s"] - r["simulated_s"] for r in rows], dtype=torch.float64)
    features = torch.tensor([[float(r[k]) for k in HOST_OVERHEAD_FEATURES] for r in rows], dtype=torch.float64)
    solution = torch.linalg.lstsq(features, residual.unsqueeze(1)).solution.squeeze(1).tolist()
    if min(solution) >= 0:
        return solution[0], solution[1]
    alone = [max(float(features[:, i] @ residual / (features[:, i] @ features[:, i])), 0.0) for i in range(2)]
    return (alone[0], 0.0) if solution[0] >= solution[1] else (0.0, alone[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(PROFILE_DIR / "cpu-local.json"))
    parser.add_argument("--repeats", type=int, default=15, help="rounds over the collective sizes per fit")
    parser.add_argument("--compute-repeats", type=int, default=5, help="runs of each compute micro-benchmark per fit")
    parser.add_argument("--fits", type=int, default=3, help="independent fits; the profile keeps the median (TYPICAL)")
    parser.add_argument("--simulate-runs", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.simulate_runs:  # the subprocess of simulate_overhead_runs
        _simulate_rows(*args.simulate_runs)
        return
    rank, world, cores = start_gloo_benchmark()
    measure_compute_costs(dtype=torch.float32, repeats=args.compute_repeats)  # warm-up: see the module doc
    fits = [fit_once(world, args.repeats, args.compute_repeats) for _ in range(args.fits)]
    fit = {key: typical(f[key] for f in fits) for key, typical in TYPICAL.items()}
    link = typical_link(fits, "", world)
    issue = median_fit(
        fits,
        lambda f: (
            f["issue_latency_s"] + (LINK_PROBE_BYTES / f["issue_bytes_per_s"] if f["issue_bytes_per_s"] > 0 else 0.0)
        ),
    )
    link["issue_latency_s"] = issue["issue_latency_s"]
    if issue["issue_bytes_per_s"] > 0:
        link["issue_bytes_per_s"] = issue["issue_bytes_per_s"]
    scatter = typical_link(fits, "reduce_scatter_", world)
    # the reduce-scatter as the graphs run it on gloo (an all-to-all and a sum; gloo's own was an all-reduce,
    # 2-2.5x): its bytes per byte moved and its latency, over the all-gather's; below 1 where it is the faster
    link["bus_factor"] = {"reduce_scatter": link["bus_bytes_per_s"] / scatter["bus_bytes_per_s"]}
    if link["latency_s"] > 0:
        link["latency_factor"] = {"reduce_scatter": scatter["latency_s"] / link["latency_s"]}
    profile = {
        "name": "cpu-local",
        "description": f"this development machine: {cores} CPU cores, {world} gloo ranks on one host",
        "sources": {
            "peak_flops_per_s": "zcompile.predict.cost_model.measure_compute_costs: 512x512 matmul, fp32 and bf16, "
            "every rank at once",
            "memory_bytes_per_s": "measure_compute_costs: clone of 4 MiB",
            "memory_bytes": "24 GiB, the machine's memory (shared by the ranks)",
            "op_overhead_s": "measure_compute_costs: aten.add of one element, per call",
            "attention_efficiency": "measure_compute_costs: causal scaled_dot_product_attention (4, 4, 128, 32) "
            "FLOP/s over the matmul's, fp32",
            "transcendental_bytes_per_s": "measure_compute_costs: median of GELU, exp, softmax, layer norm of 4 MiB",
            "links": f"measure_collective_costs: gloo all-gather, {world} ranks, 4 KiB-16 MiB, {args.repeats} rounds, "
            "bus bandwidth by nccl-tests' rule; issue: the time until the call returns, same fit; "
            "bus_factor and latency_factor: the reduce-scatter's bus bandwidth and latency so measured, "
            "over the all-gather's",
            "overlap_slowdown": "measure_collective_costs: an all-gather of 4 MiB with a matmul loop of its length, "
            "against each alone (cost_model._overlap_slowdown)",
            "fits": f"each figure the median of {args.fits} fits (benchmarks/measure_cpu_profile.py, TYPICAL); "
            "'measured' holds every fit and the reduce-scatter's own fit",
            "compute_efficiency": "zcompile.predict.compute_efficiency.measure_compute_efficiency: two of torch's "
            "TransformerEncoderLayer (d_model 96, sequence 128, batch 4) compiled with "
            "backend='zero' at stage 1, forward and backward on every rank at once, predicted "
            "over measured time less the graph calls' overhead, median of the fits",
            "graph_call_overhead_s": "benchmarks/measure_cpu_profile.py: the compute-efficiency reference model "
            "at (1, 8, 8), 1 and 4 layers, trained with backend='zero' and "
            "zcompile.optim.AdamW, stages 1-3: measured step less simulate's, least squares "
            "on graph calls and parameters ('measured.host_overhead')",
            "parameter_overhead_s": "the same fit",
            "load": f"load average {os.getloadavg()[0]:.2f} when the fit ended",
            "host_cores": "os.cpu_count() of the host; left 0 when the fit ran more ranks "
            "than cores (its figures then already hold the ranks' time-sharing)",
        },
        "device_type": "cpu",
        "peak_flops_per_s": {"fp32": fit["fp32"], "bf16": fit["bf16"]},
        "memory_bytes_per_s": fit["memory_bytes_per_s"],
        "memory_bytes": 24 * 2**30,
        "op_overhead_s": fit["op_overhead_s"],
        "attention_efficiency": min(fit["attention_efficiency"], 1.0),
        "transcendental_bytes_per_s": fit["transcendental_bytes_per_s"],
        "overlap_slowdown": fit["overlap_slowdown"],
        "node_size": world,
        # the figures are each rank's with a core of its own or more: simulate scales a world with more
        # ranks on the host than cores by their ratio (HardwareProfile.time_sharing)
        "host_cores": cores if world <= cores else 0,
        "links": {"intra_node": link, "inter_node": link},
        "measured": {"reduce_scatter": scatter, "fits": fits},
    }
    runs = measure_overhead_steps()  # first: its fit needs the compute figures, not the efficiency
    overheads = torch.zeros(2, dtype=torch.float64)
    if rank == 0:
        simulate_overhead_runs(runs, profile, world)
        overheads[:] = torch.tensor(fit_host_overheads(runs), dtype=torch.float64)
    dist.broadcast(overheads, src=0)
    profile["graph_call_overhead_s"], profile["parameter_overhead_s"] = overheads.tolist()
    profile["measured"]["host_overhead"] = runs
    compute = profile_from_dict(profile).compute_costs(torch.float32)
    # one discarded measurement first: the fits' first two after the overhead runs came out 0.53-0.56
    # where the next three gave 0.88-0.98 (the reference model's first compile and first allocations)
    efficiencies = []
    for _ in range(args.fits + 1):
        # each measurement compiles the reference model again: reset Dynamo, or past its recompile
        # limit (8) the calls would run eagerly and the figure would be eager PyTorch's
        torch._dynamo.reset()
        efficiencies.append(measure_compute_efficiency(compute, graph_call_overhead_s=profile["graph_call_overhead_s"]))
    efficiencies = efficiencies[1:]
    profile["compute_efficiency"] = statistics.median(efficiencies)
    profile["measured"]["compute_efficiency"] = efficiencies
    if rank == 0:
        path = Path(args.out)
        keep_store_figures(profile, PROFILE_DIR / "cpu-local.json")
        path.write_text(json.dumps(profile, indent=2) + "\n")
        load_profile(path)  # validates what was written
        print(json.dumps({k: v for k, v in profile.items() if k != "measured"}, indent=2))
        for f in fits:
            print(" ".join(f"{k} {v:.3g}" for k, v in f.items()))
    dist.destroy_process_group()


def keep_store_figures(profile: dict, shipped: Path) -> None:
    """The store's rate and latency are measured apart (``bench_store_throughput.py``, by hand): the
    shipped profile's figures and their sources carried into the new fit."""
    if shipped.exists():
        old = json.loads(shipped.read_text())
        for key in ("store_requests_per_s", "store_latency_s"):
            if key in old:
                profile[key] = old[key]
                profile["sources"][key] = old["sources"][key]


if __name__ == "__main__":
    main()
