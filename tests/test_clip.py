"""Gradient clipping (``zcompile.optim.clip``): the global norm of the averaged gradient at every stage,
through ``optimizer.clip_grad_norm_``, ``max_grad_norm=`` and ``torch.nn.utils.clip_grad_norm_``,
against one process clipping its global-batch gradient with ``torch.nn.utils.clip_grad_norm_``.

Norms are compared at 1e-6 relative: both sides sum the same squares in different orders (fp32
per-tensor norms; here shards of the averaged gradient, there full tensors), about 1e-7 relative.
"""

import math

import pytest
import torch

import zcompile
from support.launch import run_ranks
from support.models import build_model, global_batch
from support.training import RunSpec, assert_same_training, train_reference, train_zero, zero_run_on_rank
from zcompile.common.process_group import DataParallelGroup
from zcompile.optim.clip import clip_grad_norm_of_shards, global_grad_norm
from zcompile.routes import install as install_routes
from zcompile.routes.clip_grad import install_torch_clip_patch
from zcompile.routes.patched import ORIGINAL_ATTR
from zcompile.sharding.shards import shard_parameter

NORM_RTOL = 1e-6

# SGD runs: a clip coefficient that is wrong by any factor moves the parameters (Adam would hide it).
# Global-batch norms over these steps: the example GPT's 2-norm 0.84-1.11, its inf-norm 0.12-0.18;
# the GPT with breaks in its loop, 0.64-0.79: every step clips.
CLIPPED = {
    "stage1_optimizer": RunSpec(stage=1, optimizer="sgd", lr=0.1, clip=0.5, clip_via="optimizer"),
    "stage2_torch": RunSpec(stage=2, optimizer="sgd", lr=0.1, clip=0.5, clip_via="torch"),
    "stage3_max_grad_norm": RunSpec(stage=3, optimizer="sgd", lr=0.1, clip=0.5, clip_via="option"),
    "stage1_torch_inf": RunSpec(stage=1, optimizer="sgd", lr=0.1, clip=0.05, clip_norm_type=math.inf, clip_via="torch"),
    # embeddings and head train outside any graph: the torch route gives them stage-1 shards
    "stage3_eager_params_torch": RunSpec(
        model="gpt_loop_breaks", stage=3, optimizer="sgd", lr=0.1, clip=0.5, clip_via="torch"
    ),
}
UNCLIPPED = {
    "stage1_huge_max_norm": RunSpec(stage=1, optimizer="adamw", clip=1e9, clip_via="option"),
    "stage1_unclipped": RunSpec(stage=1, optimizer="adamw"),
}
SPECS = {**CLIPPED, **UNCLIPPED}


@pytest.fixture(scope="module")
def clip_runs():
    ranks = run_ranks(2, zero_run_on_rank, list(SPECS.values()), timeout_s=600)
    return [dict(zip(SPECS, results)) for results in ranks]


@pytest.mark.parametrize("name", sorted(CLIPPED))
def test_clipped_training_equals_single_process_clipping(clip_runs, name):
    spec, ours = CLIPPED[name], clip_runs[0][name]
    reference = train_reference(spec, world=2)
    assert any(norm > spec.clip for norm in reference.grad_norms), reference.grad_norms  # it really clipped
    assert len(ours.grad_norms) == spec.steps
    for norm, expected in zip(ours.grad_norms, reference.grad_norms, strict=True):
        assert abs(norm - expected) <= NORM_RTOL * expected, (ours.grad_norms, reference.grad_norms)
    assert clip_runs[1][name].grad_norms == ours.grad_norms  # one global norm, the same on every rank
    assert_same_training(ours, reference, spec)


def test_huge_max_norm_is_bitwise_unclipped_training(clip_runs):
    clipped, plain = clip_runs[0]["stage1_huge_max_norm"], clip_runs[0]["stage1_unclipped"]
    assert len(clipped.grad_norms) == 3 and all(0 < n < 1e9 for n in clipped.grad_norms)
    assert clipped.losses == plain.losses
    for name, value in plain.params.items():
        assert torch.equal(clipped.params[name], value), name


