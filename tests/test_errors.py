"""Bad input gets a clear error naming the problem and the fix, never a hang."""

import pytest
import torch

import zcompile
from support.launch import run_ranks
from support.models import build_model, global_batch, model_loss
from zcompile.backend.refusals import check_devices
from zcompile.common.process_group import DataParallelGroup
from zcompile.passes.param_collectives import ParamInput, ShardingPlan


def test_parameters_on_different_devices():
    plan = ShardingPlan(
        stage=3,
        world_size=1,
        group_name=None,
        param_dtype=None,
        reduce_dtype=None,
        params=[ParamInput(0, "a.weight", (2,), True), ParamInput(1, "b.weight", (2,), True)],
    )
    inputs = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, device="meta"))]
    with pytest.raises(ValueError, match=r"different devices.*b\.weight.*model\.to\(device\)"):
        check_devices(plan, inputs, DataParallelGroup.resolve(None))


@pytest.mark.parametrize("optimizer", [zcompile.optim.AdamW, zcompile.optim.SGD])
def test_optimizer_given_plain_tensors(optimizer):
    with pytest.raises(
        TypeError, match=r"item #1 \(Tensor of shape \(3,\)\) is not an nn.Parameter.*model.parameters\(\)"
    ):
        optimizer([torch.nn.Parameter(torch.zeros(2)), torch.zeros(3, requires_grad=True)], lr=0.1)


def test_unsupported_optimizer_arguments():
    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="differentiable=True is not supported"):
        zcompile.optim.AdamW(params, differentiable=True)
    with pytest.raises(TypeError, match="unsupported arguments \\['foreach_'\\]"):  # torch's foreach is a hint
        zcompile.optim.AdamW(params, foreach_=True)


def test_mode_argument_rejected():
    model = torch.nn.Linear(2, 2)
    compiled = torch.compile(model, backend="zero", mode="max-autotune")
    with pytest.raises(Exception, match=r"mode='max-autotune'\) is not supported"):
        compiled(torch.zeros(1, 2))


def test_recompile_with_another_stage_is_an_error():
    torch._dynamo.reset()
    model = build_model("gpt")
    tokens, targets = global_batch(0, 2)
    model_loss("gpt", torch.compile(model, backend="zero", options={"stage": 3}), tokens, targets)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="already sharded with stage 3.*one ZeroConfig"):
        model_loss("gpt", torch.compile(model, backend="zero", options={"stage": 2}), tokens, targets)


def test_a_weight_trained_eagerly_first_then_compiled_at_stage3_names_the_eager_training():
    """A weight with a stage-1 shard from eager training (``shard_eager_parameter``) that a stage-3 graph
    takes later: the user gave one config, so "use one ZeroConfig" alone misled."""
    from zcompile.common.process_group import DataParallelGroup
    from zcompile.sharding.shards import shard_eager_parameter, shard_parameter

    weight, group = torch.nn.Parameter(torch.randn(4, 4)), DataParallelGroup.resolve()
    shard_eager_parameter(weight, "param_groups[0]['params'][0]", group)
    with pytest.raises(ValueError, match="already sharded with stage 1.*trained outside the compiled graphs first"):
        shard_parameter(weight, "w", 3, group)


class _LongInputsTakeAnotherLayer(torch.nn.Module):
    """A GPT whose inputs longer than 13 tokens also go through a layer of their own: a recompile for a
    longer input issues other collectives (that layer's all-gathers) than the graph it replaces."""

    def __init__(self, gpt: torch.nn.Module):
        super().__init__()
        self.gpt, self.long_inputs = gpt, torch.nn.Linear(4, 4)

    def forward(self, tokens, targets):
        loss = self.gpt(tokens, targets)
        if tokens.shape[1] > 13:
            loss = loss + 0 * self.long_inputs(torch.ones(4)).sum()
        return loss


