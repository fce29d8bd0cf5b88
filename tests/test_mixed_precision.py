"""Mixed precision (``param_dtype``/``reduce_dtype``) on 2 gloo ranks against torch.autocast.

The reference is a single process running each forward under ``torch.autocast(bf16)`` (the
global batch split like the ranks', gradients averaged), trained with SGD so that errors pass
through linearly (Adam would turn bf16 noise on tiny gradients into +-lr steps).

Every stage keeps the weights the graphs read in bf16, as ZeRO's mixed precision does (stages 1
and 2: a bf16 replica refreshed by the step's all-gather; stage 3: the shard cast before the
gather), so ops autocast keeps in fp32 (embeddings, norms) also see bf16-rounded weights, and
gradients are reduced in bf16 (stage 1's are also accumulated in bf16, on the replica): each is a
relative error of at most 2^-8 = 0.4% per rounding. Over 3 SGD steps through 2 layers the
measured relative error per tensor is at most 1.6% (GPT) and 0.04% (Llama); 5% bounds it. A
gradient lost, scaled by N or reduced onto the wrong shard moves parameters by 100% of an update
and fails. Losses average thousands of rounded terms: 1e-4 relative (measured <= 2e-5).
"""

import pytest
import torch

import zcompile
from support.launch import run_ranks
from support.training import RunSpec, train_reference, zero_run_on_rank
from zcompile import zero_formula_bytes

BF16 = {"param_dtype": "bf16"}
SPECS = [
    RunSpec(model="gpt", stage=1, optimizer="sgd", lr=0.05, options={**BF16, "reduce_dtype": "fp32"}),
    RunSpec(model="gpt", stage=2, optimizer="sgd", lr=0.05, options=BF16),
    RunSpec(model="gpt", stage=3, optimizer="sgd", lr=0.05, options=BF16),
    RunSpec(model="gpt", stage=3, optimizer="sgd", lr=0.05, options={**BF16, "reduce_dtype": "fp32"}),
    RunSpec(model="hf_llama", stage=3, optimizer="sgd", lr=0.05, options=BF16),
]
PARAM_RTOL = {1: 0.05, 2: 0.05, 3: 0.05}
LOSS_RTOL = {1: 1e-4, 2: 1e-4, 3: 1e-4}


@pytest.fixture(scope="module")
def results():
    return run_ranks(2, zero_run_on_rank, SPECS, timeout_s=600)[0]


@pytest.mark.parametrize(
    "index", range(len(SPECS)), ids=[f"{s.model}-stage{s.stage}-{s.options.get('reduce_dtype', 'bf16')}" for s in SPECS]
)
def test_matches_autocast_reference(results, index):
    spec, result = SPECS[index], results[index]
    reference = train_reference(spec, world=2, microbatch_like_ranks=True, autocast_dtype=torch.bfloat16)
    for ours, theirs in zip(result.losses, reference.losses, strict=True):
        assert abs(ours - theirs) <= LOSS_RTOL[spec.stage] * theirs, (result.losses, reference.losses)
    for name, expected in reference.params.items():
        actual = result.params[name]
        assert actual.dtype == torch.float32, f"{name}: master weights must stay fp32"
        error = float((actual - expected).norm() / expected.norm())
        assert error <= PARAM_RTOL[spec.stage], f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize(
    "index", range(len(SPECS)), ids=[f"{s.model}-stage{s.stage}-{s.options.get('reduce_dtype', 'bf16')}" for s in SPECS]
)
def test_collective_dtypes(results, index):
    """Gathers move param_dtype; gradient reductions move reduce_dtype (default: param_dtype)."""
    spec, result = SPECS[index], results[index]
    reduce_dtype = torch.float32 if spec.options.get("reduce_dtype") == "fp32" else torch.bfloat16
    kinds = {(c.kind, c.where): c.dtype for c in result.collectives}
    assert any(kind == "reduce_scatter" for kind, _ in kinds)
    for (kind, where), dtype in kinds.items():
        if kind == "reduce_scatter":
            assert dtype == reduce_dtype, (kind, where, dtype)
        elif kind == "all_gather" and where != "optimizer":
            assert dtype == torch.bfloat16, (kind, where, dtype)
    if spec.stage == 3:
        # bf16 gathers: half the bytes of the fp32 shards they gather
        gathered = sum(c.bytes for c in result.collectives if c.kind == "all_gather")
        assert gathered == sum(c.elements for c in result.collectives if c.kind == "all_gather") * 2


