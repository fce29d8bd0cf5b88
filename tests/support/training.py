"""Training runs: a zero-backend training loop on this rank, single-process references, and the
comparison of a run with its reference.

``assert_same_training`` tolerances (fp32, eager inner compiler):

- SGD runs are compared with a single forward over the global batch. The only differences are
  summation orders (the batch mean split across ranks, matmul reductions over fewer rows), about
  1e-7 relative per gradient, which SGD passes on linearly: 1e-6 of the parameters' scale bounds it.
- AdamW runs (eps=1e-6, see ``_optimizer``) are compared with a reference that splits the global
  batch like the ranks do and averages gradients, so the arithmetic is the same up to the order of
  the cross-rank sum. Adam divides by sqrt(v)+eps, so an absolute gradient error e moves an element
  by at most lr*e/eps per step; gradients whose terms cancel carry e up to ~1e-9 here (1e-7
  relative to terms of ~1e-2), hence atol = steps*lr*1e-9/eps (3e-5 for 3 steps at lr 1e-2). A
  wrong shard, a missing reduction or a stale parameter moves elements by ~lr per step and fails
  it. Adam is blind to a wrong gradient scale; the SGD runs catch that.
- Losses: 1e-6 relative.

Clipped runs (``RunSpec.clip``) clip the averaged gradient before each step, the reference with
``torch.nn.utils.clip_grad_norm_`` on its global-batch gradient; ``RunResult.grad_norms`` holds
the pre-clip norms. The norms differ by the summation orders above (about 1e-7 relative), and
the clip coefficient with them, so the tolerances above hold for clipped runs too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import zcompile
from support.graph_facts import graph_facts
from support.models import build_model, global_batch, model_loss
from zcompile.common.comm_volume import step_collectives

LOSS_RTOL = 1e-6
PARAM_TOL = 1e-6
ADAM_EPS = 1e-6  # the eps of the AdamW runs (_optimizer)
GRAD_ABS_ERROR = 1e-9


@dataclass
class RunSpec:
    model: str = "gpt"
    stage: int = 3
    steps: int = 3
    batch_size: int = 8
    optimizer: str = "adamw"  # adamw | sgd
    lr: float = 1e-2
    grad_accum: int = 1  # backward calls per optimizer step (each on its own micro-batch)
    zero_grad_to_none: bool = True
    # how the zero run zeroes gradients after a step: "optimizer" (optimizer.zero_grad), "model"
    # (compiled.zero_grad, as Trainer and accelerate do) or "param" (p.grad = None for each parameter)
    zero_grad_via: str = "optimizer"
    optimizer_after_forward: bool = False
    seq_lens: tuple[int, ...] = ()  # per-step sequence length (recompiles on new shapes); () = full
    options: dict = field(default_factory=dict)
    optimizer_options: dict = field(default_factory=dict)  # extra zcompile.optim arguments (bucket_mb)
    clip: float | None = None  # max_norm of gradient clipping before each step (None: no clipping)
    clip_norm_type: float = 2.0
    # how the zero run clips: "optimizer" (optimizer.clip_grad_norm_), "option" (max_grad_norm=, 2-norm
    # only) or "torch" (torch.nn.utils.clip_grad_norm_ over model.parameters()); the reference uses torch's
    clip_via: str = "optimizer"
    dynamic: bool | None = None  # torch.compile(dynamic=...) of the zero run
    recompile_limit: int | None = None  # torch._dynamo.config.recompile_limit during the zero run (None: torch's)
    regional: bool = False  # zcompile.mark_repeated_blocks(model) before compiling
    blocks: bool = False  # each block compiled on its own (block.compile), the rest of the model eager
    # the RNG seeded before each forward by (step, micro-batch, rank): a model with dropout draws the
    # same masks for a rank's slice as the reference does for that slice (microbatch_like_ranks)
    seed_each_forward: bool = False


@dataclass
class RunResult:
    losses: list[float]
    params: dict[str, torch.Tensor]
    state_bytes: int = 0
    num_params: int = 0
    padded_numel: int = 0
    collectives: list = field(default_factory=list)
    graphs: list = field(default_factory=list)  # (forward code, backward code) per compiled graph
    facts: dict = field(default_factory=dict)  # structure of the compiled graphs, see graph_facts
    grad_norms: list[float] = field(default_factory=list)  # pre-clip gradient norm per step (clipped runs)
    estimated_state_bytes: int = 0  # zcompile.estimate_memory's model states, made before compiling
    optimizer_state: dict = field(
        default_factory=dict
    )  # the reference's: parameter name -> its state (train_reference)


def _optimizer(spec: RunSpec, params, zero: bool):
    module = zcompile.optim if zero else torch.optim
    extra = spec.optimizer_options if zero else {}
    if zero and spec.clip is not None and spec.clip_via == "option":
        if spec.clip_norm_type != 2.0:
            raise ValueError("RunSpec: max_grad_norm= clips the 2-norm; use clip_via='optimizer' or 'torch'")
        extra = {**extra, "max_grad_norm": spec.clip}
    if spec.optimizer == "sgd":
        return module.SGD(params, lr=spec.lr, momentum=0.9, **extra)
    # eps=1e-6 sits above the rounding noise of gradients that are exactly zero in theory (the
    # key third of an attention qkv bias): with eps=1e-8 Adam would normalize that noise to
    # +-lr steps and two correct runs would differ by lr per element.
    return module.AdamW(params, lr=spec.lr, weight_decay=0.01, eps=1e-6, **extra)


def _seed_forward(spec: RunSpec, step: int, micro: int, rank: int) -> None:
    if spec.seed_each_forward:
        torch.manual_seed(1000 * step + 10 * micro + rank)


def micro_batches(spec: RunSpec, step: int, rank: int, world: int):
    """This rank's micro-batches of the global batch of ``step``, one per backward call."""
    tokens, targets = global_batch(step, spec.batch_size * spec.grad_accum, spec.seq_lens)
    out = []
    for micro in range(spec.grad_accum):
        chunk = slice(micro * spec.batch_size, (micro + 1) * spec.batch_size)
        local = slice(rank * spec.batch_size // world, (rank + 1) * spec.batch_size // world)
        out.append((tokens[chunk][local], targets[chunk][local]))
    return out


def _clip_before_step(spec: RunSpec, model: torch.nn.Module, optimizer) -> float | None:
    """The zero run's clipping as ``spec.clip_via`` says; the pre-clip norm (None: the step clips)."""
    if spec.clip is None or spec.clip_via == "option":
        return None
    if spec.clip_via == "optimizer":
        norm = optimizer.clip_grad_norm_(spec.clip, spec.clip_norm_type)
        assert optimizer.last_grad_norm == float(norm)
        return float(norm)
    if spec.clip_via == "torch":
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip, spec.clip_norm_type))
    raise ValueError(f"RunSpec.clip_via: {spec.clip_via!r} is not one of optimizer, option, torch")


