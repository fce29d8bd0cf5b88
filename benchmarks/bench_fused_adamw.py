"""Fused sharded AdamW against torch.optim.AdamW(fused=True) on the same parameters.

    python benchmarks/bench_fused_adamw.py [--repeats 3]

The sharded update reads the gradient (bf16, scaled by 1/N in the same pass), updates the fp32
master weights and both moments, and writes the bf16 copy the next all-gather sends: one pass.
torch's fused AdamW updates fp32 parameters from fp32 gradients and writes no low-precision copy,
so doing what ZeRO needs with it costs a second pass (the cast), timed here as "+ cast".
On CUDA: the Triton kernel (``fused_adamw_triton``) vs ``torch.optim.AdamW(fused=True)`` over one
flat tensor of each size, timed with ``triton.testing.do_bench``. Without CUDA: the pure-torch
reference (what runs on a CPU) vs ``torch.optim.AdamW(foreach=False)``, wall-clock medians.
"""

import argparse
import os
import sys

import torch

from zcompile.kernels.fused_optim import fused_adamw_reference, fused_adamw_triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, time_ms  # noqa: E402

M = 2**20
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def run(sizes, cuda: bool, repeats: int):
    device = "cuda" if cuda else "cpu"
    ours_fn = fused_adamw_triton if cuda else fused_adamw_reference
    rows = []
    for n in sizes:
        master = torch.randn(n, device=device)
        grad = torch.randn(n, device=device).to(torch.bfloat16)
        exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
        lowp = torch.empty(n, device=device, dtype=torch.bfloat16)
        state = {"step": 0}

        def ours():
            state["step"] += 1
            ours_fn(master, grad, exp_avg, exp_avg_sq, state["step"], grad_scale=0.5, lowp_out=lowp, **HYPER)  # noqa: F821 (the del below frees them after the last call)

        param = torch.nn.Parameter(torch.randn(n, device=device))
        param.grad = torch.randn(n, device=device)
        kwargs = {"fused": True} if cuda else {"foreach": False}
        torch_opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, **kwargs)
        torch_lowp = torch.empty(n, device=device, dtype=torch.bfloat16)

        def theirs_and_cast():
            torch_opt.step()  # noqa: F821
            torch_lowp.copy_(param.detach())  # noqa: F821

        ours_ms = time_ms(ours, cuda, repeats)
        theirs_ms = time_ms(torch_opt.step, cuda, repeats)
        theirs_cast_ms = time_ms(theirs_and_cast, cuda, repeats)
        # bytes of the sharded update: read grad (2) + p, m, v (12), write p, m, v (12) + bf16 copy (2)
        gbs = 28 * n / ours_ms / 1e6
        rows.append(
            (
                f"{n // M}M",
                f"{ours_ms:.3f}",
                f"{gbs:.1f}",
                f"{theirs_ms:.3f}",
                f"{theirs_cast_ms:.3f}",
                f"{theirs_ms / ours_ms:.2f}x",
                f"{theirs_cast_ms / ours_ms:.2f}x",
            )
        )
        del master, grad, exp_avg, exp_avg_sq, lowp, param, torch_opt
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case on the CPU (median)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        sizes = [1 * M, 16 * M, 64 * M, 256 * M]
        where = f"{torch.cuda.get_device_name()}: Triton fused AdamW vs torch.optim.AdamW(fused=True)"
    else:
        sizes = [1 * M, 16 * M]
        where = "CPU, no CUDA: pure-torch reference vs torch.optim.AdamW(foreach=False)"
    rows = run(sizes, cuda, args.repeats)
    print_table(
        f"{where}; torch {torch.__version__}",
        ("elements", "ours ms", "ours GB/s", "torch ms", "torch + cast ms", "speedup", "speedup vs + cast"),
        rows,
    )


if __name__ == "__main__":
    main()
