"""One command on a CUDA machine: are zcompile's GPU paths right, and how fast are they?

    python benchmarks/gpu_check.py [--out benchmarks/results/gpu_check.json]
    python benchmarks/gpu_check.py --allow-cpu --quick     # the same steps on a CPU, small (checks this script)

One GPU is enough. In order, each step recorded in the JSON file and summarized in a table:
1. the environment (torch, triton, device, its memory);
2. the kernel tests compiled for the GPU (``TRITON_INTERPRET=0``: Triton compiles them for the
   device instead of interpreting them): ``tests/unit/test_quantize.py``, ``tests/unit/test_fused_optim.py`` and
   ``tests/unit/test_cross_entropy_kernel.py``, and ``tests/unit/test_device_loop.py`` (a one-rank training
   loop on CUDA tensors at stages 1-3: clipping, evaluation, a checkpoint resumed, against eager);
   pass/fail counts and the failures' names;
3. the device's memory bandwidth, measured (``dst.copy_(src)`` of 256M fp32 elements);
4. the kernel benchmarks (``bench_quantize.py``, ``bench_fused_adamw.py``) with each kernel's GB/s as
   a fraction of that bandwidth, the fused AdamW against ``torch.optim.AdamW(fused=True)``, and the
   fused cross-entropy backward against the two ATen ops it replaces;
5. a world-1 training step of the example GPT (12 layers, n_embd 768, seq 512, batch 8; AdamW):
   ``torch.compile(backend="zero")`` with the eager and the inductor inner compilers (stage 3), stage 1,
   and stages 2 and 3 with bf16 parameters (both inner compilers), against plain ``torch.compile``
   with ``aot_eager`` and inductor (and inductor under bf16 autocast) and
   ``torch.optim.AdamW(fused=True)``: first step (compile), median step, the host's median
   time to enqueue a step (a step that takes no longer waits on Python: ``bench_gpu_host.py``), and
   each step's loss next to the plain ``aot_eager`` run's.
A step that fails is recorded with its error and the check goes on to the next one; the exit status
is 1 when any step failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [HERE, os.path.join(REPO, "examples")]

from common import print_table, time_ms  # noqa: E402

M = 2**20
# the kernel tests, and a one-rank training loop (clip, checkpoint and resume, eval, gathered) on CUDA tensors
KERNEL_TESTS = (
    "tests/unit/test_quantize.py",
    "tests/unit/test_fused_optim.py",
    "tests/unit/test_cross_entropy_kernel.py",
    "tests/unit/test_device_loop.py",
)


def environment(device: str) -> dict:
    info = {"torch": torch.__version__, "device": device, "python": sys.version.split()[0]}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            name=props.name, memory_gib=round(props.total_memory / 2**30, 1), capability=f"{props.major}.{props.minor}"
        )
    return info


def kernel_tests(device: str) -> dict:
    """The kernel tests in a subprocess, compiled for the GPU (interpreted on a CPU)."""
    env = dict(os.environ, TRITON_INTERPRET="0" if device == "cuda" else "1")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", *KERNEL_TESTS]
    if device == "cuda" and importlib.util.find_spec("xdist") is not None:
        command += ["-n", "4"]  # Triton compiles each kernel specialization once per process: spread them
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    lines = done.stdout.strip().splitlines()
    return {
        "command": " ".join(command),
        "interpreted": device != "cuda",
        "returncode": done.returncode,
        "summary": lines[-1] if lines else done.stderr[-500:],
        "failed": [line.split()[1] for line in lines if line.startswith("FAILED")],
        "output_tail": (done.stdout + done.stderr)[-6000:] if done.returncode else "",
    }


def bandwidth_gbs(device: str, elements: int) -> float:
    src = torch.randn(elements, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device == "cuda", repeats=5)
    return 2 * elements * 4 / ms / 1e6


def kernel_benchmarks(device: str, quick: bool, copy_gbs: float) -> dict:
    """The two kernel benchmarks' rows, with GB/s as a fraction of the measured bandwidth."""
    import bench_fused_adamw
    import bench_quantize

    cuda = device == "cuda"
    sizes = [1 * M, 16 * M] if quick else [1 * M, 16 * M, 64 * M, 256 * M]
    quantize = [
        dict(zip(("op", "elements", "ms", "gbs", "of_copy_same_size"), row))
        for row in bench_quantize.run(sizes, torch.float32, 2048, cuda, repeats=3)
    ]
    for row in quantize:
        row["of_bandwidth"] = round(float(row["gbs"]) / copy_gbs, 3)
    adamw = [
        dict(
            zip(
                (
                    "elements",
                    "ours_ms",
                    "ours_gbs",
                    "torch_fused_ms",
                    "torch_fused_plus_cast_ms",
                    "speedup",
                    "speedup_vs_plus_cast",
                ),
                row,
            )
        )
        for row in bench_fused_adamw.run(sizes, cuda, repeats=3)
    ]
    for row in adamw:
        row["of_bandwidth"] = round(float(row["ours_gbs"]) / copy_gbs, 3)
    return {
        "quantize": quantize,
        "fused_adamw": adamw,
        "cross_entropy_backward": cross_entropy_backward_rows(device, quick, copy_gbs),
    }


