"""A launcher that runs a function on N gloo ranks in fresh processes, with a timeout (never a hang).

The processes are forked from multiprocessing's fork server (spawned where there is none): each
unpickles ``fn`` (and its arguments) by qualified name, e.g. ``support.training.zero_run_on_rank``
or ``test_errors._train_divergent``, so ``fn`` must be a module-level function. The server starts
with the parent's ``sys.path`` (multiprocessing's preparation data), which holds ``tests/``
(``conftest.py`` puts it there), so ``support.*`` and the test modules import in a rank as they do
in the parent.
"""

from __future__ import annotations

import faulthandler
import os
import random
import signal
import socket
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    """A port rank 0's store can bind a moment later. Taken below the kernel's ephemeral range, in a
    block of its own per pytest-xdist worker: a port the kernel handed out (``bind(0)``) could be
    handed out again in that moment, to gloo's sockets or to the other worker's launch, and rank 0
    would fail with "address already in use"."""
    ephemeral_low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            ephemeral_low = int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    block = 2000
    low = max(1024, ephemeral_low - block * ((int(worker) if worker.isdigit() else 0) % 8 + 1))
    for port in random.sample(range(low, low + block), 50):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # every one taken: let the kernel choose
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init_process_group(rank: int, world: int, port: int, store_in_parent: bool) -> None:
    # the collectives' timeout; a test of what happens at it sets a short one through run_ranks(env=...)
    timeout = timedelta(seconds=float(os.environ.get("ZCOMPILE_TEST_PG_TIMEOUT_S", "120")))
    if not store_in_parent:  # rank 0 hosts the store (env://)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        return
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


def _rank_entry(
    rank: int, world: int, port: int, fn, args, out_dir: str, env: dict[str, str], store_in_parent: bool
) -> None:
    # the launching process's environment now (the fork server's is the one it had when the server
    # started: a variable a test set since, or unset, would be missed), then the launch's own
    os.environ.clear()
    os.environ.update(
        env,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    dist.set_debug_level_from_env()  # torch read TORCH_DISTRIBUTED_DEBUG when it was imported, before env
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    # a crash (a signal, not an exception) leaves no result: every thread's Python stack goes to a file
    # the parent reads into its error, so CI's log says where (a gloo thread or ours, which op)
    fault_log = open(os.path.join(out_dir, f"rank{rank}.fault"), "w")
    faulthandler.enable(fault_log, all_threads=True)
    try:
        _init_process_group(rank, world, port, store_in_parent)
        result = fn(rank, world, *args)
        torch.save({"ok": result}, path)
    except BaseException as error:  # report any failure to the parent instead of hanging it
        torch.save({"error": f"{type(error).__name__}: {error}\n{traceback.format_exc()}"}, path)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _no_result(exitcode: int | None, fault_path: str) -> str:
    """What a rank that wrote no result died of: its exit code or signal, and the stacks faulthandler
    wrote when it was a crash."""
    if exitcode is not None and exitcode < 0:
        how = f"killed by {signal.Signals(-exitcode).name}"
    else:
        how = f"exit code {exitcode}"
    stacks = ""
    if os.path.exists(fault_path):
        with open(fault_path) as fault:
            stacks = fault.read().strip()
    return f"no result ({how})" + (f"; faulthandler:\n{stacks}" if stacks else "")


# What the fork server imports once, so each rank starts with it loaded. A rank from a bare
# interpreter spends 3-4 s of CPU importing torch, about 2 s more in what its first compile imports
# (Dynamo's backend registry, AOTAutograd's partitioner and the inductor decompositions and
# lowerings it reads, the zero backend, the optimizer) and 4 s in the transformers models; the suite
# starts about 100 ranks. The first of two identical 2-rank GPT runs in one launch took 4.45 s with
# only torch, Dynamo, AOTAutograd and zcompile loaded, 2.77 s with this list (the second: 1.63-1.86).
# Top-level names only: the server imports them before it has the launcher's ``sys.path`` (each rank
# gets it), so ``support.*`` is not importable there; a module that is not importable is skipped
# (multiprocessing ignores its ImportError: transformers may be absent).
# Tried 2026-11-29 and not kept: a warm-up in the server (a stage-1 and a stage-3 step of the GPT on a
# world of one, then gc.freeze()) so that each rank inherits what a first compile fills. Six 2-rank
# launches of one compile each took 19.2 / 18.4 s without it and 20.7 / 20.7 s with it, and the
# server started 4 s later (a rank's first compile was 0.4-0.6 s shorter with it; the launches were not).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch._functorch.aot_autograd",
    "torch._functorch.partitioners",
    "functorch.compile",
    "torch._dynamo.backends.common",
    "torch._dynamo.backends.distributed",
    "torch._dynamo.backends.inductor",
    "torch._dynamo.repro.after_aot",
    "torch._dynamo.repro.after_dynamo",
    "torch._inductor.lowering",
    "torch._inductor.decomposition",
    "torch._inductor.pattern_matcher",
    "torch._functorch._aot_autograd.subclass_codegen",
    "torch._higher_order_ops.passes.inline_invoke_subgraph",
    "torch.distributed.tensor.experimental",
    "torch.fx.experimental.validator",
    "torch.export._trace",
    "zcompile",
    "zcompile.backend.entry_point",
    "zcompile.optim",
    "zcompile.optim.clip",
    "zcompile.eager.gathered",
    "zcompile.predict.estimate",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
]