def test_stage1_clipping_moves_the_same_gradients_plus_one_scalar(clip_runs):
    """The early reduce-scatter replaces the step's (same elements), plus the norm's all-reduce."""

    def optimizer_elements(result, kind):
        return sum(c.elements for c in result.collectives if c.where == "optimizer" and c.kind == kind)

    clipped, plain = clip_runs[0]["stage1_huge_max_norm"], clip_runs[0]["stage1_unclipped"]
    for kind in ("reduce_scatter", "all_gather"):
        assert optimizer_elements(clipped, kind) == optimizer_elements(plain, kind) > 0, kind
    assert optimizer_elements(clipped, "all_reduce") == 1 and optimizer_elements(plain, "all_reduce") == 0


# --- without processes: hand-built shards and a world of one -------------------------------------------


def _shards(shapes, stage, world=1, rank=0, seed=0):
    """Parameters sharded as the backend shards them: the torch routes installed first."""
    install_routes()
    group = DataParallelGroup(rank=rank, world_size=world, name=None if world == 1 else "g", process_group=None)
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]
    return params, [shard_parameter(p, f"p{i}", stage, group) for i, p in enumerate(params)]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
def test_norm_and_clip_of_shards_equal_torch(norm_type):
    params, members = _shards([(7, 5), (13,), (1,)], stage=2)
    grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i + 10)) for i, p in enumerate(params)]
    for member, grad in zip(members, grads):
        member.shard.grad = grad.reshape(-1).clone()
    plain = [torch.nn.Parameter(torch.zeros(p.shape)) for p in params]
    for p, grad in zip(plain, grads):
        p.grad = grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(plain, 0.5, norm_type)
    norm = clip_grad_norm_of_shards(members, 0.5, norm_type)
    assert norm.dtype == torch.float32 and expected > 0.5
    torch.testing.assert_close(norm, expected, rtol=NORM_RTOL, atol=0)
    for member, p in zip(members, plain):
        torch.testing.assert_close(member.shard.grad, p.grad.reshape(-1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_padded_shards_of_two_ranks_give_the_full_norm(norm_type):
    """Both ranks' shards of a (7, 5) parameter (18 elements each, one zero of padding): the sum the
    all-reduce makes is the norm of the full gradient."""
    grad = torch.randn(7, 5, generator=torch.Generator().manual_seed(3))
    members = []
    for rank in range(2):
        _, (member,) = _shards([(7, 5)], stage=2, world=2, rank=rank)
        member.shard.grad = torch.nn.functional.pad(grad.reshape(-1), (0, 1))[rank * 18 : (rank + 1) * 18].clone()
        members.append(member)
    norm, record = global_grad_norm(members, norm_type, None, torch.device("cpu"))
    assert record is None
    torch.testing.assert_close(norm, torch.linalg.vector_norm(grad, norm_type), rtol=NORM_RTOL, atol=0)


def test_torch_clip_is_routed_and_the_unrouted_one_raises():
    params, members = _shards([(4, 3)], stage=3)
    assert hasattr(torch.nn.utils.clip_grad_norm_, ORIGINAL_ATTR)  # installed before the first shard
    routed = torch.nn.utils.clip_grad_norm_
    install_torch_clip_patch()
    assert torch.nn.utils.clip_grad_norm_ is routed is torch.nn.utils.clip_grad.clip_grad_norm_  # idempotent
    members[0].shard.grad = torch.full((12,), 2.0)
    assert params[0].grad is None  # stage 3: torch's function would see no gradient at all
    norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    torch.testing.assert_close(norm, torch.tensor(math.sqrt(48.0)))
    torch.testing.assert_close(members[0].shard.grad, torch.full((12,), 2.0 / (math.sqrt(48.0) + 1e-6)))
    # a reference to torch's function bound before the patch: raises with the fix instead of clipping nothing
    unrouted = getattr(routed, ORIGINAL_ATTR)
    with pytest.raises(RuntimeError, match="optimizer.clip_grad_norm_"):
        unrouted(params, 1.0)
    with pytest.raises(RuntimeError, match="max_grad_norm="):
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, torch.tensor(1.0))
    # parameters without shards still go to torch's function
    plain = torch.nn.Parameter(torch.ones(3))
    plain.grad = torch.full((3,), 4.0)
    torch.testing.assert_close(torch.nn.utils.clip_grad_norm_([plain], 1.0), torch.tensor(math.sqrt(48.0)))


def test_clip_grad_value_clamps_the_averaged_gradient():
    params, members = _shards([(5, 2)], stage=1)
    params[0].grad = torch.linspace(-2, 2, 10).reshape(5, 2)
    torch.nn.utils.clip_grad_value_(params, 0.5)
    assert params[0].grad is None  # stage 1: reduced onto the shard (a world of one: copied)
    torch.testing.assert_close(members[0].shard.grad, torch.linspace(-2, 2, 10).clamp(-0.5, 0.5))


def test_invalid_arguments_are_errors():
    params, members = _shards([(3,)], stage=2)
    with pytest.raises(ValueError, match="max_grad_norm"):
        zcompile.optim.SGD(params, lr=0.1, max_grad_norm=0)
    with pytest.raises(ValueError, match="norm_type"):
        clip_grad_norm_of_shards(members, 1.0, norm_type=0)


def test_eager_stage1_clip_then_more_backward_equals_torch():
    """A world of one without compile (the optimizer shards eagerly, stage 1): a backward after
    ``clip_grad_norm_`` is folded into the early-reduced gradient; ``zero_grad(set_to_none=False)``
    keeps working; ``last_grad_norm`` is None on a step that did not clip."""
    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(6, 4), torch.nn.Linear(6, 4)
    theirs.load_state_dict(ours.state_dict())
    opt = zcompile.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    ref = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(3, 8, 6)
    for step in range(3):
        for model in (ours, theirs):
            model(x[step]).square().sum().backward()
        norm = opt.clip_grad_norm_(1.0) if step < 2 else None
        expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0) if step < 2 else None
        for model in (ours, theirs):
            model(x[step] * 0.5).square().sum().backward()  # after the clip: not clipped, on both
        opt.step()
        ref.step()
        assert opt.last_grad_norm == (None if norm is None else float(norm))
        if norm is not None:
            torch.testing.assert_close(norm, expected, rtol=NORM_RTOL, atol=0)
        opt.zero_grad(set_to_none=False)
        ref.zero_grad(set_to_none=False)
    for mine, reference in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(mine, reference, rtol=0, atol=1e-6)


