"""``zcompile.simulate`` against measurement on this machine (issue 19, Checks: "where measurement is possible").

    torchrun --nproc-per-node 2 benchmarks/bench_simulate_check.py      # results/simulate_check_2.json
    torchrun --nproc-per-node 4 benchmarks/bench_simulate_check.py      # results/simulate_check_4.json
    ... [--models gpt llama] [--stages 1 2 3] [--steps 7] [--profile PATH]

For the example GPT (``examples/gpt.py``) and a transformers Llama from a small ``LlamaConfig``, at
each stage: real training steps with ``backend="zero"`` and ``zcompile.optim.AdamW`` on the gloo
ranks, then

- **measured**: ``step_report().memory`` of rank 0 (model states measured on the rank's storages;
  the gathered peak, kept weights and saved activations read from the compiled graphs) and every
  rank's model states; the collectives of the compiled graphs and of the optimizer's step (count
  and bytes per where and kind); the median over ``--steps`` steps (after two warm-up steps) of
  the whole step (forward, backward, ``optimizer.step``, ``zero_grad``) on the slowest rank, timed
  from a barrier, and of each phase; and, for context, the allocator's peak during one step
  (``zcompile.timeline.record_step``) over the model states alive before it. The machine is shared:
  the cores other processes kept busy meanwhile are recorded per configuration (``/proc/stat`` less
  the ranks' own CPU time), and a configuration measured while they held more than ``--quiet``
  cores is measured again, up to ``--retries`` times, the quietest try kept;
- **simulated**: after training, rank 0 leaves the process group and starts a subprocess (no
  process group there: ``simulate`` makes its own fake one) that runs ``zcompile.simulate`` with
  ``hardware="cpu-local"`` (or ``--profile``) on the same model, one rank's batch, options and world
  size, and predicts the forward and backward graphs separately with the same costs; and its step
  peak (``result.step_peak_bytes``, a walk over the compiled graphs: ``zcompile.predict.step_peak``) against
  the allocator's.

Goals (the issue's): memory parts within 5%, collectives identical in count and bytes, step time
within 25%. ``main`` prints the table and writes the JSON; what disagrees, and why, is in the README
of the results (``benchmarks/README.md``) and in the report of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

from common import print_table  # noqa: E402

import zcompile  # noqa: E402
from zcompile.predict.compute_efficiency import measure_compute_efficiency  # noqa: E402
from zcompile.predict.hardware import load_profile  # noqa: E402
from zcompile.reports.timeline import record_step  # noqa: E402

BATCH_PER_RANK, SEQ, VOCAB = 4, 128, 2048
OPTIONS = {"bucket_mb": 0.5}  # several buckets on both models (about 1.1M parameters, 4.4 MB fp32)
MIB = 2**20
PARTS = (
    "model_states_bytes",
    "peak_gathered_bytes",
    "gather_staging_bytes",
    "kept_gathered_bytes",
    "saved_activation_bytes",
)


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt":
        from gpt import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=4, n_embd=128))
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(
            LlamaConfig(
                hidden_size=128,
                intermediate_size=352,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=VOCAB,
                max_position_embeddings=SEQ,
                use_cache=False,
            )
        )
    raise ValueError(name)


def rank_batch(name: str, step: int, rank: int):
    """One rank's batch: the GPT's ``(tokens, targets)``, the Llama's ``{"input_ids", "labels"}``."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (BATCH_PER_RANK, SEQ + 1), generator=generator)
    if name == "gpt":
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, :-1].contiguous()}


def loss_of(model, batch) -> torch.Tensor:
    return model(*batch) if isinstance(batch, tuple) else model(**batch).loss


def collective_table(rows) -> dict[str, dict[str, int]]:
    """``"where kind" -> {"count", "bytes"}`` from ``StepReport.collective_rows()``-like rows."""
    out: dict[str, dict[str, int]] = {}
    for where, kind, count, nbytes in rows:
        entry = out.setdefault(f"{where} {kind}", {"count": 0, "bytes": 0})
        entry["count"] += count
        entry["bytes"] += nbytes
    return dict(sorted(out.items()))


