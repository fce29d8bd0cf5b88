"""Freezing and unfreezing parameters between steps (``p.requires_grad_(False)``), as gradual
unfreezing and partial fine-tuning do.

Dynamo recompiles when a parameter's ``requires_grad`` changes, but the zero graphs take a stand-in
for the parameter (stage 3: its shard; stage 2: the tensor its gradient shard lands on; stage 1 with
``param_dtype``: the low-precision replica), and that stand-in kept the flag the parameter had when
it was first sharded: a frozen weight went on training and an unfrozen one stayed frozen, with no
error (``backend._follow_requires_grad``). One process is enough to see it: the stand-ins are the
same at any world size.

Reference: the same loop on the plain model with ``torch.optim.AdamW`` (fp32, one process, the
same batches and freezing schedule). A parameter frozen at a step takes no update in either
(``grad`` None, so AdamW skips it, weight decay included); the schedule freezes one weight at
step 0, unfreezes it at 2 and freezes it again at 4, so the last switch runs a graph compiled
earlier for the frozen setting (where Dynamo does not recompile on the flag, torch 2.11, the
loop calls ``torch.compiler.reset()`` after each switch, as zcompile's ``StaleGraphError`` says).
Tolerance: 1e-6 relative on losses and 1e-5 absolute on weights, as ``support.training`` derives
for AdamW at lr 1e-2 over a few steps in fp32.
"""

from __future__ import annotations

import pytest
import torch

import zcompile
from support.launch import run_ranks
from support.models import GPT, GPTConfig, synthetic_batch

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)
STEPS = 6
SCHEDULE = {0: False, 2: True, 4: False}  # step -> requires_grad of the switched weight from that step on
SWITCHED = "blocks.0.mlp.0.weight"


def _dynamo_guards_requires_grad() -> bool:
    """Whether Dynamo recompiles a frame when a parameter's ``requires_grad`` changes (torch 2.13
    does; 2.11 runs the old graph, and a plain ``torch.compile`` leaves an unfrozen weight without
    a gradient)."""
    torch._dynamo.reset()
    linear = torch.nn.Linear(2, 2)
    compiled = torch.compile(linear, backend="aot_eager")  # autograd traced: a stale graph gives no gradient
    linear.weight.requires_grad_(False)
    compiled(torch.ones(1, 2)).sum().backward()
    linear.weight.requires_grad_(True)
    compiled(torch.ones(1, 2)).sum().backward()
    torch._dynamo.reset()
    return linear.weight.grad is not None


# where Dynamo does not, the loop does what zcompile's StaleGraphError tells users to do
RESET_AFTER_SWITCH = not _dynamo_guards_requires_grad()


def _train(stage: int | None, param_dtype: str | None = None) -> tuple[list[float], list[torch.Tensor]]:
    """Losses, and the switched weight after every step (full, fp32), of the schedule's run."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    weight = dict(model.named_parameters())[SWITCHED]
    if stage is None:
        optimizer, run = torch.optim.AdamW(model.parameters(), lr=1e-2), model
    else:
        optimizer = zcompile.optim.AdamW(model.parameters(), lr=1e-2)
        run = torch.compile(model, backend="zero", options={"stage": stage, "param_dtype": param_dtype})
    losses, weights = [], []
    for step in range(STEPS):
        if step in SCHEDULE:
            weight.requires_grad_(SCHEDULE[step])
            if RESET_AFTER_SWITCH and stage is not None:
                torch.compiler.reset()
        tokens, targets = synthetic_batch(step, 2, CONFIG)
        loss = run(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        with zcompile.gathered(model):
            weights.append(weight.detach().float().clone())
    return losses, weights


@pytest.fixture(scope="module")
def reference():
    return _train(None)


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_frozen_and_unfrozen_weights_train_as_in_torch(stage, reference):
    losses, weights = _train(stage)
    ref_losses, ref_weights = reference
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for step, (got, want) in enumerate(zip(weights, ref_weights)):
        assert torch.allclose(got, want, atol=1e-5, rtol=0), f"step {step}: {(got - want).abs().max():.3g}"


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_frozen_weight_does_not_move_with_param_dtype(stage):
    """bf16 has no fp32 reference to equal; the schedule's effect is exact though: the weight moves
    in every step it is trainable and not at all in the others (bf16 replicas at stages 1 and 2)."""
    _, weights = _train(stage, param_dtype="bf16")
    before = [None, *weights[:-1]]
    for step in range(1, STEPS):
        trainable = SCHEDULE[max(s for s in SCHEDULE if s <= step)]
        moved = bool((weights[step] != before[step]).any())
        assert moved == trainable, f"step {step}: trainable {trainable}, moved {moved}"


def test_a_graph_traced_for_the_other_requires_grad_is_an_error():
    """A graph that Dynamo reuses although a parameter's ``requires_grad`` changed (torch 2.11 does
    not guard the flag) would train the parameter as it was traced: an error names the fix."""
    from zcompile.backend.shard_swap import ShardSwap, StaleGraphError
    from zcompile.common.process_group import DataParallelGroup
    from zcompile.passes.param_collectives import ParamInput, ShardingPlan

    plan = ShardingPlan(
        stage=3,
        world_size=1,
        group_name=None,
        param_dtype=None,
        reduce_dtype=None,
        params=[ParamInput(0, "head.weight", (2, 2), requires_grad=False)],
    )
    weight = torch.nn.Parameter(torch.ones(2, 2))  # requires grad: unfrozen since the graph was traced
    with pytest.raises(
        StaleGraphError,
        match=r"'head\.weight' has requires_grad=True.*traced with "
        r"requires_grad=False.*torch\.compiler\.reset\(\)",
    ):
        ShardSwap(plan, DataParallelGroup.resolve()).swap([weight, torch.ones(1)])


def _one_rank_switches(rank: int, world: int) -> dict:
    """Rank 0 alone calls a graph with a parameter it unfroze (a user's per-rank branch); rank 1, which
    would be waiting in that graph's collectives, reads why once rank 0 has stopped."""
    from zcompile.agreement.abort_note import RankDivergenceError, raise_if_aborted
    from zcompile.backend.shard_swap import ShardSwap, StaleGraphError
    from zcompile.common.process_group import DataParallelGroup, default_store
    from zcompile.passes.param_collectives import ParamInput, ShardingPlan

    group = DataParallelGroup.resolve()
    plan = ShardingPlan(
        stage=1,
        world_size=world,
        group_name=group.name,
        param_dtype=None,
        reduce_dtype=None,
        params=[ParamInput(0, "head.weight", (2, 2), requires_grad=False)],
    )
    weight = torch.nn.Parameter(torch.ones(2, 2), requires_grad=rank == 0)
    store, out = default_store(), {}
    if rank == 0:
        with pytest.raises(StaleGraphError) as raised:
            ShardSwap(plan, group).swap([weight, torch.ones(1)])
        out["own"] = str(raised.value)
        raise_if_aborted(group, raised.value)  # its own note: nothing more to say
        store.set("test/stopped", "1")
    else:
        store.wait(["test/stopped"])
        with pytest.raises(RankDivergenceError) as raised:
            raise_if_aborted(group, RuntimeError("Connection closed by peer"))
        out["other"] = str(raised.value)
    return out


def test_a_stale_graph_on_one_rank_is_quoted_by_the_others():
    rank0, rank1 = run_ranks(2, _one_rank_switches)
    assert "'head.weight' has requires_grad=True" in rank0["own"]
    assert rank1["other"].startswith(
        "zcompile: rank 1 stopped because rank 0 reported: zcompile: parameter 'head.weight'"
    )