def test_world_of_one_compiled_clipping_and_report():
    spec = RunSpec(stage=1, optimizer="sgd", lr=0.1, clip=0.5, clip_via="torch")
    assert_same_training(train_zero(spec), train_reference(spec), spec)
    torch._dynamo.reset()
    model = build_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "compiler": "eager"})
    opt = zcompile.optim.AdamW(model.parameters(), lr=1e-3, max_grad_norm=0.5)
    tokens, targets = global_batch(0, 4)
    compiled(tokens, targets).backward()
    opt.step()
    report = zcompile.step_report(model, opt)
    assert report.grad_norm == opt.last_grad_norm > 0.5
    assert report.to_dict()["grad_norm"] == report.grad_norm
    assert any(line.startswith("gradient norm") for line in report.summary_lines())


@pytest.mark.parametrize("stage, warned", [(1, False), (3, True)])
def test_a_weight_trained_eagerly_is_warned_of_only_where_it_holds_more_than_the_compiled_ones(caplog, stage, warned):
    """A temperature beside a compiled tower (CLIP's ``logit_scale``) gets its gradient in eager code. At
    stage 3 it stays replicated where the tower is sharded (a warning, naming it); at stage 1 it holds
    what the tower's weights hold, so the same words are only information."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    tower = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    scale = torch.nn.Parameter(torch.tensor(2.0))
    compiled = torch.compile(tower, backend="zero", options={"stage": stage})
    opt = zcompile.optim.AdamW([*tower.parameters(), scale], lr=1e-2)
    with caplog.at_level("INFO", logger="zcompile.sharding.shards"):
        (compiled(torch.randn(4, 8)) * scale.exp()).square().mean().backward()
        torch.nn.utils.clip_grad_norm_([*tower.parameters(), scale], 1.0)
        opt.step()
    said = [r for r in caplog.records if "got a gradient outside the compiled graphs" in r.getMessage()]
    assert len(said) == 1 and "#4 of the clipped parameters of shape ()" in said[0].getMessage()
    assert (said[0].levelname == "WARNING") is warned
