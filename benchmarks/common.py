"""Helpers shared by the benchmarks: timing (do_bench on CUDA, wall-clock medians on CPU) and tables."""

import os
import statistics
import time


def start_gloo_benchmark() -> tuple[int, int, int]:
    """The set-up of the multi-rank CPU benchmarks: one-line rich tables when stdout is not a
    terminal, one thread per rank, the gloo process group. Returns (rank, world size, CPU cores)."""
    import torch
    import torch.distributed as dist

    os.environ.setdefault("COLUMNS", "170")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), os.cpu_count()


def slowest_ms(fn) -> float:
    """Milliseconds of ``fn()`` on the slowest rank, timed from a barrier."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item() * 1e3


def timed_training_step(compiled, optimizer, tokens, targets) -> float:
    """Seconds of one training step (forward, backward, step, zero_grad) on the slowest rank,
    timed from a barrier so that one rank's lead does not count as time spent inside the step."""
    return timed_training_phases(compiled, optimizer, tokens, targets)["step"]


def timed_training_phases(compiled, optimizer, tokens, targets) -> dict[str, float]:
    """``timed_training_step`` with its phases: seconds of the forward, the backward and the
    optimizer (``step()`` and ``zero_grad()``), each the slowest rank's, and of the whole step."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    loss = compiled(tokens, targets)
    forward = time.perf_counter()
    loss.backward()
    backward = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad()
    end = time.perf_counter()
    elapsed = torch.tensor([forward - start, backward - forward, end - backward, end - start], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return dict(zip(("forward", "backward", "optimizer", "step"), elapsed.tolist()))


def time_ms(fn, cuda: bool, repeats: int) -> float:
    if cuda:
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median")
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def print_table(title: str, columns, rows) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(str(r[i])) for r in [columns, *rows]) for i in range(len(columns))]
        print(title)
        for row in [columns, *rows]:
            print("  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
        return
    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def depth_sweep_arguments(doc: str, result_name: str):
    """The command line of a benchmark over the example GPT's depth: ``--layers``, ``--rounds`` and
    ``--out`` (default ``benchmarks/results/<result_name>``), parsed."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", result_name)
    )
    return parser.parse_args()