def _train_divergent(rank, world, kind):
    """Each rank compiles something different; returns the error each rank raised."""
    torch._dynamo.reset()
    model = build_model("gpt_untied_odd" if (kind == "model" and rank == 1) else "gpt")
    if kind == "branch":
        model = _LongInputsTakeAnotherLayer(model)
    options = {"stage": 3, "check_timeout_s": 5}
    if kind == "options" and rank == 1:
        options["param_dtype"] = "bf16"
    if kind == "sync_option" and rank == 1:
        options["sync_module_states"] = False  # rank 0 would wait to take its weights from rank 0
    if kind == "buckets" and rank == 1:
        options["bucket_mb"] = 0  # not in the plan: the Dynamo-level check passes, the forward's gathers differ
    if kind == "missing" and rank == 1:
        return "skipped"  # rank 1 never compiles: rank 0 must time out, not hang
    tokens, targets = global_batch(0, 2)
    try:
        compiled = torch.compile(model, backend="zero", options=options)
        if kind == "eval_alone":  # after a step, rank 0 alone takes a validation loss (a batch of its own
            # length) in eval mode, gradients still on; rank 1 trains on
            model_loss("gpt", compiled, tokens, targets).backward()
            if rank == 0:
                model.eval()
                tokens, targets = tokens[:, :12].contiguous(), targets[:, :12].contiguous()
        if kind == "branch":  # at step 1 only rank 1's length changes, and takes the other branch
            for lengths in ((12, 12), (12, 14)):
                length = lengths[rank]
                model_loss(
                    "gpt", compiled, tokens[:, :length].contiguous(), targets[:, :length].contiguous()
                ).backward()
        model_loss("gpt", compiled, tokens, targets)
    except Exception as error:  # Dynamo wraps backend errors; the message is what users read
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.parametrize("kind", ["model", "options", "sync_option", "buckets", "missing", "branch", "eval_alone"])
def test_divergent_ranks_fail_fast(kind):
    # the store outlives rank 0, as torchrun's agent hosts it: rank 0 leaves as soon as it has raised,
    # and rank 1, still polling the store when the machine is busy, must still read what differs
    outcomes = run_ranks(2, _train_divergent, kind, timeout_s=120)
    failing = outcomes[:1] if kind == "missing" else outcomes
    for outcome in failing:
        assert "RankDivergenceError" in outcome, outcome
    if kind == "missing":
        assert "ranks [1] did not within 5s" in outcomes[0]
        return
    if kind == "branch":  # rank 1 recompiled alone, to other collectives: both ranks name what changed
        # (a lone recompile to the collectives the ranks agreed on trains: tests/test_lone_recompile.py)
        for outcome in outcomes:
            assert (
                "graph 0/1 (a recompile: 0/0: tensor 'tokens' size mismatch at index 1. expected 12, actual 14)"
                in outcome
            ), outcome
            # the compile's fix, whichever rank raised first (rank 0 waits at stage 3's call agreement)
            assert "where it issues others (code that branches on a shape)" in outcome, outcome
        return
    if kind == "eval_alone":  # rank 0 recompiled alone in another mode: the collectives its graph issues may be
        # the training graph's, so an agreed signature counts only in the mode it was agreed in (rank_check)
        for outcome in outcomes:
            assert "the same mode (model.train() / model.eval(), torch.no_grad())" in outcome, outcome
        return
    assert outcomes[0] == outcomes[1] and "would issue different collectives" in outcomes[0]
    assert {  # what differs, first: a parameter, a setting, a collective (of the forward graph, after its passes)
        "model": "(parameter #0: rank 0: parameter 'wte.weight' shape [256, 32] float32; "
        "rank 1: parameter 'wte.weight' shape [253, 21] float32)",
        "options": "(setting 'param_dtype': rank 0 None, rank 1 bfloat16)",
        "sync_option": "(setting 'sync_module_states': rank 0 true, rank 1 false)",
        "buckets": "forward graph of Dynamo graph 0_0 would issue different collectives on different ranks "
        "(collective #0: rank 0: all_gather of [17088] float32 moving 28 parameters: 'wte.weight', "
        "'wpe.weight', 'blocks.0.ln_1.weight', 'blocks.0.ln_1.bias', ...; "
        "rank 1: all_gather of [4096] float32 moving parameter 'wte.weight')",
    }[kind] in outcomes[0]