# ----------------------------------------------------------------------------- measured (under torchrun)
def measure(name: str, stage: int, steps: int, rank: int, world: int, profile: str) -> dict:
    torch._dynamo.reset()
    # the rates each rank has, time-shared where the ranks outnumber the cores (as simulate prices them)
    hardware = load_profile(profile).shared_by(world, world)
    raw_compute = replace(hardware, compute_efficiency=1.0).compute_costs(torch.float32)
    efficiencies = []
    model = build(name)
    optimizer = zcompile.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend="zero", options={"stage": stage, **OPTIONS})
    phases = []
    for step in range(steps + 2):
        batch = rank_batch(name, step, rank)
        dist.barrier()
        start = time.perf_counter()
        loss = loss_of(compiled, batch)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        end = time.perf_counter()
        times = torch.tensor([forward - start, backward - forward, end - backward, end - start], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        if step >= 2:  # the first compiles, the second makes the optimizer's state
            phases.append(times.tolist())
        if step in (1, steps + 1):  # the machine's compute efficiency just before and just after the timed steps
            efficiencies.append(
                measure_compute_efficiency(raw_compute, graph_call_overhead_s=hardware.graph_call_overhead_s)
            )
    report = zcompile.step_report(model, optimizer)
    states_before = zcompile.model_state_bytes(model, optimizer).total
    with tempfile.TemporaryDirectory() as trace_dir:

        def one_step():
            loss_of(compiled, rank_batch(name, steps + 2, rank)).backward()
            optimizer.step()

        peak = states_before + record_step(one_step, trace_dir, rank).peak_bytes
        optimizer.zero_grad()
    memory = {k: report.memory[k] for k in PARTS}
    every_rank = [None] * world
    dist.all_gather_object(every_rank, {"model_states_bytes": memory["model_states_bytes"], "step_peak_bytes": peak})
    return {
        "memory": memory,
        "per_rank_bytes": sum(memory.values()),
        "model_states_bytes_per_rank": [r["model_states_bytes"] for r in every_rank],
        "step_peak_bytes_per_rank": [r["step_peak_bytes"] for r in every_rank],
        "collectives": collective_table((w, k, c, b) for w, k, c, _, b in report.collective_rows()),
        "step_s": statistics.median(p[3] for p in phases),
        "forward_s": statistics.median(p[0] for p in phases),
        "backward_s": statistics.median(p[1] for p in phases),
        "optimizer_s": statistics.median(p[2] for p in phases),
        "step_s_min": min(p[3] for p in phases),
        "step_s_all": [p[3] for p in phases],
        "num_params": report.num_params,
        # zcompile.predict.compute_efficiency on the reference workload, around the timed steps: the machine's
        # state while they ran, which simulate's "alongside" prediction uses in place of the profile's
        "compute_efficiency_alongside": statistics.mean(efficiencies),
    }


# ----------------------------------------------------------------------------- simulated (no process group)
def simulated(name: str, stage: int, world: int, profile: str, compute_efficiency: float | None = None) -> dict:
    """``zcompile.simulate`` of one case, and its forward and backward graphs predicted apart;
    ``compute_efficiency``: in place of the profile's (the one measured alongside the steps)."""
    from zcompile.predict.cost_model import predict
    from zcompile.predict.simulate import simulate

    graphs = []
    hardware = load_profile(profile)
    if compute_efficiency is not None:
        hardware = replace(hardware, compute_efficiency=compute_efficiency)
    options = {"stage": stage, **OPTIONS, "on_compile": graphs.append}
    result = simulate(
        lambda: build(name),
        rank_batch(name, 0, 0),
        world_size=world,
        node_size=world,
        options=options,
        hardware=hardware,
    )
    hardware = hardware.shared_by(world, world)  # more ranks than cores: as simulate prices them
    costs, compute = hardware.collective_costs(world, world), hardware.compute_costs(torch.float32)
    split = {
        where: sum(predict(getattr(g, where), costs, compute).step_s for g in graphs)
        for where in ("forward", "backward")
    }
    data = result.to_dict()
    return {
        "memory": data["memory"],
        "per_rank_bytes": data["per_rank_bytes"],
        # the peak of a step from a walk over the compiled graphs (zcompile.predict.step_peak)
        "step_peak_bytes": result.step_peak_bytes,
        "collectives": {k: {"count": v["count"], "bytes": v["bytes"]} for k, v in data["collectives"].items()},
        "step_s": result.step_s,
        "forward_s": split["forward"],
        "backward_s": split["backward"],
        # the host's time per graph call and collective (the profile's) is in the step, not in a phase
        "optimizer_s": result.step_s - split["forward"] - split["backward"] - result.host_overhead_s,
        "host_overhead_s": result.host_overhead_s,
        "compute_s": result.compute_s,
        "exposed_comm_s": result.exposed_comm_s,
        "simulate_s": result.simulate_s,
        "num_params": result.num_params,
    }


def simulate_cases(cases: list[dict]) -> list[dict]:
    """Runs ``simulated`` for each case in a fresh Python (this file with ``--simulate``), no process group."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = os.path.join(tmp, "cases.json"), os.path.join(tmp, "out.json")
        with open(spec, "w") as f:
            json.dump(cases, f)
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
        }
        subprocess.run([sys.executable, os.path.abspath(__file__), "--simulate", spec, out], check=True, env=env)
        with open(out) as f:
            return json.load(f)


# ----------------------------------------------------------------------------- comparison
def compare(measured: dict, sim: dict) -> dict:
    memory = {k: _ratio(sim["memory"][k], measured["memory"][k]) for k in PARTS}
    memory["per_rank_bytes"] = _ratio(sim["per_rank_bytes"], measured["per_rank_bytes"])
    step_peak = {
        "parts_sum": _ratio(sim["per_rank_bytes"], measured["step_peak_bytes_per_rank"][0]),
        "graph_walk": _ratio(sim["step_peak_bytes"], measured["step_peak_bytes_per_rank"][0]),
    }
    kinds = sorted(set(measured["collectives"]) | set(sim["collectives"]))
    collectives = {
        k: {
            "measured": measured["collectives"].get(k),
            "simulated": sim["collectives"].get(k),
            "count_equal": (measured["collectives"].get(k) or {}).get("count")
            == (sim["collectives"].get(k) or {}).get("count"),
            "bytes_equal": (measured["collectives"].get(k) or {}).get("bytes")
            == (sim["collectives"].get(k) or {}).get("bytes"),
        }
        for k in kinds
    }
    times = {k: _ratio(sim[k], measured[k]) for k in ("step_s", "forward_s", "backward_s", "optimizer_s")}
    times["step_s_min"] = _ratio(sim["step_s"], min(measured["step_s_all"]))
    return {
        "memory_ratio": memory,
        "memory_within_5pct": all(abs(r - 1) <= 0.05 for r in memory.values() if r is not None),
        "step_peak_ratio": step_peak,  # simulated over the allocator's peak of a real step (rank 0)
        "collectives": collectives,
        "collectives_identical": all(c["count_equal"] and c["bytes_equal"] for c in collectives.values()),
        "collective_bytes_identical": all(c["bytes_equal"] for c in collectives.values()),
        "time_ratio": times,
        "step_within_25pct": abs(times["step_s"] - 1) <= 0.25,
    }


def _ratio(simulated_value: float, measured_value: float) -> float | None:
    if measured_value == 0:
        return 1.0 if simulated_value == 0 else None
    return simulated_value / measured_value


def machine_busy_s() -> float:
    """CPU seconds every process on the machine has used so far (``/proc/stat``: user, nice, system,
    irq, softirq, steal); 0 where there is no ``/proc``."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """Cores that other processes kept busy, on average, from its creation to ``cores()``: the
    machine's CPU seconds less the ranks' own (all their threads), over the wall time. Collective:
    every rank calls ``cores()``."""

    def __init__(self) -> None:
        self.start, self.busy, self.own = time.perf_counter(), machine_busy_s(), time.process_time()

    def cores(self) -> float:
        own = torch.tensor([time.process_time() - self.own], dtype=torch.float64)
        dist.all_reduce(own)
        cores = torch.tensor(
            [max(machine_busy_s() - self.busy - own.item(), 0.0) / (time.perf_counter() - self.start)],
            dtype=torch.float64,
        )
        dist.all_reduce(cores, op=dist.ReduceOp.MAX)  # one figure on every rank: decisions are taken on it
        return cores.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["gpt", "llama"])
    parser.add_argument("--stages", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--profile", default="cpu-local", help="hardware profile name or path for simulate")
    parser.add_argument(
        "--quiet",
        type=float,
        default=0.25,
        help="cores other processes may hold while a "
        "configuration is measured; above it, it is measured again (--retries), the quietest kept",
    )
    parser.add_argument("--retries", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--from-measured",
        metavar="JSON",
        help="no training: simulate again against the "
        "measurements in this earlier result (python, not torchrun), e.g. with another --profile",
    )
    parser.add_argument("--simulate", nargs=2, metavar=("CASES", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.simulate:  # the subprocess: no process group
        with open(args.simulate[0]) as f:
            cases = json.load(f)
        with open(args.simulate[1], "w") as f:
            json.dump(
                [
                    simulated(c["model"], c["stage"], c["world"], c["profile"], c.get("compute_efficiency"))
                    for c in cases
                ],
                f,
            )
        return

    os.environ.setdefault("COLUMNS", "200")
    if args.from_measured:
        with open(args.from_measured) as f:
            earlier = json.load(f)
        world, runs = earlier["world"], [{**r, "profile": args.profile} for r in earlier["runs"]]
        load_before, load_after, measure_s, others_cores = (
            earlier[k]
            for k in ("load_average_before", "load_average_after_measuring", "measure_s", "other_processes_cores")
        )
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        load_before = os.getloadavg()
        start, everything = time.perf_counter(), OtherLoad()
        runs = []
        for name in args.models:
            for stage in args.stages:
                tries = []
                for _ in range(1 + args.retries):  # again while other processes held more than --quiet cores
                    load = OtherLoad()
                    tries.append(measure(name, stage, args.steps, rank, world, args.profile))
                    tries[-1]["other_processes_cores"] = load.cores()
                    if tries[-1]["other_processes_cores"] <= args.quiet:
                        break
                measured = min(tries, key=lambda m: m["other_processes_cores"])
                measured["tries"] = len(tries)
                runs.append(
                    {"model": name, "stage": stage, "world": world, "profile": args.profile, "measured": measured}
                )
                if rank == 0:
                    print(
                        f"measured {name} stage {stage}: step {measured['step_s'] * 1e3:.1f} ms, "
                        f"{measured['per_rank_bytes'] / MIB:.2f} MiB, other processes "
                        f"{measured['other_processes_cores']:.2f} cores",
                        flush=True,
                    )
        measure_s, load_after = time.perf_counter() - start, os.getloadavg()
        others_cores = everything.cores()
        dist.destroy_process_group()
        if rank != 0:
            return
    cases = [{k: r[k] for k in ("model", "stage", "world", "profile")} for r in runs]
    alongside = [i for i, r in enumerate(runs) if "compute_efficiency_alongside" in r["measured"]]
    sims = simulate_cases(
        cases
        + [{**cases[i], "compute_efficiency": runs[i]["measured"]["compute_efficiency_alongside"]} for i in alongside]
    )
    sims_alongside = dict(zip(alongside, sims[len(runs) :]))
    rows = []
    for index, (run, sim) in enumerate(zip(runs, sims)):
        run["simulated"] = sim
        run["check"] = check = compare(run["measured"], sim)
        m = run["measured"]
        if index in sims_alongside:  # the same profile with the compute efficiency measured around the steps
            run["simulated_alongside"] = sims_alongside[index]
            check["time_ratio_alongside"] = _ratio(sims_alongside[index]["step_s"], m["step_s"])
            check["step_within_25pct_alongside"] = abs(check["time_ratio_alongside"] - 1) <= 0.25
        alongside_text = (
            f"{check['time_ratio_alongside']:.2f} (eff. {m['compute_efficiency_alongside']:.2f})"
            if index in sims_alongside
            else "-"
        )
        rows.append(
            (
                f"{run['model']} stage {run['stage']}",
                " + ".join(f"{m['memory'][k] / MIB:.2f}" for k in PARTS),
                " + ".join(f"{sim['memory'][k] / MIB:.2f}" for k in PARTS),
                f"{check['memory_ratio']['per_rank_bytes']:.3f}",
                f"{m['step_peak_bytes_per_rank'][0] / MIB:.2f} / {sim['step_peak_bytes'] / MIB:.2f}",
                "same"
                if check["collectives_identical"]
                else ("bytes same" if check["collective_bytes_identical"] else "DIFFER"),
                f"{m['step_s'] * 1e3:.0f} ({m['forward_s'] * 1e3:.0f}/{m['backward_s'] * 1e3:.0f}/"
                f"{m['optimizer_s'] * 1e3:.0f})",
                f"{sim['step_s'] * 1e3:.0f} ({sim['forward_s'] * 1e3:.0f}/{sim['backward_s'] * 1e3:.0f}/"
                f"{sim['optimizer_s'] * 1e3:.0f})",
                f"{check['time_ratio']['step_s']:.2f} ({check['time_ratio']['step_s_min']:.2f})",
                alongside_text,
                f"{m.get('other_processes_cores', float('nan')):.2f}",
            )
        )
    print_table(
        f"measured vs simulated ({args.profile}), {world} gloo ranks, MiB per rank "
        "(states + gathered + kept + activations), ms (forward/backward/optimizer)",
        [
            "run",
            "measured parts",
            "simulated parts",
            "sim/meas",
            "step peak: measured / walk",
            "collectives",
            "measured step",
            "simulated step",
            "sim/meas (vs fastest step)",
            "sim/meas, efficiency measured alongside",
            "others' cores",
        ],
        rows,
    )
    for run in runs:
        for key, c in run["check"]["collectives"].items():
            if not (c["count_equal"] and c["bytes_equal"]):
                print(
                    f"  {run['model']} stage {run['stage']} {key}: measured {c['measured']}, simulated {c['simulated']}"
                )
    result = {
        "world": world,
        "profile": args.profile,
        "batch_per_rank": BATCH_PER_RANK,
        "seq": SEQ,
        "options": OPTIONS,
        "steps": earlier["steps"] if args.from_measured else args.steps,
        "cpu_cores": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after_measuring": load_after,
        "measure_s": measure_s,
        "other_processes_cores": others_cores,
        "runs": runs,
    }
    out = args.out or os.path.join(HERE, "results", f"simulate_check_{world}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(
        "wrote",
        out,
        f"(load average {load_before[0]:.2f} before, {load_after[0]:.2f} after measuring; other "
        f"processes used {others_cores:.2f} of {os.cpu_count()} cores while measuring)",
    )


if __name__ == "__main__":
    main()
