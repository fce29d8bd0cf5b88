"""Module buffers changed by a compiled graph (BatchNorm's running statistics) are the same on every
rank after each optimizer step: rank 0's, the values DDP (``broadcast_buffers=True``) would use at
its next forward.

Before, each rank's running statistics followed its own slice of the batch: after 3 steps rank 1's
running mean differed from rank 0's and so did the evaluation output of the same input (a silent
rank dependence of evaluation and of checkpoints). The reference is DDP in the same processes: its
rank 0 keeps its own chain of statistics (it broadcasts them at the start of each forward), which is
what every zcompile rank holds after each step. Tolerance: the weights are trained by the same
averaged gradients in both (1e-6 of their scale, ``support.training``), and the statistics are
means of the activations those weights make.
"""

import pytest
import torch
import torch.distributed as dist

import zcompile
from support.launch import run_ranks
from zcompile.agreement.abort_note import RankDivergenceError

STEPS, BATCH = 3, 8
BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def _cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 4),
    )


def _train(run, rank: int, world: int, optimizer) -> None:
    for step in range(STEPS):
        x = torch.randn(BATCH, 3, 8, 8, generator=torch.Generator().manual_seed(step))
        run(x[rank::world]).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _state(model: torch.nn.Module) -> dict:
    bn = model[1]
    state = {name: getattr(bn, name).clone() for name in BUFFERS}
    model.eval()
    with torch.no_grad(), zcompile.gathered(model):
        state["eval"] = model(torch.ones(1, 3, 8, 8))
    return state


def buffers_on_rank(rank: int, world: int) -> dict:
    out = {}
    for name, options in {
        "stage 1": {"stage": 1},
        "stage 2": {"stage": 2},
        "stage 3": {"stage": 3},
        "stage 2, per rank": {"stage": 2, "broadcast_buffers": False},
    }.items():
        torch._dynamo.reset()
        model = _cnn()
        optimizer = zcompile.optim.SGD(model.parameters(), lr=0.1)
        _train(torch.compile(model, backend="zero", options=options), rank, world, optimizer)
        out[name] = _state(model)
    model = _cnn()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    _train(ddp, rank, world, torch.optim.SGD(model.parameters(), lr=0.1))
    out["ddp"] = {name: getattr(model[1], name).clone() for name in BUFFERS}
    out["train_on_one_rank"] = _train_on_one_rank(rank, world)
    dist.barrier()
    return out


def _train_on_one_rank(rank: int, world: int) -> str | None:
    """A step in training mode on rank 0 and eval mode on rank 1, both graphs compiled by earlier steps
    (so no compile-time check runs): rank 0's call changed the statistics, rank 1's did not."""
    torch._dynamo.reset()
    model = _cnn()
    optimizer = zcompile.optim.SGD(model.parameters(), lr=0.1)
    run = torch.compile(model, backend="zero", options={"stage": 2})
    x = torch.randn(BATCH, 3, 8, 8, generator=torch.Generator().manual_seed(0))[rank::world]
    try:
        for mode in ("both train", "both eval", "rank 0 trains"):
            model.train(mode == "both train" or (mode == "rank 0 trains" and rank == 0))
            run(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    except RankDivergenceError as error:
        return str(error)
    return None


@pytest.fixture(scope="module")
def world2():
    return run_ranks(2, buffers_on_rank)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_changed_buffers_are_rank_0s_on_every_rank_like_ddp(world2, stage):
    ddp_rank0 = world2[0]["ddp"]
    assert not torch.equal(world2[1]["ddp"]["running_mean"], ddp_rank0["running_mean"])  # the ranks' data differ
    for rank_runs in world2:
        run = rank_runs[f"stage {stage}"]
        assert int(run["num_batches_tracked"]) == STEPS
        for name in ("running_mean", "running_var"):
            torch.testing.assert_close(run[name], ddp_rank0[name], rtol=1e-5, atol=1e-6, msg=name)
        assert torch.equal(run["eval"], world2[0][f"stage {stage}"]["eval"])  # the same evaluation on every rank


def test_a_module_in_training_mode_on_one_rank_is_an_error_on_every_rank(world2):
    """Rank 0 would broadcast the statistics its call changed and rank 1 nothing: a wait with no end
    before the step's agreement compared what each changed."""
    for rank_runs in world2:
        error = rank_runs["train_on_one_rank"]
        assert error is not None and "changed different module buffers" in error and "same mode" in error
        assert "3 buffers" in error and "'none'" in error


def test_broadcast_buffers_false_keeps_each_ranks_own(world2):
    ours = [rank_runs["stage 2, per rank"]["running_mean"] for rank_runs in world2]
    assert not torch.equal(ours[0], ours[1])
    torch.testing.assert_close(ours[0], world2[0]["ddp"]["running_mean"], rtol=1e-5, atol=1e-6)


def test_the_plan_lists_buffers_and_the_graph_records_which_it_changes():
    """World of one: the plan finds the registered buffers by their source (the input and the
    weights are not buffers); the training graph changes all three, the evaluation graph none."""
    seen = []
    torch._dynamo.reset()
    model = _cnn()
    compiled = torch.compile(model, backend="zero", options={"stage": 2, "on_compile": seen.append})
    compiled(torch.randn(2, 3, 8, 8)).sum().backward()
    model.eval()
    with torch.no_grad():
        compiled(torch.randn(2, 3, 8, 8))
    train, evaluation = seen
    names = sorted(name for _, name in train.plan.buffers)
    assert names == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    assert {index for index, _ in train.plan.buffers} <= set(train.mutated_inputs)
    assert evaluation.mutated_inputs == ()
    torch._dynamo.reset()
