"""Checkpoint save and load: ``zcompile.checkpoint`` against ``gathered()`` + ``torch.save`` and FSDP2 + DCP.

    torchrun --nproc-per-node 2 benchmarks/bench_checkpoint.py [--sizes 4x128 8x256 8x512]
        [--repeats 3] [--out benchmarks/results/checkpoint_2.json]

For each size of the example GPT (``examples/gpt.py``, vocab 512, block 64, 4 heads; ``LxE`` is
``n_layer x n_embd``), three models are trained ``--train-steps`` steps with AdamW (so optimizer
state exists), then checkpointed ``--repeats`` times each:

- ``zcompile``: stage 3 (``zcompile.optim.AdamW``); save = ``zcompile.checkpoint.save(dir, compiled,
  optimizer)`` (each rank's shards, DCP); load = ``zcompile.checkpoint.load`` into a freshly built,
  not yet compiled model and optimizer (the resume route: parameters are full until compile, so
  the load all-gathers each one). ``zcompile, into compiled`` loads the same checkpoint into the
  trained, compiled model itself (sharded parameters: no gather; the save column repeats).
- ``gathered + torch.save``: the same stage-3 model; save = ``with zcompile.gathered(model):
  torch.save(model.state_dict(), f)`` on every rank, each its own file (what users do without
  ``zcompile.checkpoint``); load = ``torch.load`` + ``load_state_dict`` into a fresh plain model.
  Weights only: it holds no optimizer state and cannot resume training (see the disk column).
- ``FSDP2 + DCP``: ``fully_shard`` on each block and the root, ``torch.optim.AdamW``; save =
  ``get_state_dict(model, optimizer)`` + ``dcp.save``; load = on a fresh FSDP2 model and optimizer,
  ``get_state_dict`` (which creates the optimizer state) + ``dcp.load`` + ``set_state_dict``.
- ``zcompile, checksums`` and ``zcompile, no checksums`` (``--routes checksums``): one stage-3 model
  saved and loaded with the checksum record (hashed after the save, verified before the load) and
  without (``checksums=False``, ``verify_checksums=False``), alternating within each repetition.
- ``zcompile, base frozen`` and ``zcompile, frozen base left out`` (``--routes frozen``): a
  fine-tuning run's model, every weight frozen but the last block's (LoRA's proportion is smaller
  still), the optimizer over that block; saved by ``zcompile.checkpoint.save`` with and without
  ``exclude_frozen_parameters=True`` and loaded into a fresh model built from the same weights.

Every load goes into a model built (and, for FSDP2, sharded) outside the measured region, and is
checked: the parameters (and for the DCP routes the optimizer state) sum, in float64 over every
rank, to exactly the trained model's sums.

What is measured, per rank, per repetition (a barrier before each):

- **time**: wall clock of the call. A row's figure is the median over repetitions of the slowest
  rank's time. Files are written with an ``fsync`` on every route (DCP's ``FileSystemWriter``
  syncs by default; the ``torch.save`` baseline calls ``os.fsync``), and loads read files just
  written, so they come from the page cache: load times are memory and CPU, not disk.
- **peak extra memory**: the kernel's high-water mark of this process's resident set (``VmHWM``
  in ``/proc/self/status``), reset to the current RSS just before the call (``echo 5 >
  /proc/self/clear_refs``, Linux >= 4.0), minus the RSS at that moment. Before the reset the
  benchmark runs ``gc.collect()`` and glibc's ``malloc_trim(0)``, so freed memory the allocator
  kept is given back and a new allocation shows up as growth. It is exact for what it counts (no
  sampling), and counts everything resident: tensors, pickling buffers, gloo buffers, and pages of
  shared libraries first touched during the call (the first repetition can import modules, hence
  the median). It does not count the page cache the written files occupy (not this process's),
  and memory that was freed and re-used inside the call is counted once. Where ``clear_refs``
  cannot be written, a thread samples ``/proc/self/statm`` every millisecond instead (can miss
  short peaks); the JSON says which was used. A row's figure is the median over repetitions,
  then the largest over ranks.
- **kept**: the RSS growth still there after the load (again after ``gc.collect()`` and
  ``malloc_trim``): what the load leaves allocated, e.g. the optimizer state a fresh optimizer gets
  from it. Extra minus kept is the transient part.
- **disk**: bytes of all files of one checkpoint, every rank's together.

Ratios between routes are meaningful within one run only: the 2-core machines this runs on are
shared, and timings move by up to 30% from run to run.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

from common import print_table, start_gloo_benchmark  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

import zcompile  # noqa: E402
import zcompile.checkpoint.dcp as ckpt  # noqa: E402

LR = 3e-4
ZC, ZC_LIVE, GATHERED, FSDP = "zcompile", "zcompile, into compiled", "gathered + torch.save", "FSDP2 + DCP"
ZC_FROZEN, ZC_FROZEN_OUT = "zcompile, base frozen", "zcompile, frozen base left out"
ZC_CHECKSUMS, ZC_NO_CHECKSUMS = "zcompile, checksums", "zcompile, no checksums"
ROUTES = ("zcompile", "fsdp2", "frozen", "checksums")
# what a route's ratios are to: zcompile's checkpoint, or the same model saved the other way
_COMPARED_WITH = {ZC_FROZEN_OUT: ZC_FROZEN, ZC_CHECKSUMS: ZC_NO_CHECKSUMS}


# ----------------------------------------------------------------------------- memory
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        return int(re.search(rf"^{field}:\s+(\d+) kB", handle.read(), re.MULTILINE).group(1))


def _can_reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


class PeakExtra:
    """``with PeakExtra(exact) as m: ...`` then ``m.bytes``: peak RSS during the block minus RSS before;
    ``m.kept``: RSS after the block (freed memory given back first) minus RSS before."""

    def __init__(self, exact: bool):
        self.exact = exact
        self.bytes = self.kept = 0

    def __enter__(self):
        gc.collect()
        _trim()
        self.before = _status_kib("VmRSS")
        if self.exact:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")  # VmHWM := current RSS
        else:
            self.peak, self.stop = self.before, threading.Event()
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self) -> None:
        page_kib = os.sysconf("SC_PAGE_SIZE") // 1024
        while not self.stop.is_set():
            with open("/proc/self/statm") as handle:
                self.peak = max(self.peak, int(handle.read().split()[1]) * page_kib)
            time.sleep(0.001)

    def __exit__(self, *exc):
        if self.exact:
            peak = _status_kib("VmHWM")
        else:
            self.stop.set()
            self.thread.join()
            peak = max(self.peak, _status_kib("VmRSS"))
        self.bytes = max(0, peak - self.before) * 1024
        gc.collect()
        _trim()
        self.kept = max(0, _status_kib("VmRSS") - self.before) * 1024
        return False


def _trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to give back
        pass


# ----------------------------------------------------------------------------- models
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["4x128", "8x256", "8x512"], help="n_layer x n_embd")
    parser.add_argument("--repeats", type=int, default=3, help="saves and loads per route (median)")
    parser.add_argument("--train-steps", type=int, default=2, help="AdamW steps before the first save")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank in those steps")
    parser.add_argument(
        "--routes",
        nargs="+",
        choices=ROUTES,
        default=list(ROUTES),
        help="zcompile: its checkpoints and gathered + torch.save; fsdp2; frozen: a frozen base; "
        "checksums: zcompile's with and without them",
    )
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    parser.add_argument("--out", default=None, help="JSON results (default benchmarks/results/checkpoint_N.json)")
    return parser.parse_args()


def gpt_config(size: str) -> GPTConfig:
    layers, embd = (int(v) for v in size.split("x"))
    return GPTConfig(vocab_size=512, block_size=64, n_layer=layers, n_head=4, n_embd=embd)


def new_model(config: GPTConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(config)


def new_model_and_optimizer(config: GPTConfig) -> tuple[GPT, torch.optim.Optimizer]:
    model = new_model(config)
    return model, zcompile.optim.AdamW(model.parameters(), lr=LR)


def fsdp2(config: GPTConfig, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = new_model(config)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def train(model, optimizer, config: GPTConfig, args, rank: int, world: int) -> None:
    for step in range(args.train_steps):
        tokens, targets = synthetic_batch(step, args.batch * world, config)
        local = slice(rank * args.batch, (rank + 1) * args.batch)
        model(tokens[local], targets[local]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def param_sums(model: torch.nn.Module, sharded: bool) -> list[float]:
    """float64 sum of each parameter: of the full tensor, or (``sharded``) of every rank's piece."""
    sums = torch.tensor([_local(p.detach()).double().sum().item() for p in model.parameters()], dtype=torch.float64)
    if sharded:
        dist.all_reduce(sums)
    return sums.tolist()


