"""Tune the zero backend's schedule for the example GPT on this machine.

    torchrun --nproc-per-node 2 examples/tune_gpt.py                  # 12 points, the best 4 measured
    torchrun --nproc-per-node 2 examples/tune_gpt.py --strategy grid  # every point measured
    zcompile tune-report tune_out/tune.json                           # the table again, later

Every point of the space (bucket size x prefetch depth x schedule policy) is compiled once and
predicted by the cost model; the default options and the best predicted are trained and timed;
the table shows both and how well they agree. Writes ``tune.json`` and ``tune.png`` to ``--out``
and prints the options to paste into ``torch.compile``.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

from zcompile.tune import tune  # noqa: E402
from zcompile.tune.serialization import jsonable_options  # noqa: E402

SPACE = {"bucket_mb": [0.25, 1.0, 4.0], "prefetch": [1, 2], "schedule_policy": ["greedy", "cost_guided"]}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch, split across ranks")
    parser.add_argument("--strategy", default="model", choices=("model", "grid"))
    parser.add_argument("--max-trials", type=int, default=None, help="model strategy: points measured (a third)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per trial (median)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--memory-limit-mb", type=float, default=None, help="prune points predicted over this")
    parser.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    parser.add_argument("--out", default="tune_out", help="directory for tune.json and tune.png")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    distributed = "RANK" in os.environ
    if distributed:
        torch.set_num_threads(1)  # one thread per rank: the ranks share the cores
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the {world} ranks")
    config = GPTConfig(n_layer=args.layers, n_embd=args.embd)

    def make_model() -> GPT:
        torch.manual_seed(0)  # the same weights on every rank and in every trial
        return GPT(config)

    def loss_fn(model, batch) -> torch.Tensor:
        tokens, targets = batch
        return model(tokens, targets)

    local = slice(rank * args.batch_size // world, (rank + 1) * args.batch_size // world)
    batches = []
    for step in range(4):
        tokens, targets = synthetic_batch(step, args.batch_size, config)
        batches.append((tokens[local], targets[local]))
    if rank == 0:
        print(f"tuning GPT {args.layers} layers (embd {args.embd}) on {world} rank(s): {SPACE}", flush=True)
    result = tune(
        make_model,
        loss_fn,
        batches,
        space=SPACE,
        base_options={"stage": args.stage},
        steps=args.steps,
        warmup=args.warmup,
        memory_limit_mb=args.memory_limit_mb,
        strategy=args.strategy,
        max_trials=args.max_trials,
        out_dir=args.out,
        progress=True,
    )
    if rank == 0:
        result.print()
        print(f"\nwrote {os.path.join(args.out, 'tune.json')} and {os.path.join(args.out, 'tune.png')}")
        saved = os.path.join(args.out, "tune.json")
        best = jsonable_options(result.options_of(result.best_trial))
        print("use it:")
        if best.get("schedule_policy", "greedy") == "greedy":
            best.pop("schedule_policy", None)
            print(f"    options = {best!r}")
        print(f"    options = zcompile.tune.load_result({saved!r}).best  # the same, read back (a policy rebuilt)")
        print("    model = torch.compile(model, backend='zero', options=options)")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
