"""Gradient hooks on parameters (``param.register_hook``) run as DDP runs them, at every stage.

Masking the rows of an embedding that must not train, clamping gradients, logging them: a hook gets
the parameter's local gradient (before the mean over ranks) and its result is what trains. At
stages 2 and 3 (and stage 1 with ``param_dtype``) the graphs route the gradient onto a shard, so
autograd never ran the hooks: a masked embedding trained every row, with no error
(``passes/grad_hooks.py``). References: DDP on the same ranks, and torch's own hook checks.
"""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import zcompile
from support.launch import run_ranks
from support.models import VOCAB, build_model, global_batch
from support.training import RunSpec, micro_batches

STEPS = 3
ZERO_RUNS = {
    "stage2": {"stage": 2},
    "stage3": {"stage": 3},
    "stage3-bucketed": {"stage": 3, "bucket_mb": 0.01},
    "stage2-bf16": {"stage": 2, "param_dtype": "bf16"},
    "stage1-bf16": {"stage": 1, "param_dtype": "bf16"},
}
TRAINED_ROWS = VOCAB // 2  # the hook masks the gradient of the embedding rows below this


CLAMP = 2e-3


def _add_hooks(model: torch.nn.Module, seen: list, clamp: bool = True) -> None:
    """Two hooks real loops use: a row mask on the (tied) embedding, where only new tokens train,
    and a clamp, which is not linear, so it tells the local gradient from the mean of the ranks'."""
    mask = (torch.arange(VOCAB) >= TRAINED_ROWS).to(torch.float32)[:, None]

    def only_new_rows(grad):
        seen.append(grad.dtype)
        return grad * mask

    model.wte.weight.register_hook(only_new_rows)
    if clamp:
        model.blocks[0].mlp[0].weight.register_hook(lambda grad: grad.clamp(-CLAMP, CLAMP))


def _train_with_hooks(rank: int, world: int) -> dict:
    """DDP, then each zero run, from the same initial weights: parameters after ``STEPS`` SGD steps
    and the dtypes the mask hook saw (one call per backward: the tied weight's two uses are summed)."""
    results = {}
    for label, options in [("ddp", None), ("ddp-clamp-mean", None), *ZERO_RUNS.items()]:
        torch._dynamo.reset()
        model = build_model("gpt")
        seen = []
        clamp_mean = label == "ddp-clamp-mean"  # the clamp on the mean of the ranks' gradients, after DDP's
        _add_hooks(model, seen, clamp=not clamp_mean)
        if options is None:
            compiled, optimizer = DistributedDataParallel(model), torch.optim.SGD(model.parameters(), lr=0.5)
        else:
            compiled = torch.compile(model, backend="zero", options=options)
            optimizer = zcompile.optim.SGD(model.parameters(), lr=0.5)
        for step in range(STEPS):
            ((tokens, targets),) = micro_batches(RunSpec(), step, rank, world)
            compiled(tokens, targets).backward()
            if clamp_mean:
                model.blocks[0].mlp[0].weight.grad.clamp_(-CLAMP, CLAMP)
            optimizer.step()
            optimizer.zero_grad()
        with zcompile.gathered(model) if options is not None else torch.no_grad():
            params = {name: p.detach().float().clone() for name, p in model.named_parameters()}
        results[label] = (params, seen)
    results["rank0_only_warnings"] = _hooks_on_rank0_only(rank, world)
    return results


def _hooks_on_rank0_only(rank: int, world: int) -> list[str]:
    """``if rank == 0: wandb.watch(model)``: the warnings of the compile (a hook on one rank only is
    fine when it reads, a mix when it changes the gradient; zcompile cannot tell which)."""
    import logging

    torch._dynamo.reset()
    model = build_model("gpt")
    if rank == 0:
        model.wte.weight.register_hook(lambda grad: None)
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("zcompile.agreement.rank_check").addHandler(handler)
    try:
        compiled = torch.compile(model, backend="zero", options={"stage": 3})
        ((tokens, targets),) = micro_batches(RunSpec(), 0, rank, world)
        compiled(tokens, targets).backward()
    finally:
        logging.getLogger("zcompile.agreement.rank_check").removeHandler(handler)
    return records