def optim_sums(optimizer) -> list[float]:
    """float64 sum of each state tensor (exp_avg, exp_avg_sq) over every rank's piece (padding is zero)."""
    states = [optimizer.state[p] for group in optimizer.param_groups for p in group["params"] if p in optimizer.state]
    values = [
        _local(v).double().sum().item()
        for state in states
        for k, v in sorted(state.items())
        if isinstance(v, torch.Tensor) and k != "step"
    ]
    sums = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(sums)
    return sums.tolist()


# ----------------------------------------------------------------------------- measuring
def measure(fn, exact: bool) -> tuple[float, int, int]:
    """Seconds, peak extra bytes and kept bytes of ``fn()`` on this rank, started together on every rank."""
    dist.barrier()
    with PeakExtra(exact) as memory:
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
    return seconds, memory.bytes, memory.kept


def disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def summarize(name: str, size: str, numel: int, saves, loads, disk: int, world: int) -> dict:
    """Per-rank lists of (seconds, peak bytes, kept bytes) per repetition -> the row (slowest rank, largest
    memory)."""

    def times(samples):
        if not samples:
            return None, []
        slowest = torch.tensor([s for s, _, _ in samples], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return 1e3 * statistics.median(slowest.tolist()), slowest.mul(1e3).tolist()

    def memory(samples, which=1):
        if not samples:
            return None, []
        everyone = [None] * world
        dist.all_gather_object(everyone, statistics.median(sample[which] for sample in samples))
        return max(everyone), everyone

    save_ms, save_ms_reps = times(saves)
    load_ms, load_ms_reps = times(loads)
    save_extra, save_extra_ranks = memory(saves)
    load_extra, load_extra_ranks = memory(loads)
    load_kept, load_kept_ranks = memory(loads, which=2)
    return {
        "size": size,
        "params": numel,
        "method": name,
        "save_ms": save_ms,
        "load_ms": load_ms,
        "save_ms_per_repeat": save_ms_reps,
        "load_ms_per_repeat": load_ms_reps,
        "save_extra_bytes": save_extra,
        "load_extra_bytes": load_extra,
        "save_extra_bytes_per_rank": save_extra_ranks,
        "load_extra_bytes_per_rank": load_extra_ranks,
        "load_kept_bytes": load_kept,
        "load_kept_bytes_per_rank": load_kept_ranks,
        "disk_bytes": disk,
    }


def fresh_dir(root: str, name: str) -> str:
    """An empty directory every rank agrees on (rank 0 makes it; the others wait)."""
    path = os.path.join(root, name)
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    dist.barrier()
    return path


def trained_at_stage_3(model, optimizer, config, args, rank, world):
    """``model`` compiled at stage 3 and trained; the parameter and optimizer-state sums a checkpoint
    of it must give back."""
    compiled = torch.compile(model, backend="zero", options={"stage": 3})
    train(compiled, optimizer, config, args, rank, world)
    with zcompile.gathered(model):
        expected = param_sums(model, sharded=False)
    return compiled, (expected, optim_sums(optimizer))


def zcompile_saves_and_loads(name, compiled, optimizer, build, expected, args, root, exact, **save_options):
    """``--repeats`` saves by ``zcompile.checkpoint.save`` (``save_options``), each into a fresh
    directory, then as many loads of the last into fresh models and optimizers from ``build()``, each
    checked against ``expected``; the measurements and the checkpoint's path."""
    saves, path = [], None
    for rep in range(args.repeats):
        path = fresh_dir(root, f"{name}_{rep}")
        saves.append(measure(lambda path=path: ckpt.save(path, compiled, optimizer, **save_options), exact))
    loads = []
    for _ in range(args.repeats):
        fresh, fresh_opt = build()
        loads.append(measure(lambda m=fresh, o=fresh_opt: ckpt.load(path, m, o), exact))
        assert param_sums(fresh, sharded=False) == expected[0], f"{name}: parameters differ after the load"
        assert optim_sums(fresh_opt) == expected[1], f"{name}: optimizer state differs after the load"
        del fresh, fresh_opt
    return saves, loads, path


def bench_zcompile(config, size, args, rank, world, root, exact) -> list[dict]:
    """Routes ``zcompile``, ``zcompile, into compiled`` and ``gathered + torch.save`` on one stage-3 model."""
    torch._dynamo.reset()

    fresh_model = functools.partial(new_model_and_optimizer, config)

    model, optimizer = fresh_model()
    compiled, sums = trained_at_stage_3(model, optimizer, config, args, rank, world)
    expected = sums[0]
    numel = sum(p.numel() for p in model.parameters())
    saves, loads, path = zcompile_saves_and_loads("zc", compiled, optimizer, fresh_model, sums, args, root, exact)
    disk = disk_bytes(path)
    live = [measure(lambda: ckpt.load(path, compiled, optimizer), exact) for _ in range(args.repeats)]
    with zcompile.gathered(model):
        assert param_sums(model, sharded=False) == expected, "load into the compiled model: parameters differ"
    rows = [
        summarize(ZC, size, numel, saves, loads, disk, world),
        summarize(ZC_LIVE, size, numel, saves, live, disk, world),
    ]

    def torch_save(path):
        with zcompile.gathered(model), open(os.path.join(path, f"rank{rank}.pt"), "wb") as handle:
            torch.save(model.state_dict(), handle)
            handle.flush()
            os.fsync(handle.fileno())  # as DCP's writer does

    saves = []
    for rep in range(args.repeats):
        path = fresh_dir(root, f"gathered_{rep}")
        saves.append(measure(lambda path=path: torch_save(path), exact))
    dist.barrier()
    disk = disk_bytes(path)
    loads = []
    for _ in range(args.repeats):
        plain = new_model(config)
        file = os.path.join(path, f"rank{rank}.pt")
        loads.append(
            measure(
                lambda m=plain, f=file: m.load_state_dict(torch.load(f, map_location="cpu", weights_only=True)), exact
            )
        )
        assert param_sums(plain, sharded=False) == expected, "torch.load: parameters differ"
        del plain
    rows.append(summarize(GATHERED, size, numel, saves, loads, disk, world))
    return rows


def bench_frozen(config, size, args, rank, world, root, exact) -> list[dict]:
    """A stage-3 model frozen but for its last block, saved with and without its frozen base."""
    torch._dynamo.reset()

    def frozen_model():
        model = new_model(config)
        for name, param in model.named_parameters():
            param.requires_grad_(name.startswith(f"blocks.{config.n_layer - 1}."))
        return model, zcompile.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)

    model, optimizer = frozen_model()
    compiled, sums = trained_at_stage_3(model, optimizer, config, args, rank, world)
    numel = sum(p.numel() for p in model.parameters())
    rows = []
    for method, exclude in ((ZC_FROZEN, False), (ZC_FROZEN_OUT, True)):
        saves, loads, path = zcompile_saves_and_loads(
            f"frozen_{exclude}",
            compiled,
            optimizer,
            frozen_model,
            sums,
            args,
            root,
            exact,
            exclude_frozen_parameters=exclude,
        )
        rows.append(summarize(method, size, numel, saves, loads, disk_bytes(path), world))
    return rows