def _rank_context() -> mp.context.BaseContext:
    """Fresh processes forked from one server that has imported torch (``forkserver``), where the
    platform has it; else spawned. Neither inherits this process's state (threads, pytest, Dynamo's
    caches): the server is started clean, imports ``_PRELOAD`` and forks each rank from that. A
    variable read at import (``TRITON_INTERPRET``, by the kernels' decorators) has the value it had
    when the server started: ``conftest.py`` sets it before the first launch."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    _start_forkserver_outside_the_repository()
    return context


def _start_forkserver_outside_the_repository() -> None:
    """Starts the fork server (once) from the temporary directory: it imports ``_PRELOAD`` with the
    directory it starts in on its path, and from the repository root ``kernels/`` would shadow the
    ``kernels`` package transformers imports (``conftest.py`` drops the root from this process's path)."""
    import multiprocessing.forkserver

    here = os.getcwd()
    os.chdir(tempfile.gettempdir())
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.chdir(here)


def run_ranks(
    world: int,
    fn: Callable,
    *args: Any,
    timeout_s: float = 300,
    env: dict[str, str] | None = None,
    store_in_parent: bool = True,
) -> list:
    """Runs ``fn(rank, world, *args)`` on ``world`` fresh gloo processes; returns each rank's result.

    ``env``: variables set in each rank's environment before ``init_process_group`` (e.g.
    ``TORCH_DISTRIBUTED_DEBUG``, which torch reads there). ``store_in_parent`` (default): the key-value
    store is hosted by this process, as torchrun's agent hosts it, so it outlives any rank; else rank 0
    hosts it (``mp.spawn`` with ``env://``), and a rank still waiting on the store when rank 0 has
    raised and exited reads "lost the store" instead of its own error (a test that expects every
    rank's error would fail by the ranks' timing: CI met it twice).

    A rank that raises makes this raise with its traceback; ranks still alive after ``timeout_s``
    are killed and reported, so a deadlock fails the test instead of hanging the suite.
    """
    context = _rank_context()
    # held until the ranks have ended
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False) if store_in_parent else None
    port = store.port if store is not None else _free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            context.Process(
                target=_rank_entry,
                args=(r, world, port, fn, args, out_dir, {**os.environ, **(env or {})}, store_in_parent),
            )
            for r in range(world)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout_s)
        hung = [r for r, proc in enumerate(procs) if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        results, errors = [], []
        for rank in range(world):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            payload = (
                torch.load(path, weights_only=False)
                if os.path.exists(path)
                else {"error": _no_result(procs[rank].exitcode, os.path.join(out_dir, f"rank{rank}.fault"))}
            )
            if "error" in payload:
                errors.append(f"rank {rank}: {payload['error']}")
            results.append(payload.get("ok"))
    if hung:
        raise TimeoutError(f"ranks {hung} still running after {timeout_s}s (deadlock?); errors: {errors}")
    if errors:
        raise RuntimeError("\n".join(errors))
    return results
