"""Random draws are saved for backward, never drawn again (``passes/random_draws.py``).

At an ``activation_memory_budget`` below 1, torch's memory-budget partitioner recomputed a dropout
in the backward with a fresh mask: every gradient through it was wrong, with no error (relative
error 1.1-1.2 against eager PyTorch at budgets 0.5 and 0.0). The references here are independent of
the partition: eager PyTorch on the same seed (the eager inner compiler runs the same ops: bitwise),
the same inner compiler without a budget (inductor draws with its own generator: bitwise against
itself), and on 2 ranks a single process drawing the same masks for each rank's slice.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

import zcompile
from support.launch import run_ranks
from support.training import RunSpec, assert_same_training, train_reference, train_zero
from zcompile.passes import random_draws
from zcompile.passes.random_draws import recomputed_random_draws, save_random_draws_pass

BUDGETS = (None, 1.0, 0.5, 0.0)


class DropoutMLP(torch.nn.Module):
    """Three layers with two dropouts (p=0.5: half of each gradient hangs on the mask)."""

    def __init__(self, blocks: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(32, 64)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(blocks))
        self.last = torch.nn.Linear(64, 8)

    def forward(self, x):
        x = self.first(x)
        for block in self.blocks:
            x = block(x)
        return self.last(x)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(torch.relu(self.linear(x)))


def _batch() -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(1))


def _gradients(budget, stage: int, compiler: str = "eager", regional: bool = False, graphs: list | None = None):
    """The gradients of one forward and backward on world 1 (seed 5 before the forward), gathered."""
    torch._dynamo.reset()
    model = DropoutMLP()
    if regional:
        assert zcompile.mark_repeated_blocks(model)
    options = {"stage": stage, "compiler": compiler, "on_compile": (graphs if graphs is not None else []).append}
    if budget is not None:
        options["activation_memory_budget"] = budget
    compiled = torch.compile(model, backend="zero", options=options)
    torch.manual_seed(5)
    compiled(_batch()).square().sum().backward()
    with zcompile.gathered(model, grads=True):
        return {name: p.grad.clone() for name, p in model.named_parameters()}


def _eager_gradients():
    model = DropoutMLP()
    torch.manual_seed(5)
    model(_batch()).square().sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _assert_equal(got: dict, want: dict, what) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), (what, name, (got[name] - value).norm() / value.norm())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_eager_gradients_equal_pytorch_at_every_budget(stage):
    want = _eager_gradients()
    for budget in BUDGETS:
        _assert_equal(_gradients(budget, stage), want, budget)


def test_inductor_gradients_equal_its_own_without_a_budget():
    for stage in (1, 2, 3):
        want = _gradients(None, stage, "inductor")
        for budget in BUDGETS[1:]:
            _assert_equal(_gradients(budget, stage, "inductor"), want, (stage, budget))


def test_regional_blocks_with_dropout_equal_pytorch():
    """A marked block's subgraph call holds the dropout: the outer partition must not call it again."""
    want = _eager_gradients()
    for budget in BUDGETS:
        _assert_equal(_gradients(budget, 3, regional=True), want, budget)