def bench_checksums(config, size, args, rank, world, root, exact) -> list[dict]:
    """One stage-3 model saved and loaded with checksums (the default: hashed after the save, verified
    before the load) and without (``checksums=False``, ``verify_checksums=False``), in turn within
    each repetition so that the machine's drift falls on both alike."""
    torch._dynamo.reset()

    fresh_model = functools.partial(new_model_and_optimizer, config)

    model, optimizer = fresh_model()
    compiled, sums = trained_at_stage_3(model, optimizer, config, args, rank, world)
    numel = sum(p.numel() for p in model.parameters())
    samples = {True: ([], []), False: ([], [])}
    path = None
    for rep in range(args.repeats):
        for on in (True, False) if rep % 2 == 0 else (False, True):
            path = fresh_dir(root, f"checksums_{on}_{rep}")
            saves, loads = samples[on]
            saves.append(measure(lambda p=path, on=on: ckpt.save(p, compiled, optimizer, checksums=on), exact))
            fresh, fresh_opt = fresh_model()
            loads.append(
                measure(lambda p=path, m=fresh, o=fresh_opt, on=on: ckpt.load(p, m, o, verify_checksums=on), exact)
            )
            assert param_sums(fresh, sharded=False) == sums[0], "parameters differ after the load"
            assert optim_sums(fresh_opt) == sums[1], "optimizer state differs after the load"
            del fresh, fresh_opt
    disk = disk_bytes(path)
    return [
        summarize(ZC_CHECKSUMS, size, numel, *samples[True], disk, world),
        summarize(ZC_NO_CHECKSUMS, size, numel, *samples[False], disk, world),
    ]