@pytest.mark.parametrize(
    "index", range(len(SPECS)), ids=[f"{s.model}-stage{s.stage}-{s.options.get('reduce_dtype', 'bf16')}" for s in SPECS]
)
def test_model_states_follow_zeros_mixed_precision_formula(results, index):
    """Per-rank bytes after a step against ZeRO's 2 + 2 + 12 accounting (``zero_formula_bytes`` with
    bf16): the replicated weights of stages 1 and 2 are bf16, the fp32 master only on the shards.
    Before the replicas, stages 1 and 2 held the fp32 parameters too (1.57x and 1.46x at 4 ranks)."""
    spec, result = SPECS[index], results[index]
    formula = zero_formula_bytes(result.num_params, 2, spec.stage, torch.bfloat16)
    sgd = formula - 4 * result.num_params // 2  # SGD with momentum keeps 4 bytes of state per element, Adam 8
    assert sgd <= result.state_bytes <= 1.05 * sgd, (spec.stage, result.state_bytes, sgd)
    assert result.estimated_state_bytes == result.state_bytes  # zcompile.estimate_memory, before compiling


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_model_trains_with_fp32_master_weights(stage):
    """A model already in bf16: the shards hold fp32 masters, gathers send bf16 (stage 2: the
    optimizer's update pass writes the bf16 copy that the refresh all-gather sends).

    The reference trains the bf16 parameters in place with torch.optim.SGD, so it rounds every
    update to bf16 while the shards do not: the runs agree only to bf16 precision, 1e-2 on losses.
    """
    spec = RunSpec(model="gpt_bf16", stage=stage, optimizer="sgd", lr=0.05, steps=3)
    result = run_ranks(2, zero_run_on_rank, [spec], timeout_s=300)[0][0]
    reference = train_reference(spec, world=2)
    for ours, theirs in zip(result.losses, reference.losses, strict=True):
        assert abs(ours - theirs) <= 1e-2 * theirs, (result.losses, reference.losses)
    assert result.losses[-1] < result.losses[0]
    assert all(c.dtype == torch.bfloat16 for c in result.collectives if c.kind == "all_gather")
    assert result.estimated_state_bytes == result.state_bytes  # bf16 parameters, fp32 shards, predicted


@pytest.mark.parametrize("stage", [1, 2])
def test_replicated_fp32_parameters_are_freed_and_say_so(stage):
    """With param_dtype at stages 1 and 2 the fp32 parameters exist only as shards between steps
    (the graphs read a bf16 replica): eager use raises naming the fix, ``state_dict()`` and ``gathered`` bring the fp32
    values back (equal to the masters, not to the bf16 replica), and a write inside it reaches the
    masters and the replica the next step reads. One process (a world of one)."""
    import zcompile
    from support.models import build_model, global_batch, model_loss
    from zcompile.sharding.sharded_parameter import ShardedParameterError
    from zcompile.sharding.shards import shard_of

    torch._dynamo.reset()
    model = build_model("gpt")
    optimizer = zcompile.optim.SGD(model.parameters(), lr=0.05)
    compiled = torch.compile(model, backend="zero", options={"stage": stage, "param_dtype": "bf16"})
    model_loss("gpt", compiled, *global_batch(0, 4)).backward()
    optimizer.step()
    optimizer.zero_grad()
    head = model.head.weight
    sharded = shard_of(head)
    assert sharded.replica is not None and sharded.replica.dtype == torch.bfloat16
    with pytest.raises(ShardedParameterError, match=f"stage {stage} with param_dtype.*zcompile.gathered"):
        head.sum()
    # an alias (what an EMA's update reads: p.detach()) says the same, not "stage 3"
    with pytest.raises(ShardedParameterError, match=rf"is sharded \(ZeRO stage {stage} with param_dtype"):
        head.detach().sum()
    state = model.state_dict()  # gathers the fp32 masters, as at stage 3
    assert state["head.weight"].dtype == torch.float32
    assert torch.equal(state["head.weight"].reshape(-1), sharded.shard.detach()[: head.numel()])
    with zcompile.gathered(model):
        assert torch.equal(head.detach().reshape(-1), sharded.shard.detach()[: head.numel()])  # fp32 masters
        assert "head.weight" in model.state_dict()
        with torch.no_grad():
            head.mul_(0)
    assert not sharded.shard.detach().any() and not sharded.replica.any()
    model_loss("gpt", compiled, *global_batch(1, 4)).backward()  # trains on from the written weights
    optimizer.step()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # one process on purpose