@pytest.fixture(scope="module")
def both_ranks():
    return run_ranks(2, _train_with_hooks)


@pytest.fixture(scope="module")
def hooked_runs(both_ranks):
    return both_ranks[0]


@pytest.mark.parametrize("label", list(ZERO_RUNS))
def test_gradient_hooks_run_on_the_local_gradient_like_ddp(hooked_runs, label):
    initial = {name: p.detach().clone() for name, p in build_model("gpt").named_parameters()}
    ddp_params, ddp_seen = hooked_runs["ddp"]
    params, seen = hooked_runs[label]
    # the mask ran: rows of old tokens never moved (bit for bit), the others did
    embedding = params["wte.weight"]
    assert torch.equal(embedding[:TRAINED_ROWS], initial["wte.weight"][:TRAINED_ROWS])
    assert not torch.equal(embedding[TRAINED_ROWS:], initial["wte.weight"][TRAINED_ROWS:])
    # once per backward, in the parameter's dtype as autograd gives it (param_dtype's graphs compute in bf16)
    assert seen == ddp_seen == [torch.float32] * STEPS
    if "bf16" in label:
        return
    for name, expected in ddp_params.items():  # the clamp ran on each rank's gradient, before the mean
        torch.testing.assert_close(params[name], expected, rtol=0, atol=2e-6, msg=name)


def test_hooks_registered_on_one_rank_only_are_named_on_every_rank(both_ranks):
    for records in (both_ranks[0]["rank0_only_warnings"], both_ranks[1]["rank0_only_warnings"]):
        hooks = [r for r in records if "gradient hooks" in r]
        assert len(hooks) == 1 and "rank 0: wte.weight; rank 1: none" in hooks[0], records


def test_clamping_the_mean_instead_would_be_seen(hooked_runs):
    """The clamp's place matters at these settings: clamping the mean of the ranks' gradients gives
    another first MLP weight than DDP's clamp of each rank's (so the parity above tests where the
    hook runs, not only that it does)."""
    name = "blocks.0.mlp.0.weight"
    assert (hooked_runs["ddp"][0][name] - hooked_runs["ddp-clamp-mean"][0][name]).abs().max() > 1e-4


def _compiled(stage: int, options: dict | None = None):
    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": stage, **(options or {})})
    return model, compiled, global_batch(0, 2)


def test_post_accumulate_grad_hook_where_no_gradient_accumulates_is_refused():
    model, compiled, (tokens, targets) = _compiled(2)
    model.ln_f.weight.register_post_accumulate_grad_hook(lambda param: None)
    with pytest.raises(Exception, match=r"'ln_f.weight' has a post-accumulate-grad hook.*register_hook"):
        compiled(tokens, targets)


def test_post_accumulate_grad_hook_at_stage_1_runs_as_in_torch():
    model, compiled, (tokens, targets) = _compiled(1)
    norms = []
    model.ln_f.weight.register_post_accumulate_grad_hook(lambda param: norms.append(param.grad.norm().item()))
    compiled(tokens, targets).backward()
    reference = build_model("gpt")
    reference(tokens, targets).backward()
    assert norms == [pytest.approx(reference.ln_f.weight.grad.norm().item(), rel=1e-5)]


def test_hook_registered_after_the_compile_is_refused_until_a_reset():
    model, compiled, (tokens, targets) = _compiled(3)
    compiled(tokens, targets).backward()
    calls = []
    model.ln_f.weight.register_hook(lambda grad: calls.append(1))
    with pytest.raises(ValueError, match=r"'ln_f.weight' got a gradient hook .*torch.compiler.reset\(\)"):
        compiled(tokens, targets)
    torch.compiler.reset()
    compiled(tokens, targets).backward()
    assert calls == [1]


def test_hook_that_changes_the_gradient_shape_is_an_error():
    model, compiled, (tokens, targets) = _compiled(3)
    model.ln_f.weight.register_hook(lambda grad: grad[:4])
    with pytest.raises(RuntimeError, match=r"returned torch.float32 \(4,\) for a gradient of torch.float32 \(32,\)"):
        compiled(tokens, targets).backward()
