"""zcompile.tune: the model strategy's pick against the grid's best, against the default options,
how well the cost model ranks the points, and the tuning wall time.

    torchrun --nproc-per-node 2 benchmarks/bench_tune.py --models gpt [--steps 15]
        [--out benchmarks/results/tune_gpt_2.json] [--plot benchmarks/results/tune_gpt_2.png]

For each model (the example GPT, 8 layers; a transformers Llama from a config) one run does
``tune(strategy="grid")`` then ``tune(strategy="model")`` on the same space (``SPACE``: bucket size x
prefetch depth, 12 points, the default among them), each from its own cost measurement,
predictions and trials. Reported per model (rank 0 prints a table and writes the JSON, with both
full results):

- the model strategy's pick and how many trials it measured, its step time against the grid's best
  (as the model run measured it, and as the grid measured the same point: two measurements of one
  configuration differ by the machine's noise, which the second ratio leaves out);
- the pick against the default options, measured in the same (model) run;
- Spearman's rank correlation of predicted and measured step time over the grid's 12 points;
- the configurations both runs measured, model run over grid run: how much two measurements of the
  same point differ on this machine (the noise floor of every ratio above);
- wall time of each strategy, split into cost measurement, predictions and measured trials, and the
  seconds per point predicted and per trial measured: a run costs about costs + N x predict + M x
  measure for N points of which M are measured.

One thread per rank; the ranks share the machine's cores with gloo's threads (and, on a shared
machine, with whatever else runs: the load average is recorded at the start and the end).
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
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

from common import print_table, start_gloo_benchmark  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

from zcompile.tune.tuner import tune  # noqa: E402

SPACE = {"bucket_mb": [0, 0.25, 1.0, 4.0], "prefetch": [0, 1, 2]}
VOCAB, SEQ = 512, 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "llama"], choices=("gpt", "llama"))
    parser.add_argument("--layers", type=int, default=8, help="GPT layers (the Llama has --llama-layers)")
    parser.add_argument("--llama-layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per trial (median)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--strategies", nargs="+", default=["grid", "model"], choices=("grid", "model"))
    parser.add_argument("--out", default=None, help="JSON results (default benchmarks/results/tune_MODELS_N.json)")
    parser.add_argument("--plot", default=None, help="the grid's plot of the first model (PNG)")
    return parser.parse_args()


def make_factory(name: str, args):
    """(make_model, loss_fn) of a benchmark model, the same weights on every rank and every trial."""
    if name == "gpt":
        config = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=args.layers, n_head=4, n_embd=128)

        def make_gpt():
            torch.manual_seed(0)
            return GPT(config)

        return make_gpt, lambda model, batch: model(*batch)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=args.llama_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
    )

    def make_llama():
        torch.manual_seed(0)
        return LlamaForCausalLM(config)

    return make_llama, lambda model, batch: model(input_ids=batch[0], labels=batch[0]).loss


def local_batches(rank: int, world: int, batch: int) -> list:
    config = GPTConfig(vocab_size=VOCAB, block_size=SEQ)
    out = []
    for step in range(4):
        tokens, targets = synthetic_batch(step, batch * world, config)
        out.append((tokens[rank * batch : (rank + 1) * batch], targets[rank * batch : (rank + 1) * batch]))
    return out


def measured_program(result, index: int):
    """The trial of ``result`` that measured point ``index``'s program: the point itself, or the point it
    compiled the same graphs as (status ``same``); None when that program was not measured."""
    trial = result.trials[index]
    if trial.measured is not None or trial.predicted is None:
        return trial if trial.measured is not None else None
    return next((t for t in result.measured if t.predicted.graphs_digest == trial.predicted.graphs_digest), None)


def summarize(grid, model) -> dict:
    """The figures of one model: pick against grid best and default, correlation, wall time."""
    out = {}
    if grid is not None:
        best = grid.best_trial
        out["grid"] = {
            "best_index": best.index,
            "best_ms": best.measured.step_s * 1e3,
            "default_ms": grid.default.measured.step_s * 1e3,
            "measured": len(grid.measured),
            "points": len(grid.trials),
            "spearman": grid.rank_correlation,
            "wall_s": grid.wall_s,
            "timings": grid.timings,
            "predict_s_per_point": grid.timings["predict_s"] / len(grid.trials),
            "measure_s_per_trial": (grid.timings["measure_s"] + grid.timings["calibrate_s"])
            / max(len(grid.measured), 1),
            "calibration": None if grid.calibration is None else vars(grid.calibration),
        }
    if model is not None:
        pick = model.best_trial
        out["model"] = {
            "pick_index": pick.index,
            "pick_ms": pick.measured.step_s * 1e3,
            "default_ms": model.default.measured.step_s * 1e3,
            "speedup_over_default": model.speedup_over_default,
            "measured": len(model.measured),
            "points": len(model.trials),
            "spearman_measured": model.rank_correlation,
            "wall_s": model.wall_s,
            "timings": model.timings,
        }
    if grid is not None and model is not None:
        grid_of_pick = measured_program(grid, pick.index)
        out["pick_over_grid_best"] = pick.measured.step_s / best.measured.step_s
        out["pick_over_grid_best_same_run"] = grid_of_pick.measured.step_s / best.measured.step_s
        out["pick_is_grid_best_program"] = grid_of_pick.index == best.index
        out["trials_fraction"] = len(model.measured) / len(grid.trials)  # of the space
        # the same program measured once by each run: how far two measurements of one point differ here
        out["repeat_ratios"] = {
            t.index: t.measured.step_s / measured_program(grid, t.index).measured.step_s
            for t in model.measured
            if measured_program(grid, t.index) is not None
        }
        predicted_best = min(
            (t for t in grid.trials if t.predicted is not None), key=lambda t: (t.predicted.step_s, t.index)
        )
        ranked = sorted(grid.measured, key=lambda t: t.measured.step_s)
        out["grid_rank_of_predicted_best"] = ranked.index(measured_program(grid, predicted_best.index)) + 1
    return out


def rows(name: str, summary: dict, grid, model) -> list[tuple[str, ...]]:
    ms = lambda v: f"{v:.1f}"  # noqa: E731
    g, m = summary.get("grid", {}), summary.get("model", {})
    options = lambda result, i: " ".join(f"{k}={v}" for k, v in result.trials[i].options.items())  # noqa: E731
    return [
        (
            name,
            f"#{g['best_index']} {options(grid, g['best_index'])}: {ms(g['best_ms'])}" if g else "-",
            f"#{m['pick_index']} {options(model, m['pick_index'])}: {ms(m['pick_ms'])}" if m else "-",
            f"{summary['pick_over_grid_best']:.3f} / {summary['pick_over_grid_best_same_run']:.3f}"
            if "pick_over_grid_best" in summary
            else "-",
            f"{m['measured']} of {m['points']}" if m else "-",
            f"{ms(m['default_ms'])} ({m['speedup_over_default']:.3f}x)" if m else "-",
            f"{g['spearman']:.2f}" if g and g["spearman"] is not None else "-",
            f"{g['wall_s']:.0f}" if g else "-",
            f"{m['wall_s']:.0f}" if m else "-",
        )
    ]


def write(args, world: int, cores: int, load_start, results: dict) -> None:
    """The JSON of the models measured so far (``--out``; one file per model with ``--models`` alone)."""
    out = args.out or os.path.join(HERE, "results", f"tune_{'_'.join(args.models)}_{world}.json")
    with open(out, "w") as handle:
        json.dump(
            {
                "world_size": world,
                "cores": cores,
                "space": SPACE,
                "steps": args.steps,
                "warmup": args.warmup,
                "load_average": {"start": load_start, "end": os.getloadavg()},
                "torch": torch.__version__,
                "models": results,
            },
            handle,
            indent=1,
        )
    print(f"wrote {out}", flush=True)


def main() -> None:
    args = parse_args()
    rank, world, cores = start_gloo_benchmark()
    load_start = os.getloadavg()
    results, table = {}, []
    for name in args.models:
        make_model, loss_fn = make_factory(name, args)
        batches = local_batches(rank, world, args.batch)
        runs = {}
        for strategy in args.strategies:
            torch._dynamo.reset()
            started = time.perf_counter()
            runs[strategy] = tune(
                make_model,
                loss_fn,
                batches,
                space=SPACE,
                steps=args.steps,
                warmup=args.warmup,
                strategy=strategy,
                progress=rank == 0,
            )
            if rank == 0:
                print(f"{name} {strategy}: {time.perf_counter() - started:.0f} s", flush=True)
                runs[strategy].print()
        grid, model = runs.get("grid"), runs.get("model")
        summary = summarize(grid, model)
        results[name] = {"summary": summary, **{s: r.to_dict() for s, r in runs.items()}}
        table += rows(name, summary, grid, model)
        if rank == 0 and args.plot and grid is not None and name == args.models[0]:
            grid.plot(args.plot)
        if rank == 0:  # after each model: a later crash keeps what was measured
            write(args, world, cores, load_start, results)
    if rank == 0:
        load_end = os.getloadavg()
        print_table(
            f"zcompile.tune on {world} gloo ranks ({cores} cores; load average {load_start[0]:.1f} at the "
            f"start, {load_end[0]:.1f} at the end); step times in ms, median of {args.steps} steps",
            (
                "model",
                "grid best",
                "model pick",
                "pick / grid best (own / grid's)",
                "measured",
                "default (pick's speedup)",
                "Spearman (grid)",
                "grid s",
                "model s",
            ),
            table,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