def test_checkpoint_of_bf16_replicas_resumes_at_another_stage(tmp_path):
    """A stage-2 bf16 run saved (fp32 masters) and loaded into a stage-1 bf16 model that has already
    compiled: the loaded masters refresh the replica the graphs read, so the next loss is the same
    bits as the saving run's. One process."""
    import zcompile
    import zcompile.checkpoint.dcp as ckpt
    from support.models import build_model, global_batch, model_loss
    from zcompile.sharding.shards import shard_of

    def fresh(stage):
        torch._dynamo.reset()
        model = build_model("gpt")
        optimizer = zcompile.optim.AdamW(model.parameters(), lr=1e-2)
        return model, torch.compile(model, backend="zero", options={"stage": stage, "param_dtype": "bf16"}), optimizer

    model, compiled, optimizer = fresh(2)
    for step in range(2):
        model_loss("gpt", compiled, *global_batch(step, 4)).backward()
        optimizer.step()
        optimizer.zero_grad()
    ckpt.save(str(tmp_path), model, optimizer)
    expected = model_loss("gpt", compiled, *global_batch(2, 4)).item()
    model2, compiled2, optimizer2 = fresh(1)
    model_loss("gpt", compiled2, *global_batch(0, 4)).backward()  # compiled: the replica exists
    optimizer2.zero_grad()
    ckpt.load(str(tmp_path), model2, optimizer2)
    assert model_loss("gpt", compiled2, *global_batch(2, 4)).item() == expected
    loaded = shard_of(model2.head.weight)
    assert torch.equal(loaded.replica, loaded.shard.detach()[: loaded.numel].view(loaded.shape).to(torch.bfloat16))


def _param_dtype_on_rank0_only(rank, world):
    import time

    import zcompile
    from support.models import build_model, global_batch, model_loss
    from zcompile.agreement.abort_note import RankDivergenceError

    torch._dynamo.reset()
    model = build_model("gpt")
    optimizer = zcompile.optim.AdamW(model.parameters(), lr=1e-3, check_timeout_s=20)
    options = {"stage": 1, **({"param_dtype": "bf16"} if rank == 0 else {})}
    compiled = torch.compile(model, backend="zero", options=options)
    model_loss("gpt", compiled, *global_batch(0, 4)).backward()
    start = time.perf_counter()
    with pytest.raises(RankDivergenceError) as error:
        optimizer.step()
    return str(error.value), time.perf_counter() - start


def test_param_dtype_on_one_rank_only_is_an_error_on_every_rank():
    """Stage-1 graphs issue no collectives, so the compile-time check cannot see one rank compiled
    with param_dtype and another without; the step's all-gathers would then move bf16 buckets on one
    rank and fp32 on the other, which gloo answers by aborting the process ("Received data size
    doesn't match"). The step's agreement compares the replicated dtypes first: both ranks raise."""
    for message, seconds in run_ranks(2, _param_dtype_on_rank0_only, timeout_s=120):
        assert "replicated weights in different dtypes" in message and "same param_dtype" in message, message
        assert seconds < 20, seconds


class _Norms(torch.nn.Module):
    """Each of torch's affine norms on an fp32 input: a LayerNorm on features (or on the hidden state
    of a block compiled on its own), a GroupNorm and a BatchNorm in a small CNN."""

    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(8)
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.gn = torch.nn.GroupNorm(2, 8)
        self.bn = torch.nn.BatchNorm2d(8)

    def forward(self, x):  # x: [batch, 8, 4, 4]
        h = self.ln(x.transpose(1, 3)).transpose(1, 3)
        h = self.bn(self.gn(self.conv(h)))
        return h.float().square().mean()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_norms_take_fp32_inputs_on_a_cpu(stage):
    """torch's CPU norms refuse a bf16 weight with an fp32 input ("mixed dtype (CPU): expect parameter
    to have scalar type of Float"), and a BatchNorm a bf16 weight beside its fp32 running statistics
    even on a bf16 input: with param_dtype="bf16" every stage failed at the first call. The norms'
    weights now enter them in fp32 (``norm_params_in_fp32_pass``), as CUDA autocast runs norms; the
    loss and gradients follow eager torch.autocast with the same bf16-rounded weights (2^-8 relative
    per rounding; 2e-2 bounds the loss of this small net, 5% each gradient's norm)."""
    _assert_follows_eager_autocast(_Norms, torch.randn(4, 8, 4, 4), stage)