@pytest.mark.parametrize("stage", [1, 3])
def test_channels_last_weights_name_the_layout_and_the_fix(stage):
    """``model.to(memory_format=torch.channels_last)`` (the CNN recipe) permutes the conv weights'
    strides; shards are cut from the contiguous layout, so the error names the format and what keeps
    the activations channels_last (the fix itself trains like DDP, measured in the 2026-11-27 note)."""
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(2))
    model(torch.zeros(1, 3, 5, 5))
    model = model.to(memory_format=torch.channels_last)
    x = torch.zeros(1, 3, 5, 5).to(memory_format=torch.channels_last)
    with pytest.raises(
        Exception,
        match=r"'0\.weight' is in channels_last memory format.*"
        r"model\.to\(memory_format=torch\.contiguous_format\).*x\.to\(memory_format",
    ):
        torch.compile(model, backend="zero", options={"stage": stage})(x)
    torch._dynamo.reset()
    # the fix: contiguous weights, channels_last inputs; the convolution's output keeps the layout
    model = model.to(memory_format=torch.contiguous_format)
    out = torch.compile(model[0], backend="zero", options={"stage": stage})(x)
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch._dynamo.reset()


def test_a_transposed_weight_names_the_fix():
    torch._dynamo.reset()
    model = torch.nn.Linear(3, 2)
    model.weight = torch.nn.Parameter(torch.randn(3, 2).t())  # a view of another layout
    with pytest.raises(
        Exception, match=r"'weight' is not a contiguous tensor that owns its storage.*contiguous\(\)\.clone\(\)"
    ):
        torch.compile(model, backend="zero")(torch.zeros(1, 3))
    torch._dynamo.reset()


class _RenormedEmbedding(torch.nn.Module):
    def __init__(self, write: str):
        super().__init__()
        self.write = write
        self.emb = torch.nn.Embedding(16, 4, max_norm=1.0 if write == "max_norm" else None)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, ids):
        if self.write == "clamp":
            self.head.weight.data.clamp_(-0.5, 0.5)  # weight clipping inside the forward
        return self.head(self.emb(ids).mean(1))


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("write", ["max_norm", "clamp"])
def test_a_forward_that_writes_a_parameter_is_refused_naming_it(stage, write):
    """``nn.Embedding(max_norm=...)`` renormalizes its weight inside the forward; a write reaches only a
    rank's copy of the weight (``passes/param_writes.py``). Stage 1 trained on with each rank's own
    renormalization (an embedding row 10.4 long where max_norm=1, one process's longest 8.9), stages 2
    and 3 failed in autograd's view check."""
    torch._dynamo.reset()
    model = _RenormedEmbedding(write)
    compiled = torch.compile(model, backend="zero", options={"stage": stage})
    name, what = ("emb.weight", "max_norm=1.0") if write == "max_norm" else ("head.weight", "clamp_")
    with pytest.raises(Exception, match=rf"writes parameters in place \('{name}': .*{what}.*gathered"):
        compiled(torch.randint(0, 16, (2, 3)))
    torch._dynamo.reset()


def test_an_embedding_without_max_norm_and_in_place_activations_are_not_writes():
    """What is not a write into a parameter compiles: in-place ops on activations, padding_idx."""
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Embedding(16, 4, padding_idx=0), torch.nn.ReLU(inplace=True))
    compiled = torch.compile(model, backend="zero", options={"stage": 3})
    ids = torch.randint(0, 16, (2, 3))
    with zcompile.gathered(model):
        expected = model(ids)
    torch.testing.assert_close(compiled(ids), expected)
    torch._dynamo.reset()
