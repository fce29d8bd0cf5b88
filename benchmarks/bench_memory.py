"""Per-rank memory against ZeRO's formulas: model states after a step, and the peak during one.

    torchrun --nproc-per-node 2 benchmarks/bench_memory.py     # writes results/memory_2.json
    torchrun --nproc-per-node 4 benchmarks/bench_memory.py     # results/memory_4.json
    ... bench_memory.py --optim-bucket-mb 4                    # only the optimizer's default buckets

Model: a transformers GPT-2 (n_layer 4, n_embd 192, the issue's model), AdamW, stages 1-3, in fp32
and in bf16 mixed precision (``param_dtype="bf16"``), the backend's ``bucket_mb`` 0.5, each with
every optimizer ``bucket_mb`` of ``--optim-bucket-mb`` (default 4, the optimizer's default, and 0.5,
the backend's here: the stage 1/2 optimizer holds a few of its buckets at once, 4 MiB each against a
9.8 MiB model). For each:

- **live**: ``zcompile.model_state_bytes`` after ``optimizer.step()``, before ``zero_grad`` (every live
  storage of parameters, replicas, shards, gradients and moments counted once), against
  ``zcompile.zero_formula_bytes`` (fp32: 4+4+8 bytes per element; bf16: ZeRO's 2+2+12 accounting);
- **peak**: the model states alive before the step plus the most the step allocated on top of them
  (``zcompile.timeline.record_step``'s allocator series), against model states + the schedule's
  gathered peak + gloo's copies of the gathers in flight + saved activations + the stage-1/2
  optimizer's bucket buffers (``step_report().memory``) + 10%, each part reported (``peak_vs_parts_without_staging``: the ratio without gloo's part, which
  NCCL does not have: gloo gathers into a flat buffer of its own, then copies out);
- **fwd+bwd**: forward and backward recorded as one from the model states, against the walk over
  the compiled graphs (``zcompile.predict.step_peak``, with gloo's second buffer of each all-gather in flight);
- **estimate**: ``zcompile.estimate_memory`` made before the model was compiled, against the
  measurement (model states exactly; the compiled parts from the compiled graphs);
- **opt ms**: ``optimizer.step()`` alone, unprofiled, the median over ``TIMED_STEPS`` steps of the
  slowest rank (each timed from a barrier), to see that memory was not bought with step time.

Each row also checks that the run trained: the first two losses of the zero run equal a
single-process run's to 1e-6 (fp32) or 1e-2 relative (bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import print_table, start_gloo_benchmark  # noqa: E402

import zcompile  # noqa: E402
from zcompile.predict.step_peak import step_peak  # noqa: E402
from zcompile.reports.timeline import record_step  # noqa: E402

SEQ, BATCH_PER_RANK, VOCAB = 64, 2, 4096
MIB = 2**20
TIMED_STEPS = 9


def build_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=4,
        n_embd=192,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=SEQ,
        attn_pdrop=0.0,
        embd_pdrop=0.0,
        resid_pdrop=0.0,
        use_cache=False,
    )
    return GPT2LMHeadModel(config)


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH_PER_RANK * world, SEQ), generator=generator)
    return tokens[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]


def loss_of(model, tokens) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss


def optimizer_step_ms(compiled, optimizer, rank: int, world: int, first_batch: int) -> float:
    """The median over ``TIMED_STEPS`` of ``optimizer.step()`` on the slowest rank, in ms."""
    times = []
    for step in range(TIMED_STEPS):
        loss_of(compiled, batch(first_batch + step, rank, world)).backward()
        dist.barrier()  # one rank's lead is not time inside the step
        start = time.perf_counter()
        optimizer.step()
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item() * 1e3)
        optimizer.zero_grad()
    return statistics.median(times)


def run(stage: int, param_dtype: str | None, rank: int, world: int, optim_bucket_mb: float) -> dict:
    torch._dynamo.reset()
    options = {"stage": stage, "param_dtype": param_dtype, "bucket_mb": 0.5}
    model = build_gpt2()
    estimate = zcompile.estimate_memory(
        model, world, options, batch={"input_ids": batch(0, rank, world), "labels": batch(0, rank, world)}
    )
    optimizer = zcompile.optim.AdamW(model.parameters(), lr=1e-3, bucket_mb=optim_bucket_mb)
    graphs = []  # the compiled graphs, for the walk (zcompile.predict.step_peak)
    compiled = torch.compile(model, backend="zero", options={**options, "on_compile": graphs.append})
    losses = []
    for step in range(2):
        loss = loss_of(compiled, batch(step, rank, world))
        loss.backward()
        optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)
        if step == 0:
            live = zcompile.model_state_bytes(model, optimizer)
        optimizer.zero_grad()
    before_step = zcompile.model_state_bytes(model, optimizer).total
    phases, held, rises = {}, {}, {}
    with tempfile.TemporaryDirectory() as trace_dir:

        def step():
            loss_of(compiled, batch(2, rank, world)).backward()
            optimizer.step()

        timeline = record_step(step, trace_dir, rank)
        optimizer.zero_grad()
        # the same step again, one phase at a time: where the peak is (each phase from what is live
        # when it starts: forward from the states, backward from states + what forward left)
        for phase, run_phase in (
            ("forward", lambda: held.__setitem__("loss", loss_of(compiled, batch(3, rank, world)))),
            ("backward", lambda: held.pop("loss").backward()),
            ("optimizer", optimizer.step),
        ):
            start = zcompile.model_state_bytes(model, optimizer).total + (held.get("forward_left", 0))
            rises[phase] = record_step(run_phase, trace_dir, rank).peak_bytes
            phases[phase] = start + rises[phase]
            if phase == "forward":
                held["forward_left"] = phases[phase] - start  # activations and outputs alive after forward, at most
            else:
                held.pop("forward_left", None)
        # forward and backward as one, from the states: what the graph walk predicts
        optimizer.zero_grad()
        start = zcompile.model_state_bytes(model, optimizer).total
        forward_backward = (
            start + record_step(lambda: loss_of(compiled, batch(4, rank, world)).backward(), trace_dir, rank).peak_bytes
        )
    optimizer.zero_grad()
    walk = step_peak(graphs, live.params, live.grads, live.optimizer, gather_staging=world > 1)  # gloo's copies
    report = zcompile.step_report(model, optimizer).memory
    step_ms = optimizer_step_ms(compiled, optimizer, rank, world, first_batch=5)  # last: it trains on
    num_params = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    formula = zcompile.zero_formula_bytes(
        num_params, world, stage, zcompile.ZeroConfig(param_dtype=param_dtype).param_dtype
    )
    peak = before_step + timeline.peak_bytes
    # the parts: the states, the schedule's gathered peak with gloo's copies of the gathers in flight
    # (its own part of step_report; NCCL has none), the saved activations, the optimizer's bucket buffers
    parts = {
        k: report[k]
        for k in (
            "model_states_bytes",
            "peak_gathered_bytes",
            "gather_staging_bytes",
            "saved_activation_bytes",
            "optimizer_buffers_bytes",
        )
    }
    bound = sum(parts.values())
    bound_without_staging = bound - parts["gather_staging_bytes"]
    return {
        "stage": stage,
        "dtype": param_dtype or "fp32",
        "optim_bucket_mb": optim_bucket_mb,
        "num_params": num_params,
        "losses": losses,
        "live_bytes": live.total,
        "live_parts": {"params": live.params, "grads": live.grads, "optimizer": live.optimizer},
        "formula_bytes": formula,
        "live_vs_formula": live.total / formula,
        "peak_bytes": peak,
        "parts": parts,
        "peak_vs_parts": peak / bound,
        "peak_vs_parts_without_staging": peak / bound_without_staging,
        # before the optimizer's buffers were a part of their own (2026-11-27)
        "peak_vs_parts_without_optimizer_buffers": peak / (bound - parts["optimizer_buffers_bytes"]),
        # what optimizer.step() allocated above what was live when it started (the allocator's), against
        # the optimizer's ledger of its bucket buffers (parts["optimizer_buffers_bytes"])
        "optimizer_phase_rise_bytes": rises.get("optimizer", 0),
        "phase_peaks": phases,
        "forward_backward_peak_bytes": forward_backward,
        "walk_forward_backward_bytes": max(v for phase, v in walk.phases.items() if phase != "optimizer"),
        "estimate": estimate.to_dict(),
        "estimate_model_states_vs_live": estimate.model_states_bytes / live.total,
        "optimizer_step_ms": step_ms,
        "estimate_vs_measured": {
            "gathered_peak": estimate.gathered_peak_bytes / max(1, report["peak_gathered_bytes"]),
            "saved_activations": estimate.saved_activation_bytes / max(1, report["saved_activation_bytes"]),
        },
    }


def reference_losses(param_dtype: str | None, world: int) -> list[float]:
    """One process on the global batch, torch's AdamW; bf16 through autocast like the zero graphs."""
    model = build_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(2):
        tokens = torch.cat([batch(step, r, world) for r in range(world)])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=param_dtype is not None):
            loss = loss_of(model, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--optim-bucket-mb",
        type=float,
        nargs="+",
        default=[4.0, 0.5],
        help="the optimizer's bucket_mb, one run per value (stage 3's optimizer has no buckets: "
        "run once, with the first)",
    )
    args = parser.parse_args()
    rank, world, _ = start_gloo_benchmark()
    rows, results = [], []
    for param_dtype in (None, "bf16"):
        reference = reference_losses(param_dtype, world)
        for stage, optim_bucket_mb in [
            (s, b) for s in (1, 2, 3) for b in args.optim_bucket_mb[: 1 if s == 3 else None]
        ]:
            result = run(stage, param_dtype, rank, world, optim_bucket_mb)
            result["reference_losses"] = reference
            results.append(result)
            label = f"stage {stage} {result['dtype']}" + (f" opt {optim_bucket_mb:g}" if stage < 3 else "")
            rows.append(
                (
                    label,
                    f"{result['live_bytes'] / MIB:.2f}",
                    f"{result['formula_bytes'] / MIB:.2f}",
                    f"{result['live_vs_formula']:.3f}",
                    f"{result['peak_bytes'] / MIB:.2f}",
                    " + ".join(f"{v / MIB:.2f}" for v in result["parts"].values()),
                    f"{result['peak_vs_parts']:.2f}",
                    " / ".join(f"{v / MIB:.1f}" for v in result["phase_peaks"].values()),
                    f"{result['forward_backward_peak_bytes'] / MIB:.2f} / "
                    f"{result['walk_forward_backward_bytes'] / MIB:.2f}",
                    f"{result['optimizer_step_ms']:.1f}",
                    f"{result['estimate_model_states_vs_live']:.3f}",
                    " / ".join(f"{v:.2f}" for v in result["estimate_vs_measured"].values()),
                    " ".join(f"{a:.4f}/{b:.4f}" for a, b in zip(result["losses"], reference)),
                )
            )
    if rank == 0:
        print_table(
            f"GPT-2 (4 layers, n_embd 192), {world} ranks, AdamW: MiB per rank",
            [
                "run",
                "live",
                "ZeRO formula",
                "ratio",
                "step peak",
                "states + gathered + gloo staging + activations + optimizer buffers",
                "peak/parts",
                "fwd / bwd / opt peak",
                "fwd+bwd: peak / walk",
                "opt ms",
                "estimate/live",
                "estimate/measured gathered / activations",
                "losses zero/reference",
            ],
            rows,
        )
        out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"memory_{world}.json")
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
        print("wrote", out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