def _assert_follows_eager_autocast(make_model, x, stage: int, calls: int = 1, gradients: bool = True):
    """``make_model()`` compiled at ``stage`` with param_dtype="bf16", called ``calls`` times on ``x`` (the
    last one's backward), against eager torch.autocast of a copy whose weights are the bf16-rounded ones the
    graphs read: the loss within 2e-2 (2^-8 relative per rounding, in a small net) and, with ``gradients``,
    each gradient's norm within 5%. Returns the compiled model's last loss and the model."""
    torch.manual_seed(0)
    model, reference = make_model(), make_model()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    with torch.autocast("cpu", torch.bfloat16):
        expected = reference(x)
    expected.backward()
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="zero", options={"stage": stage, "param_dtype": "bf16"})
        loss = [compiled(x) for _ in range(calls)][-1]
        loss.backward()
        with zcompile.gathered(model, grads=True):
            grads = {name: p.grad.float().clone() for name, p in model.named_parameters()}
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(loss.float(), expected.float(), rtol=2e-2, atol=0)
    for name, p in reference.named_parameters() if gradients else ():
        error = (grads[name] - p.grad).norm() / p.grad.norm()
        assert error < 0.05, (name, error.item())
    return loss, model


class _ConvAfterABreak(torch.nn.Module):
    """A linear layer, a graph break that reads the activation in eager code, then a convolution: the
    activation crosses from one graph to the next (transformers' wav2vec2 masks its features in between)."""

    def __init__(self):
        super().__init__()
        self.proj, self.conv, self.head = (
            torch.nn.Linear(8, 8),
            torch.nn.Conv1d(8, 8, 3, padding=1),
            torch.nn.Linear(8, 1),
        )
        self.seen_dtypes = []

    def forward(self, x):
        h = self.proj(x)
        self._record(h)
        return self.head(self.conv(h.transpose(1, 2)).transpose(1, 2)).square().mean()

    @torch.compiler.disable
    def _record(self, h):
        self.seen_dtypes.append(h.dtype)


@pytest.mark.parametrize("stage", [2, 3])
def test_activations_leave_a_graph_in_their_traced_dtype(stage):
    """With param_dtype the graphs run under autocast, and an activation left the graph in bf16 where
    Dynamo had traced it fp32: the next frame's convolution then failed in Dynamo's own trace ("Input
    type (c10::BFloat16) and bias type (float) should be the same"), and eager code between the graphs
    read a dtype that Dynamo had baked in as fp32. Outputs are cast back to their traced dtype; the loss
    follows eager torch.autocast with the same bf16-rounded weights (2e-2, as above)."""
    loss, model = _assert_follows_eager_autocast(
        _ConvAfterABreak, torch.randn(4, 6, 8), stage, calls=2, gradients=False
    )
    assert model.seen_dtypes == [torch.float32, torch.float32]
    assert loss.dtype == torch.float32


@torch.library.custom_op("zcompile_test::matmul", mutates_args=())
def _custom_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A custom op autocast knows nothing of (as transformers' MoE ``_grouped_mm`` CPU fallback): torch.mm
    refuses mixed dtypes."""
    return torch.mm(x, w)


@_custom_matmul.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[1])


def _custom_matmul_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _custom_matmul_backward(ctx, grad):
    x, w = ctx.saved_tensors
    grad = grad.to(x.dtype)  # under eager autocast the next op's gradient may come in bf16
    return grad @ w.t(), x.t() @ grad


_custom_matmul.register_autograd(_custom_matmul_backward, setup_context=_custom_matmul_setup)


class _CustomOpNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 4))
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):  # x: an fp32 graph input, as the hidden state reaching transformers' grouped_mm is
        return self.head(_custom_matmul(x, self.weight)).square().mean()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_custom_op_computes_in_its_traced_dtypes(stage):
    """Autocast casts neither the inputs nor the outputs of a custom op: with param_dtype its weight came
    in bf16 beside an fp32 activation, and torch.mm inside it failed ("expected m1 and m2 to have the same
    dtype"; transformers' Mixtral and Qwen2-MoE on a CPU). Its inputs now take the dtypes Dynamo traced,
    as in eager torch.autocast with fp32 weights; loss and gradients follow that with bf16-rounded weights."""
    _assert_follows_eager_autocast(_CustomOpNet, torch.randn(6, 8), stage)