def cross_entropy_backward_rows(device: str, quick: bool, copy_gbs: float) -> list[dict]:
    """``zcompile::cross_entropy_backward`` (the Triton kernel on CUDA, the torch path on a CPU) against
    ATen's ``nll_loss_backward`` + ``_log_softmax_backward_data`` it replaces, on fp32 log-probabilities
    of ``rows x 32768`` classes; GB/s counts the one read and one write the kernel makes."""
    from zcompile.kernels.cross_entropy import cross_entropy_backward, cross_entropy_backward_reference

    aten, cuda, classes = torch.ops.aten, device == "cuda", 32768
    rows_list = [64] if quick else [1024, 8192]
    out = []
    for rows in rows_list:
        log_probs = torch.log_softmax(torch.randn(rows, classes, device=device), -1)
        target = torch.randint(0, classes, (rows,), device=device)
        _, total_weight = aten.nll_loss_forward(log_probs, target, None, 1, -100)
        args = (torch.ones((), device=device), log_probs, target, None, 1, -100, total_weight, torch.float32)
        ours = time_ms(lambda: cross_entropy_backward(*args, torch.float32), cuda, repeats=3)  # out dtype
        aten_ms = time_ms(lambda: cross_entropy_backward_reference(*args), cuda, repeats=3)
        gbs = 2 * log_probs.numel() * 4 / ours / 1e6
        out.append(
            {
                "rows": rows,
                "classes": classes,
                "ours_ms": round(ours, 3),
                "aten_two_ops_ms": round(aten_ms, 3),
                "speedup": round(aten_ms / ours, 2),
                "ours_gbs": round(gbs, 1),
                "of_bandwidth": round(gbs / copy_gbs, 3),
            }
        )
    return out


def training_steps(device: str, quick: bool, steps: int) -> list[dict]:
    """World-1 steps of the example GPT: zero backend (eager, inductor) against plain torch.compile."""
    from gpt import GPT, GPTConfig, synthetic_batch

    import zcompile.optim

    config = (
        GPTConfig(n_layer=2, n_embd=64, block_size=64)
        if quick
        else GPTConfig(vocab_size=50304, n_layer=12, n_head=12, n_embd=768, block_size=512)
    )
    batch = 2 if quick else 8
    ways = {
        "torch.compile aot_eager": ("aot_eager", None),
        "zero stage 3, eager": ("zero", {"stage": 3, "compiler": "eager"}),
        "zero stage 3, inductor": ("zero", {"stage": 3, "compiler": "inductor"}),
        "zero stage 3, default compiler (auto)": ("zero", {"stage": 3}),  # inductor on CUDA: compiler_chosen
        "torch.compile inductor": ("inductor", None),
        # the other stages and mixed precision: the fused AdamW writes the bf16 replica (lowp_out) on CUDA
        "zero stage 1, eager": ("zero", {"stage": 1, "compiler": "eager"}),
        "zero stage 2, eager, bf16": ("zero", {"stage": 2, "compiler": "eager", "param_dtype": "bf16"}),
        "zero stage 3, eager, bf16": ("zero", {"stage": 3, "compiler": "eager", "param_dtype": "bf16"}),
        # bf16 under inductor: the eager rows above wait on the host (Python runs each graph node);
        # plain inductor under bf16 autocast is the same matmuls in bf16, for scale
        "zero stage 2, inductor, bf16": ("zero", {"stage": 2, "compiler": "inductor", "param_dtype": "bf16"}),
        "zero stage 3, inductor, bf16": ("zero", {"stage": 3, "compiler": "inductor", "param_dtype": "bf16"}),
        "torch.compile inductor, bf16 autocast": ("inductor", "autocast"),
    }
    rows = []
    for name, (backend, options) in ways.items():
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = GPT(config).to(device)
        autocast = options == "autocast"
        chosen: set[str] = set()  # the inner compiler each zero graph ran with ("auto" made concrete)
        if backend == "zero":
            options = {**options, "on_compile": lambda graphs: chosen.add(graphs.context.config.compiler)}
        compiled = torch.compile(model, backend=backend, options=None if autocast else options)
        if backend == "zero":
            optimizer = zcompile.optim.AdamW(model.parameters(), lr=1e-4)
        else:
            fused = {"fused": True} if device == "cuda" else {}
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
        times, enqueued, losses = [], [], []
        for step in range(steps + 1):
            tokens, targets = (t.to(device) for t in synthetic_batch(step, batch, config))
            _sync(device)
            start = time.perf_counter()
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                loss = compiled(tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            enqueued.append(time.perf_counter() - start)  # the host's part: equal to the step when the GPU waits on it
            _sync(device)
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
        rows.append(
            {
                "way": name,
                "first_step_s": times[0],
                "median_step_ms": statistics.median(times[1:]) * 1e3,
                "median_enqueue_ms": statistics.median(enqueued[1:]) * 1e3,
                "losses": losses,
                "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
                "compiler_chosen": sorted(chosen) or None,
            }
        )
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        del model, compiled, optimizer
    base = next(r for r in rows if r["way"] == "torch.compile aot_eager")
    for row in rows:
        row["x_aot_eager"] = row["median_step_ms"] / base["median_step_ms"]
        # the same model, data and update rule: the losses must follow the plain run's (fp32 to float
        # rounding of different kernels; bf16 to its own precision)
        row["max_loss_diff_vs_aot_eager"] = max(abs(a - b) for a, b in zip(row["losses"], base["losses"]))
    return rows


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _step(results: dict, name: str, fn, *args):
    """Runs one step of the check; a failure is recorded and the check goes on."""
    start = time.perf_counter()
    try:
        results[name] = fn(*args)
    except Exception as error:  # a failed step is a result too: record it, go on
        results[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}
    print(f"[gpu_check] {name}: {time.perf_counter() - start:.1f}s", flush=True)
    return results[name]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "gpu_check.json"))
    parser.add_argument("--allow-cpu", action="store_true", help="run on a CPU (small sizes with --quick)")
    parser.add_argument("--quick", action="store_true", help="small sizes: a check of this script")
    parser.add_argument("--steps", type=int, default=10, help="timed training steps per way")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.allow_cpu:
        print(
            "gpu_check: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine, "
            "or pass --allow-cpu --quick to check the script itself",
            file=sys.stderr,
        )
        return 2
    results: dict = {}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save():  # after every step: a run stopped at a time limit still leaves what it measured
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=1, default=str)

    _step(results, "environment", environment, device)
    _step(results, "kernel_tests", kernel_tests, device)
    save()
    copy_gbs = _step(results, "bandwidth_gbs", bandwidth_gbs, device, 16 * M if args.quick else 256 * M)
    if isinstance(copy_gbs, float):
        _step(results, "kernels", kernel_benchmarks, device, args.quick, copy_gbs)
    save()
    _step(results, "training_step", training_steps, device, args.quick, args.steps)
    save()
    _print_summary(results)
    print(f"[gpu_check] results in {args.out}")
    return (
        1
        if any(isinstance(v, dict) and "error" in v for v in results.values())
        or results.get("kernel_tests", {}).get("returncode")
        else 0
    )