def bench_fsdp2(config, size, args, rank, world, root, exact) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = fsdp2(config, world)
    train(model, optimizer, config, args, rank, world)
    numel = sum(p.numel() for p in model.parameters())
    expected, expected_optim = param_sums(model, sharded=True), optim_sums(optimizer)

    def save(path):
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

    saves, path = [], None
    for rep in range(args.repeats):
        path = fresh_dir(root, f"fsdp2_{rep}")
        saves.append(measure(lambda path=path: save(path), exact))
    disk = disk_bytes(path)

    def load(fresh, fresh_opt):
        msd, osd = get_state_dict(fresh, fresh_opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    loads = []
    for _ in range(args.repeats):
        fresh, fresh_opt = fsdp2(config, world)
        loads.append(measure(lambda m=fresh, o=fresh_opt: load(m, o), exact))
        assert param_sums(fresh, sharded=True) == expected, "FSDP2 + DCP load: parameters differ"
        assert optim_sums(fresh_opt) == expected_optim, "FSDP2 + DCP load: optimizer state differs"
        del fresh, fresh_opt
    return summarize(FSDP, size, numel, saves, loads, disk, world)


# ----------------------------------------------------------------------------- report
def mib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f}"


def ms(value) -> str:
    return "-" if value is None else f"{value:.0f}"


