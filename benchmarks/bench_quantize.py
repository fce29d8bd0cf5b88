"""Throughput of the block-wise quantization kernels, next to the device's copy bandwidth.

    python benchmarks/bench_quantize.py [--block 2048] [--dtype fp32|bf16|fp16] [--repeats 3]

On CUDA: the Triton kernels (``*_triton`` wrappers, timed with ``triton.testing.do_bench``) at 1M,
16M, 64M and 256M elements. GB/s counts the bytes read plus written (input, q, scales, output);
"of copy" divides it by the GB/s of ``dst.copy_(src)`` of the same number of fp32 elements, the
bandwidth a memory-bound kernel can hope for. Without CUDA: the pure-torch reference on the CPU at
1M and 16M elements (wall-clock medians), which is what the ops run there.
"""

import argparse
import os
import sys

import torch

from zcompile.kernels import quantize as qz

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, time_ms  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
M = 2**20


def _cases(n: int, dtype: torch.dtype, block: int, cuda: bool):
    """(name, fn, bytes moved) for each measured op on ``n`` elements."""
    device = "cuda" if cuda else "cpu"
    x = torch.randn(n, device=device).to(dtype)
    blocks = qz.num_blocks(n, block)
    quantize = qz.quantize_blockwise_triton if cuda else qz.quantize_blockwise_reference
    dequantize = qz.dequantize_blockwise_triton if cuda else qz.dequantize_blockwise_reference
    for bits in (8, 4):
        q, scales = quantize(x, bits, block)
        packed = qz.q_numel(n, bits, block) + 4 * blocks
        yield f"quantize int{bits}", lambda b=bits: quantize(x, b, block), n * x.element_size() + packed
        yield (
            f"dequantize int{bits}",
            lambda q=q, s=scales, b=bits: dequantize(q, s, n, b, block, dtype),
            packed + n * x.element_size(),
        )


def run(sizes, dtype: torch.dtype, block: int, cuda: bool, repeats: int):
    rows = []
    for n in sizes:
        src = torch.randn(n, device="cuda" if cuda else "cpu")
        dst = torch.empty_like(src)
        copy_ms = time_ms(lambda: dst.copy_(src), cuda, repeats)  # noqa: F821 (the del below frees them after the last call)
        copy_gbs = 2 * n * 4 / copy_ms / 1e6
        rows.append(("copy fp32", f"{n // M}M", f"{copy_ms:.3f}", f"{copy_gbs:.2f}", "1.00"))
        for name, fn, nbytes in _cases(n, dtype, block, cuda):
            ms = time_ms(fn, cuda, repeats)
            gbs = nbytes / ms / 1e6
            rows.append((name, f"{n // M}M", f"{ms:.3f}", f"{gbs:.2f}", f"{gbs / copy_gbs:.2f}"))
        del src, dst
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", type=int, default=2048)
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="dtype of x and of the dequantized output")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per op on the CPU (median)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        import triton

        sizes = [1 * M, 16 * M, 64 * M, 256 * M]
        versions = f"torch {torch.__version__}, triton {triton.__version__}"
        where = f"{torch.cuda.get_device_name()}: Triton kernels ({versions})"
    else:
        sizes = [1 * M, 16 * M]
        versions = f"torch {torch.__version__}, {torch.get_num_threads()} threads"
        where = f"CPU, no CUDA: pure-torch reference only ({versions})"
    rows = run(sizes, DTYPES[args.dtype], args.block, cuda, args.repeats)
    title = f"{where}; block {args.block}, x and output {args.dtype}"
    print_table(title, ("op", "elements", "ms", "GB/s", "of copy"), rows)


if __name__ == "__main__":
    main()