def test_transformers_gpt2_with_its_default_dropout():
    """GPT-2 as transformers makes it (dropout 0.1 on embeddings, attention and residuals): the
    budgets train as the same compiler without one, bitwise, and as eager transformers to float
    rounding (attention's compiled decomposition sums in another order)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))

    def gradients(budget, compiled: bool):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
        model.loss_type = "ForCausalLM"
        run = model
        if compiled:
            options = {"stage": 3} if budget is None else {"stage": 3, "activation_memory_budget": budget}
            run = torch.compile(model, backend="zero", options=options)
        torch.manual_seed(7)
        run(input_ids=tokens, labels=tokens).loss.backward()
        with zcompile.gathered(model, grads=True) if compiled else torch.no_grad():
            return {name: p.grad.clone() for name, p in model.named_parameters()}

    eager = gradients(None, compiled=False)
    unbudgeted = gradients(None, compiled=True)
    for name, value in eager.items():
        torch.testing.assert_close(unbudgeted[name], value, rtol=0, atol=1e-6 * max(1.0, value.abs().max().item()))
    for budget in (0.5, 0.0):
        _assert_equal(gradients(budget, compiled=True), unbudgeted, budget)


def test_a_partition_that_redraws_is_refused(monkeypatch):
    """Without the pass's tags the partitioner redraws the masks; the backend's check refuses that."""
    monkeypatch.setattr(random_draws, "draws_random_numbers", lambda node: False)
    assert _gradients(1.0, 3).keys()  # the default min-cut bans recomputing random ops by itself
    with pytest.raises(
        Exception,
        match=r"backward would draw new random numbers for native_dropout.*"
        r"activation_memory_budget=0\.5.*torch\.utils\.checkpoint",
    ):
        _gradients(0.5, 3)


def test_saved_masks_are_counted_by_step_report_and_estimate():
    """At budget 0 the forward saves each dropout's output and mask and nothing else of its own: the
    report and the estimate count them; the reference is the shapes (16 x 64, fp32 and bool)."""
    torch._dynamo.reset()
    model = DropoutMLP()
    options = {"stage": 3, "activation_memory_budget": 0.0}
    estimate = zcompile.estimate_memory(model, 1, options, batch=_batch())
    compiled = torch.compile(model, backend="zero", options=options)
    optimizer = zcompile.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(5)
    compiled(_batch()).square().sum().backward()
    optimizer.step()
    saved = zcompile.step_report(model, optimizer).memory["saved_activation_bytes"]
    dropouts = len(model.blocks)
    assert saved >= dropouts * 16 * 64 * (4 + 1)  # an output and a mask per dropout
    assert saved == estimate.saved_activation_bytes


def test_the_pass_tags_random_ops_and_leaves_checkpointed_ones():
    """On a hand-built graph: dropout, rand_like and bernoulli are tagged MUST_SAVE; an op already
    tagged by torch.utils.checkpoint keeps its tag (replayed from the RNG state); others untouched."""

    def f(x):
        a = torch.ops.aten.native_dropout.default(x, 0.5, True)[0]
        b = torch.ops.aten.rand_like.default(x)
        c = torch.ops.aten.bernoulli.default(x.sigmoid())
        d = torch.ops.aten.randn_like.default(x)
        return a + b + c + d

    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(torch.ones(4))
    checkpointed = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.randn_like.default)[0]
    checkpointed.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
    save_random_draws_pass(gm)
    tags = {node.target: node.meta.get("recompute") for node in gm.graph.nodes if node.op == "call_function"}
    for op in (
        torch.ops.aten.native_dropout.default,
        torch.ops.aten.rand_like.default,
        torch.ops.aten.bernoulli.default,
    ):
        assert tags[op] == CheckpointPolicy.MUST_SAVE, op
    assert tags[torch.ops.aten.randn_like.default] == CheckpointPolicy.PREFER_RECOMPUTE
    assert tags[torch.ops.aten.sigmoid.default] is None


@pytest.mark.parametrize("dropout_p, drawn", [(0.0, False), (0.1, True)])
def test_attention_draws_only_with_dropout(dropout_p, drawn):
    """SDPA's CPU kernel carries the random tag for the dropout it can do: at dropout_p 0 it draws
    nothing and is left to the partitioner (a GPT without dropout partitions as before)."""

    def f(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q, dropout_p)[0]

    gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(torch.ones(1, 2, 4, 8))
    save_random_draws_pass(gm)
    attention = next(n for n in gm.graph.nodes if n.op == "call_function" and "attention" in str(n.target))
    assert (attention.meta.get("recompute") == CheckpointPolicy.MUST_SAVE) is drawn


def test_recomputed_draws_are_those_named_in_both_graphs():
    def forward(x):
        return torch.ops.aten.native_dropout.default(x, 0.5, True)

    def backward_redrawing(x, g):
        _, mask = torch.ops.aten.native_dropout.default(x, 0.5, True)
        return g * mask

    def backward_with_noise_of_its_own(x, g):
        return g * torch.ops.aten.rand_like.default(g)

    fw = torch.fx.experimental.proxy_tensor.make_fx(forward)(torch.ones(4))
    bw = torch.fx.experimental.proxy_tensor.make_fx(backward_redrawing)(torch.ones(4), torch.ones(4))
    own = torch.fx.experimental.proxy_tensor.make_fx(backward_with_noise_of_its_own)(torch.ones(4), torch.ones(4))
    assert recomputed_random_draws(fw, bw) == ["native_dropout"]
    assert recomputed_random_draws(fw, own) == []


def _dropout_on_ranks(rank, world):
    return [train_zero(spec, rank, world) for spec in DROPOUT_SPECS]


DROPOUT_SPECS = tuple(
    RunSpec(
        model=model,
        stage=stage,
        seed_each_forward=True,
        regional=regional,
        options={"activation_memory_budget": budget},
    )
    for model, stage, budget, regional in (
        ("gpt_dropout", 1, 0.5, False),
        ("gpt_dropout", 2, 0.0, False),
        ("gpt_dropout", 3, 0.0, False),
        ("gpt_dropout", 3, 0.5, True),
        ("hf_gpt2_dropout", 3, 0.0, False),
    )
)


def test_dropout_with_a_budget_on_2_ranks_trains_like_one_process():
    """Each rank seeds before its forward as the reference does before that rank's slice: the same
    masks, so the same training (tolerances of ``support.training``)."""
    for spec, result in zip(DROPOUT_SPECS, run_ranks(2, _dropout_on_ranks)[0], strict=True):
        assert_same_training(result, train_reference(spec, world=2, microbatch_like_ranks=True), spec)
