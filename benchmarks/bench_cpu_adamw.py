"""The sharded optimizer's CPU update: torch's fused AdamW kernel against the foreach reference.

    python benchmarks/bench_cpu_adamw.py [--layers 4 16] [--repeats 15]     # results/cpu_adamw.json

Over the parameters of the example GPT (n_embd 128, vocab 512, as ``bench_speed``; every shape as
one fp32 tensor, world 1), one thread (what each torchrun rank gets): median milliseconds of
``kernels.cpu_adamw.adamw_cpu_fused`` (what ``zcompile.optim.AdamW`` runs on a CPU), of
``optim_reference.adamw_reference_foreach`` (what it ran before) and of ``torch.optim.AdamW``'s
default on a CPU (single-tensor, what the DDP baselines of ``bench_speed`` step with), each with
a gradient scale of 1 and of 1/2 (stage 1 averages at the step). Ratios are within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

from common import print_table, time_ms  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

from zcompile.kernels.cpu_adamw import adamw_cpu_fused  # noqa: E402
from zcompile.kernels.optim_reference import adamw_reference_foreach  # noqa: E402

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu_adamw.json")


def shapes(layers: int) -> list[torch.Size]:
    model = GPT(GPTConfig(vocab_size=512, block_size=128, n_layer=layers, n_head=4, n_embd=128))
    return [p.shape for p in model.parameters()]


def measure(layers: int, repeats: int) -> dict:
    sizes = shapes(layers)
    torch.manual_seed(0)
    params = [torch.randn(s).view(-1) for s in sizes]
    grads = [torch.randn(s).view(-1) for s in sizes]
    moments = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    row = {"layers": layers, "parameters": sum(p.numel() for p in params), "tensors": len(params)}
    for scale in (1.0, 0.5):
        for name, update in (("fused", adamw_cpu_fused), ("foreach", adamw_reference_foreach)):
            row[f"{name}_ms_scale_{scale}"] = time_ms(
                lambda: update(
                    params,
                    grads,
                    *moments,
                    3,
                    HYPER["lr"],
                    HYPER["beta1"],
                    HYPER["beta2"],
                    HYPER["eps"],
                    HYPER["weight_decay"],
                    scale,
                ),
                False,
                repeats,
            )
    tensors = [torch.nn.Parameter(p.clone()) for p in params]
    for t, g in zip(tensors, grads):
        t.grad = g
    opt = torch.optim.AdamW(tensors, lr=HYPER["lr"], weight_decay=HYPER["weight_decay"])
    row["torch_default_ms"] = time_ms(opt.step, False, repeats)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [measure(layers, args.repeats) for layers in args.layers]
    print_table(
        "AdamW over the example GPT's parameters, one CPU thread (median ms)",
        ["layers", "params", "fused", "foreach", "x", "fused 1/2", "foreach 1/2", "x", "torch default"],
        [
            [
                str(r["layers"]),
                f"{r['parameters'] / 1e6:.2f}M",
                f"{r['fused_ms_scale_1.0']:.2f}",
                f"{r['foreach_ms_scale_1.0']:.2f}",
                f"{r['foreach_ms_scale_1.0'] / r['fused_ms_scale_1.0']:.1f}",
                f"{r['fused_ms_scale_0.5']:.2f}",
                f"{r['foreach_ms_scale_0.5']:.2f}",
                f"{r['foreach_ms_scale_0.5'] / r['fused_ms_scale_0.5']:.1f}",
                f"{r['torch_default_ms']:.2f}",
            ]
            for r in rows
        ],
    )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "threads": 1, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