def train_zero(spec: RunSpec, rank: int = 0, world: int = 1) -> RunResult:
    """Trains ``spec.model`` with the zero backend on this rank; returns the gathered result."""
    torch._dynamo.reset()
    model = build_model(spec.model)
    if spec.regional:
        assert zcompile.mark_repeated_blocks(model), "the model has no repeated blocks to mark"
    compiled_graphs = []
    options = {"stage": spec.stage, "compiler": "eager", "on_compile": compiled_graphs.append, **spec.options}
    if spec.blocks:
        for block in model.blocks:
            block.compile(backend="zero", options=options, dynamic=spec.dynamic)
        compiled = model
    else:
        compiled = torch.compile(model, backend="zero", options=options, dynamic=spec.dynamic)
    # before the first call (blocks compiled apart: after their compiles, which it reads)
    estimate = zcompile.estimate_memory(
        model, world, options, optimizer="sgd_momentum" if spec.optimizer == "sgd" else "adamw"
    )
    optimizer = None if spec.optimizer_after_forward else _optimizer(spec, model.parameters(), zero=True)
    losses, state_bytes, grad_norms = [], 0, []
    limit = spec.recompile_limit or torch._dynamo.config.recompile_limit
    with torch._dynamo.config.patch(recompile_limit=limit):
        for step in range(spec.steps):
            optimizer = _train_zero_step(spec, compiled, model, optimizer, step, rank, world, losses, grad_norms)
            state_bytes = zcompile.model_state_bytes(model, optimizer).total
            _zero_grad(spec, compiled, optimizer)
    collectives = step_collectives(compiled_graphs, optimizer)
    with zcompile.gathered(model):
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
    unique = list(dict.fromkeys(model.parameters()))
    padded = sum(-(-p.numel() // world) * world for p in unique)
    graphs = [(g.forward.code if g.forward else "", g.backward.code if g.backward else "") for g in compiled_graphs]
    facts = graph_facts(compiled_graphs)
    # cross-call prefetch (zcompile.backend.call_prefetch): calls that took the gather the call before issued
    facts["prefetched_calls"] = {
        kind: sum(g.call_chains[kind].taken for g in compiled_graphs if kind in g.call_chains)
        for kind in ("forward", "backward")
    }
    if spec.blocks:
        report = zcompile.step_report(model, optimizer)
        facts["report_call_prefetch_bytes"] = report.memory["call_prefetch_bytes"]
        facts["report_peak_gathered_bytes"] = report.memory["peak_gathered_bytes"]
        facts["report_gather_staging_bytes"] = report.memory["gather_staging_bytes"]
        facts["report_issued_by_call_before"] = [(r.where, r.kind) for r in report.schedule if r.issued_by_call_before]
        facts["report_summary"] = report.summary_lines()
        facts["estimated_gathered_peak_bytes"] = estimate.gathered_peak_bytes
        facts["report_elements"] = {}
        for record in report.collectives:
            key = f"{record['where']} {record['kind']}"
            facts["report_elements"][key] = facts["report_elements"].get(key, 0) + record["elements"]
    if facts["keep_plans"]:
        facts["report_kept_bytes"] = zcompile.step_report(model, optimizer).memory["kept_gathered_bytes"]
    return RunResult(
        losses,
        params,
        state_bytes,
        sum(p.numel() for p in unique),
        padded,
        collectives,
        graphs,
        facts,
        grad_norms,
        estimate.model_states_bytes,
    )


def _zero_grad(spec: RunSpec, compiled, optimizer) -> None:
    if spec.zero_grad_via == "optimizer":
        optimizer.zero_grad(set_to_none=spec.zero_grad_to_none)
    elif spec.zero_grad_via == "model":
        compiled.zero_grad(set_to_none=spec.zero_grad_to_none)
    else:
        for param in compiled.parameters():
            param.grad = None


def _train_zero_step(
    spec: RunSpec, compiled, model, optimizer, step: int, rank: int, world: int, losses: list, grad_norms: list
):
    """One step of ``train_zero`` (its micro-batches, clip, update); returns the optimizer (made at the
    first backward with ``optimizer_after_forward``)."""
    step_loss = 0.0
    for micro, (tokens, targets) in enumerate(micro_batches(spec, step, rank, world)):
        _seed_forward(spec, step, micro, rank)
        loss = model_loss(spec.model, compiled, tokens, targets) / spec.grad_accum
        loss.backward()
        step_loss += loss.detach()
        if optimizer is None:
            optimizer = _optimizer(spec, model.parameters(), zero=True)
    norm = _clip_before_step(spec, model, optimizer)
    optimizer.step()
    if spec.clip is not None:
        grad_norms.append(norm if norm is not None else optimizer.last_grad_norm)
    if world > 1:
        dist.all_reduce(step_loss)
    losses.append(float(step_loss) / world)
    return optimizer


def train_reference(
    spec: RunSpec, world: int = 1, microbatch_like_ranks: bool = False, autocast_dtype: torch.dtype | None = None
) -> RunResult:
    """Single process, plain torch: the global batch in one forward per micro-batch.

    With ``microbatch_like_ranks`` the global batch is split into ``world`` slices whose gradients
    are averaged, which is the same arithmetic as data parallelism (only the order of the final
    cross-rank sum can differ), so it can be compared at a much tighter tolerance.
    ``autocast_dtype`` runs each forward under ``torch.autocast`` (the mixed-precision reference).
    """
    model = build_model(spec.model)
    optimizer = _optimizer(spec, model.parameters(), zero=False)
    losses, grad_norms = [], []
    for step in range(spec.steps):
        step_loss = 0.0
        slices = world if microbatch_like_ranks else 1
        for micro in range(spec.grad_accum):
            tokens, targets = global_batch(step, spec.batch_size * spec.grad_accum, spec.seq_lens)
            chunk = slice(micro * spec.batch_size, (micro + 1) * spec.batch_size)
            tokens, targets = tokens[chunk], targets[chunk]
            for part in range(slices):
                local = slice(part * spec.batch_size // slices, (part + 1) * spec.batch_size // slices)
                _seed_forward(spec, step, micro, part)
                with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                    loss = model_loss(spec.model, model, tokens[local], targets[local]) / (spec.grad_accum * slices)
                loss.backward()
                step_loss += loss.item()
        if spec.clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip, spec.clip_norm_type)
            grad_norms.append(float(norm))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
    params = dict(model.named_parameters())
    return RunResult(
        losses,
        {name: p.detach().clone() for name, p in params.items()},
        grad_norms=grad_norms,
        optimizer_state={name: dict(optimizer.state[p]) for name, p in params.items() if p in optimizer.state},
    )


def zero_run_on_rank(rank: int, world: int, specs: list[RunSpec]) -> list[RunResult]:
    """Entry point for ``run_ranks``: trains every spec in turn on this rank."""
    return [train_zero(spec, rank, world) for spec in specs]


def assert_same_training(result, reference, spec, param_tol: float = PARAM_TOL):
    """``result`` trained like ``reference`` (losses and parameters; tolerances in the module docstring;
    ``param_tol``: a test's own, where it says why)."""
    for ours, theirs in zip(result.losses, reference.losses, strict=True):
        assert abs(ours - theirs) <= LOSS_RTOL * abs(theirs), (result.losses, reference.losses)
    assert result.params.keys() == reference.params.keys()
    for name, expected in reference.params.items():
        atol = param_tol * max(1.0, expected.abs().max().item())
        if spec.optimizer == "adamw":
            atol = max(atol, spec.steps * spec.lr * GRAD_ABS_ERROR / ADAM_EPS)
        torch.testing.assert_close(result.params[name], expected, rtol=0, atol=atol, msg=name)
    # the run really trained: parameters moved away from their initial values
    assert result.losses[-1] != result.losses[0]


def assert_trains_like_one_process(results: list[dict], spec: RunSpec) -> None:
    """Each rank's ``{"losses", "params", "norms"}`` trained like one process on the global batch
    (``assert_same_training``); with ``spec.clip``, every step clipped, at the reference's pre-clip norm
    (each element counted once however the ranks split the weights)."""
    reference = train_reference(spec)
    for result in results:
        assert_same_training(RunResult(result["losses"], result["params"]), reference, spec)
        if spec.clip is not None:
            assert all(norm > spec.clip for norm in result["norms"])
            torch.testing.assert_close(
                torch.tensor(result["norms"]), torch.tensor(reference.grad_norms), rtol=1e-5, atol=0
            )


def train_steps(spec: RunSpec, compiled, optimizer, steps, rank: int, world: int) -> list[float]:
    """One optimizer step per step of ``steps`` (its global batch, this rank's slice); the mean losses."""
    losses = []
    for step in steps:
        ((tokens, targets),) = micro_batches(spec, step, rank, world)
        loss = model_loss(spec.model, compiled, tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss)
        losses.append(loss.item() / world)
    return losses
