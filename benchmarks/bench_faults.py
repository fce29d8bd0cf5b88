"""The fault table: what a user sees, and how fast, when code outside the compiled graphs goes wrong.

    python benchmarks/bench_faults.py [--out benchmarks/results/faults_2.json] [--only NAME ...]

(``--only`` reruns the rows named and keeps the others of ``--out``.)

Each fault is a fresh run of 2 gloo ranks on this machine (``tests/support/launch.run_ranks``, the
key-value store hosted outside the ranks as torchrun's agent hosts it)
training the example GPT (``examples/gpt.py``: 2 layers, n_embd 64, seq 32, batch 4 per rank) with
the default options and timeouts (``check_timeout_s`` 60 s). One rank misbehaves the way real
training loops do; every rank records what it ended with (no error, or the exception's type and
first line) and the wall-clock seconds from the moment the first rank misbehaved to its own end
(both ranks run on this machine, so ``time.time()`` is one clock). A rank still running after
300 s is a hang and is reported as such. Run it after a change to the checks and paste the table
into the README's fault table.

The per-step cost of the checks themselves is ``bench_step_checks.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests"), os.path.join(HERE, "..", "examples")]

from common import print_table  # noqa: E402

from support.launch import run_ranks  # noqa: E402

SEQ = 32


def _model_and_batches(stage: int, options: dict | None = None, dynamic=None, lr: float = 1e-2):
    from gpt import GPT, GPTConfig

    import zcompile

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=SEQ, n_layer=2, n_head=2, n_embd=64))
    compiled = torch.compile(model, backend="zero", options={"stage": stage, **(options or {})}, dynamic=dynamic)
    optimizer = zcompile.optim.AdamW(model.parameters(), lr=lr)
    return model, compiled, optimizer


def _batch(step: int, rank: int, seq: int = SEQ):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, 256, (4, seq), generator=generator)
    return tokens, torch.roll(tokens, -1, dims=1)


def _train(compiled, optimizer, steps, rank, seq_of=lambda step: SEQ):
    for step in steps:
        loss = compiled(*_batch(step, rank, seq_of(step)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return float(loss.detach())


class Clock:
    """When the first rank misbehaved (written to a file every rank reads at the end)."""

    def __init__(self, path: str):
        self.path = path

    def mark(self) -> None:
        with open(self.path, "w") as handle:
            handle.write(repr(time.time()))

    def since(self) -> float | None:
        if not os.path.exists(self.path):
            return None
        with open(self.path) as handle:
            return time.time() - float(handle.read())


def _outcome(body, clock: Clock):
    try:
        detail = body()
        return {"result": "no error", "detail": str(detail), "seconds": clock.since()}
    except BaseException as error:  # what the user sees is the point here
        kind = type(error).__name__
        inner = getattr(error, "inner_exception", None)  # Dynamo's BackendCompilerFailed wraps the backend's error
        if inner is not None:
            kind, error = f"{kind}({type(inner).__name__})", inner
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return {"result": kind, "detail": first[:300], "seconds": clock.since()}


# -- the faults: each runs on every rank, returns this rank's outcome --------------------------------


def recompile_limit(rank, world, clock_path, stage):
    clock = Clock(clock_path)
    model, compiled, optimizer = _model_and_batches(stage, dynamic=False)

    def body():
        torch._dynamo.config.recompile_limit = 2
        _train(compiled, optimizer, range(2), rank, lambda step: 8 + 4 * step)
        if rank == 0:
            clock.mark()  # from the third sequence length on, Dynamo runs the forward eagerly
        return f"loss {_train(compiled, optimizer, range(2, 6), rank, lambda step: 8 + 4 * step):.4f}"

    return _outcome(body, clock)


def eager_weight_read(rank, world, clock_path):
    clock = Clock(clock_path)
    model, compiled, optimizer = _model_and_batches(3)
    _train(compiled, optimizer, range(1), rank)

    def body():
        clock.mark()
        return float(model.head.weight.norm())

    return _outcome(body, clock)


def gathered_on_rank0_only(rank, world, clock_path):
    import zcompile

    clock = Clock(clock_path)
    model, compiled, optimizer = _model_and_batches(3)
    _train(compiled, optimizer, range(1), rank)

    def body():
        if rank == 0:
            clock.mark()
            with zcompile.gathered(model):
                torch.save(model.state_dict(), os.path.join(os.path.dirname(clock_path), "model.pt"))
        return _train(compiled, optimizer, range(1, 3), rank)

    return _outcome(body, clock)


def step_skipped_on_one_rank(rank, world, clock_path, stage, compiler="eager"):
    clock = Clock(clock_path)
    model, compiled, optimizer = _model_and_batches(stage, {"compiler": compiler})

    def body():
        for step in range(4):
            loss = compiled(*_batch(step, rank))
            if step == 1 and rank == 0:  # `if not torch.isfinite(loss): continue` on one rank
                clock.mark()
                continue
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return float(loss.detach())

    return _outcome(body, clock)


def teacher_update_skipped_on_one_rank(rank, world, clock_path, stage, other_model: bool = False):
    """A momentum teacher (``zcompile.lerp_weights_`` after each step): at step 1 rank 1 skips its
    update, or (``other_model``) updates an EMA copy in its place with the same weight."""
    import copy

    import zcompile

    clock = Clock(clock_path)
    model, compiled, optimizer = _model_and_batches(stage)
    teacher, ema = (copy.deepcopy(model).requires_grad_(False) for _ in range(2))

    def body():
        for step in range(4):
            _train(compiled, optimizer, [step], rank)
            if step == 1 and rank == 1:
                clock.mark()
                if other_model:
                    zcompile.lerp_weights_(ema, model, 0.1)
                continue
            zcompile.lerp_weights_(teacher, model, 0.1)
            if step == 0:
                zcompile.lerp_weights_(ema, model, 0.1)  # numbered after the teacher, on every rank
        return "trained"

    return _outcome(body, clock)


def layerdrop_per_rank(rank, world, clock_path, stage, keep_at_step_1):
    """Blocks compiled one by one (the FSDP2 habit), LayerDrop drawn per rank: at step 1 rank r runs
    the layers ``keep_at_step_1[r]``, every layer at the other steps."""
    from gpt import GPT, GPTConfig

    import zcompile

    clock = Clock(clock_path)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=SEQ, n_layer=2, n_head=2, n_embd=64))
    for block in model.blocks:
        block.compile(backend="zero", options={"stage": stage})
    optimizer = zcompile.optim.AdamW(model.parameters(), lr=1e-2)

    def forward(tokens, targets, keep):
        x = model.wte(tokens) + model.wpe(torch.arange(tokens.shape[1]))
        for block, kept in zip(model.blocks, keep):
            x = block(x) if kept else x
        logits = model.head(model.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    def body():
        for step in range(4):
            keep = keep_at_step_1[rank] if step == 1 else [True, True]
            if step == 1 and rank == 0:
                clock.mark()
            loss = forward(*_batch(step, rank), keep)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return float(loss.detach())

    return _outcome(body, clock)


def eval_on_rank0_only(rank, world, clock_path, stage):
    clock = Clock(clock_path)
    model, compiled, optimizer = _model_and_batches(stage)
    _train(compiled, optimizer, range(1), rank)

    def body():
        if rank == 0:
            clock.mark()
            with torch.no_grad():
                compiled(*_batch(100, rank))
        return _train(compiled, optimizer, range(1, 3), rank)

    return _outcome(body, clock)


def checkpoint_on_rank0_only(rank, world, clock_path, stage):
    import zcompile.checkpoint

    clock = Clock(clock_path)
    model, compiled, optimizer = _model_and_batches(stage)
    _train(compiled, optimizer, range(1), rank)

    def body():
        if rank == 0:  # DDP's habit: the checkpoint written by rank 0 alone
            clock.mark()
            zcompile.checkpoint.save(os.path.join(os.path.dirname(clock_path), f"ckpt_{stage}"), model, optimizer)
        return _train(compiled, optimizer, range(1, 3), rank)

    return _outcome(body, clock)


def busy_rank0(rank, world, clock_path, stage, busy_s):
    clock = Clock(clock_path)
    model, compiled, optimizer = _model_and_batches(stage)
    _train(compiled, optimizer, range(1), rank)

    def body():
        if rank == 0:  # work of its own past check_timeout_s: an evaluation, a checkpoint written by rank 0
            clock.mark()
            time.sleep(busy_s)
        return _train(compiled, optimizer, range(1, 3), rank)

    return _outcome(body, clock)


def shape_change_on_one_rank(rank, world, clock_path):
    clock = Clock(clock_path)
    model, compiled, optimizer = _model_and_batches(2, dynamic=False)
    _train(compiled, optimizer, range(1), rank)

    def body():
        if rank == 0:
            clock.mark()
        return _train(compiled, optimizer, range(1, 3), rank, lambda step: SEQ // 2 if rank == 0 else SEQ)

    return _outcome(body, clock)


def uneven_epoch_then_barrier(rank, world, clock_path, stage):
    """Rank 0 has one batch fewer (data of uneven length), then every rank calls ``dist.barrier()``.
    Rank 0's process may end (``zcompile.agreement.mismatch_watch``): each rank's outcome is also written to a
    file, which ``run_fault`` reads when a rank left no result."""
    import torch.distributed as dist

    clock = Clock(clock_path)
    model, compiled, optimizer = _model_and_batches(stage)

    def body():
        _train(compiled, optimizer, range(2 if rank == 0 else 3), rank)
        if rank == 0:
            clock.mark()
        dist.barrier()
        return "both passed the barrier"

    outcome = _outcome(body, clock)
    with open(f"{clock_path}.rank{rank}", "w") as handle:
        json.dump(outcome, handle)
    return outcome


def nan_on_one_rank(rank, world, clock_path):
    import zcompile

    clock = Clock(clock_path)
    model, compiled, _ = _model_and_batches(2)
    optimizer = zcompile.optim.AdamW(model.parameters(), lr=1e-2, skip_nonfinite=True)

    def body():
        for step in range(3):
            loss = compiled(*_batch(step, rank))
            if step == 1 and rank == 0:
                clock.mark()
                loss = loss * float("nan")
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        digest = sum(float(p.double().sum()) for p in model.parameters())
        return f"skipped {optimizer.skipped_steps} step(s); parameter sum {digest:.6f}"

    return _outcome(body, clock)


FAULTS = {
    "recompile limit, stage 2": (recompile_limit, 2),
    "recompile limit, stage 3": (recompile_limit, 3),
    "stage-3 weight read outside gathered()": (eager_weight_read,),
    "gathered() on rank 0 only": (gathered_on_rank0_only,),
    "step skipped on one rank, stage 1": (step_skipped_on_one_rank, 1),
    "step skipped on one rank, stage 2": (step_skipped_on_one_rank, 2),
    "step skipped on one rank, stage 3": (step_skipped_on_one_rank, 3),
    "LayerDrop per rank (layer 0 on rank 0, layer 1 on rank 1), blocks compiled apart, stage 1": (
        layerdrop_per_rank,
        1,
        [[True, False], [False, True]],
    ),
    "LayerDrop per rank (layer 0 on rank 0, layer 1 on rank 1), blocks compiled apart, stage 3": (
        layerdrop_per_rank,
        3,
        [[True, False], [False, True]],
    ),
    "LayerDrop per rank (a layer fewer on rank 1), blocks compiled apart, stage 3": (
        layerdrop_per_rank,
        3,
        [[True, True], [True, False]],
    ),
    "eval on rank 0 only (no_grad), stage 2": (eval_on_rank0_only, 2),
    "eval on rank 0 only (no_grad), stage 3": (eval_on_rank0_only, 3),
    "input shape changes on one rank, stage 2": (shape_change_on_one_rank,),
    "NaN loss on one rank, skip_nonfinite": (nan_on_one_rank,),
    "step skipped on one rank, stage 3, inductor": (step_skipped_on_one_rank, 3, "inductor"),
    "zcompile.checkpoint.save on rank 0 only, stage 1": (checkpoint_on_rank0_only, 1),
    "zcompile.checkpoint.save on rank 0 only, stage 2": (checkpoint_on_rank0_only, 2),
    "zcompile.checkpoint.save on rank 0 only, stage 3": (checkpoint_on_rank0_only, 3),
    "rank 0 busy 90 s between steps, stage 1": (busy_rank0, 1, 90.0),
    "rank 0 one batch short, then dist.barrier(), stage 2": (uneven_epoch_then_barrier, 2),
    "rank 0 one batch short, then dist.barrier(), stage 3": (uneven_epoch_then_barrier, 3),
    "teacher update (lerp_weights_) skipped on one rank, stage 2": (teacher_update_skipped_on_one_rank, 2),
    "teacher update (lerp_weights_) skipped on one rank, stage 3": (teacher_update_skipped_on_one_rank, 3),
    "EMA updated in the teacher's place on one rank, stage 3": (teacher_update_skipped_on_one_rank, 3, True),
}


def run_fault(name: str, out_dir: str) -> list[dict]:
    fn, *args = FAULTS[name]
    clock_path = os.path.join(out_dir, name.replace(" ", "_").replace("/", "_") + ".clock")
    try:
        return run_ranks(2, fn, clock_path, *args, timeout_s=300, store_in_parent=True)  # as under torchrun
    except TimeoutError as error:
        return [{"result": "HANG", "detail": str(error)[:300], "seconds": 300.0}] * 2
    except RuntimeError as error:  # a rank left no result: its process ended (what the others saw is in files)
        outcomes = []
        for rank in range(2):
            path = f"{clock_path}.rank{rank}"
            if os.path.exists(path):
                with open(path) as handle:
                    outcomes.append(json.load(handle))
            else:
                ended = next((line for line in str(error).splitlines() if line.startswith(f"rank {rank}: ")), "")
                outcomes.append({"result": "process ended", "detail": ended[:300], "seconds": None})
        return outcomes


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "faults_2.json"))
    parser.add_argument("--only", nargs="*", default=None, help="names of FAULTS to run (default: all)")
    args = parser.parse_args()
    results = {}
    if args.only and args.out and os.path.exists(args.out):  # the rows rerun replace theirs; the others stay
        with open(args.out) as handle:
            results = json.load(handle)["faults"]
    with tempfile.TemporaryDirectory() as out_dir:
        for name in args.only or FAULTS:
            results[name] = run_fault(name, out_dir)
            if args.out:  # after each fault: a later crash keeps what was measured
                with open(args.out, "w") as handle:
                    json.dump(
                        {"torch": torch.__version__, "cores": os.cpu_count(), "faults": results}, handle, indent=1
                    )
    rows = []
    for name, ranks in results.items():
        for rank, outcome in enumerate(ranks):
            seconds = "" if outcome["seconds"] is None else f"{outcome['seconds']:.1f}"
            rows.append(
                (
                    name if rank == 0 else "",
                    str(rank),
                    outcome["result"],
                    seconds,
                    outcome["detail"][:110].replace("[", "("),
                )
            )
    print_table("faults, 2 gloo ranks, default timeouts", ("fault", "rank", "ends with", "s", "first line"), rows)


if __name__ == "__main__":
    main()