def _print_summary(results: dict) -> None:
    rows = []
    env = results.get("environment", {})
    rows.append(("environment", ", ".join(f"{k} {v}" for k, v in env.items() if k != "error") or str(env)))
    tests = results.get("kernel_tests", {})
    rows.append(
        (
            "kernel tests" + (" (interpreted)" if tests.get("interpreted") else ""),
            tests.get("summary", tests.get("error", "")),
        )
    )
    if isinstance(results.get("bandwidth_gbs"), float):
        rows.append(("copy bandwidth", f"{results['bandwidth_gbs']:.1f} GB/s"))
    kernels = results.get("kernels", {})
    for row in kernels.get("quantize", []):
        rows.append((f"{row['op']} {row['elements']}", f"{row['gbs']} GB/s = {row['of_bandwidth']:.2f} of bandwidth"))
    for row in kernels.get("cross_entropy_backward", []):
        rows.append(
            (
                f"cross-entropy backward {row['rows']}x{row['classes']}",
                f"{row['ours_gbs']} GB/s = {row['of_bandwidth']:.2f} of bandwidth; {row['speedup']}x ATen's two ops",
            )
        )
    for row in kernels.get("fused_adamw", []):
        rows.append(
            (
                f"fused AdamW {row['elements']}",
                f"{row['ours_gbs']} GB/s = {row['of_bandwidth']:.2f} of "
                f"bandwidth; {row['speedup']} torch fused, {row['speedup_vs_plus_cast']} torch fused + cast",
            )
        )
    steps = results.get("training_step")
    for row in steps if isinstance(steps, list) else []:
        rows.append(
            (
                row["way"],
                f"first step {row['first_step_s']:.1f}s, median {row['median_step_ms']:.1f} ms "
                f"({row['x_aot_eager']:.2f}x aot_eager; host {row['median_enqueue_ms']:.1f} ms); losses {row['losses'][0]:.4f} -> "
                f"{row['losses'][-1]:.4f}, at most {row['max_loss_diff_vs_aot_eager']:.1e} off aot_eager's"
                + (f"; compiler {', '.join(row['compiler_chosen'])}" if row.get("compiler_chosen") else ""),
            )
        )
    for name, value in results.items():
        if isinstance(value, dict) and "error" in value:
            rows.append((f"{name} FAILED", value["error"][:200]))
    print_table("gpu_check", ("check", "result"), rows)


if __name__ == "__main__":
    sys.exit(main())