def print_tables(rows: list[dict], setup: str) -> dict:
    """The table on rank 0; returns each route's ratios to ``zcompile`` per size (the frozen base left
    out: to the same model saved whole)."""
    ratios, table = {}, []
    for row in rows:
        base = next(
            (r for r in rows if r["size"] == row["size"] and r["method"] == _COMPARED_WITH.get(row["method"], ZC)),
            None,
        )
        full = 4 * row["params"]
        table.append(
            (
                f"{row['size']} ({row['params'] / 1e6:.1f}M)",
                row["method"],
                ms(row["save_ms"]),
                ms(row["load_ms"]),
                mib(row["save_extra_bytes"]),
                mib(row["load_extra_bytes"]),
                mib(row["load_kept_bytes"]),
                mib(row["disk_bytes"]),
                f"{row['save_extra_bytes'] / full:.2f}",
                f"{row['load_extra_bytes'] / full:.2f}",
            )
        )
        if base is not None and base is not row and row["method"] != ZC_FROZEN:
            keys = (
                ("load_ms", "load_extra_bytes", "load_kept_bytes")
                if row["method"] == ZC_LIVE
                else ("save_ms", "load_ms", "save_extra_bytes", "load_extra_bytes", "load_kept_bytes", "disk_bytes")
            )
            for key in keys:  # the into-compiled row repeats zcompile's save
                if row[key] is not None and base[key]:
                    ratios[f"{row['size']} {key} {row['method']} / {base['method']}"] = row[key] / base[key]
    print_table(
        f"Checkpoint save and load per rank (time: median of repeats, slowest rank; extra: peak RSS "
        f"growth, largest rank; kept: RSS growth left after the load; disk: all ranks' files; x model: "
        f"extra / fp32 model bytes), {setup}",
        (
            "LxE (params)",
            "route",
            "save ms",
            "load ms",
            "save extra MiB",
            "load extra MiB",
            "load kept MiB",
            "disk MiB",
            "save x model",
            "load x model",
        ),
        table,
    )
    return ratios


def main() -> None:
    args = parse_args()
    rank, world, cores = start_gloo_benchmark()
    exact = _can_reset_peak()
    setup = f"{world} gloo ranks on {cores} CPU cores, 1 thread/rank"
    load = os.getloadavg()[0]
    root = (args.dir or tempfile.mkdtemp(prefix="zcompile_bench_checkpoint_")) if rank == 0 else None
    holder = [root]
    dist.broadcast_object_list(holder)
    root = holder[0]
    if rank == 0:
        print(
            f"bench_checkpoint: {setup}; torch {torch.__version__}; sizes {args.sizes}; {args.repeats} repeats; "
            f"memory by {'VmHWM reset' if exact else 'sampling statm'}; load average {load:.1f}; in {root}",
            flush=True,
        )
    start, rows = time.perf_counter(), []
    for size in args.sizes:
        config = gpt_config(size)
        if "zcompile" in args.routes:
            rows += bench_zcompile(config, size, args, rank, world, root, exact)
        if "fsdp2" in args.routes:
            rows.append(bench_fsdp2(config, size, args, rank, world, root, exact))
        if "frozen" in args.routes:
            rows += bench_frozen(config, size, args, rank, world, root, exact)
        if "checksums" in args.routes:
            rows += bench_checksums(config, size, args, rank, world, root, exact)
        if rank == 0:
            print(f"  {size}: done [{time.perf_counter() - start:.0f}s]", flush=True)
    dist.barrier()
    if rank == 0:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
        ratios = print_tables(rows, setup)
        out = args.out or os.path.join(HERE, "results", f"checkpoint_{world}.json")
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as handle:
            json.dump(
                {
                    "setup": setup,
                    "world": world,
                    "cpu_cores": cores,
                    "torch": torch.__version__,
                    "memory_measure": "VmHWM reset by clear_refs" if exact else "statm sampled every 1 ms",
                    "load_average_start_end": [load, os.getloadavg()[0]],
                    "args": vars(args),
                    "ratios": ratios,
                    "results": rows,
                },
                handle,
                indent=1,
            )
        print(
            f"wrote {out} ({time.perf_counter() - start:.0f}s, load average {os.getloadavg()[0]:.1f} at end)",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
