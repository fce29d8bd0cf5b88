"""A torch optimizer over zcompile parameters (``zcompile.routes.optimizer_guard``): an error at its first
``step()``, naming the parameter and ``zcompile.optim``, where it used to train nothing at stages 2
and 3 (0 of 28 weights moved in 3 steps of this GPT, no word) and, on several ranks at stage 1,
to apply each rank's own gradient. Optimizers of other models, and wrappers of a zcompile
optimizer (accelerate's ``AcceleratedOptimizer`` holds it as ``.optimizer``), step as before."""

import pytest
import torch

import zcompile
from support.models import build_model, global_batch
from zcompile.routes.optimizer_guard import ForeignOptimizerError, is_zcompile_optimizer


def _compiled(stage: int):
    torch._dynamo.reset()
    model = build_model("gpt")
    return model, torch.compile(model, backend="zero", options={"stage": stage})


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_torch_optimizer_over_zcompile_parameters_refuses_to_step(stage):
    model, compiled = _compiled(stage)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with zcompile.gathered(model):
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
    compiled(*global_batch(0, 4)).backward()
    with pytest.raises(
        ForeignOptimizerError,
        match=r"torch\.optim\.adamw\.AdamW\.step\(\).*'wte\.weight'.*"
        r"zcompile\.optim\.AdamW",
    ):
        optimizer.step()
    with zcompile.gathered(model):
        assert all(torch.equal(before[name], p) for name, p in model.named_parameters())


def test_zcompile_optimizers_wrappers_and_other_models_step():
    model, compiled = _compiled(3)
    ours = zcompile.optim.AdamW(model.parameters(), lr=1e-2)

    class Wrapper(torch.optim.Optimizer):  # accelerate's pattern: the real optimizer as .optimizer
        def __init__(self, optimizer):
            self.optimizer = optimizer
            super().__init__(optimizer.param_groups, {})

        def step(self, closure=None):
            return self.optimizer.step(closure)

    wrapped = Wrapper(ours)
    assert is_zcompile_optimizer(ours) and is_zcompile_optimizer(wrapped)
    with zcompile.gathered(model):
        before = model.wte.weight.detach().clone()
    compiled(*global_batch(0, 4)).backward()
    wrapped.step()  # through torch's step hooks of both
    with zcompile.gathered(model):
        assert not torch.equal(before, model.wte.weight)
    plain = build_model("gpt")  # another model: torch's optimizer as ever
    torch_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    plain(*global_batch(0, 4)).backward()
    weight = plain.wte.weight.detach().clone()
    torch_optimizer.step()
    assert not torch.equal(weight, plain.wte.weight)


def _one_rank_has_a_torch_optimizer(rank: int, world: int) -> str:
    import time

    from zcompile.agreement.abort_note import RankDivergenceError

    model, compiled = _compiled(2)
    optimizer = (torch.optim.AdamW if rank == 0 else zcompile.optim.AdamW)(model.parameters(), lr=1e-2)
    compiled(*global_batch(0, 4)).backward()
    start = time.perf_counter()
    try:
        optimizer.step()
    except (ForeignOptimizerError, RankDivergenceError) as error:
        return f"{type(error).__name__} after {time.perf_counter() - start:.1f}s: {error}"
    return "stepped"


def test_a_torch_optimizer_on_one_rank_only_stops_both_ranks_quoting_it():
    """Rank 0 built torch's AdamW, rank 1 zcompile's: rank 0 raises at once, and rank 1, waiting in its
    step's agreement, quotes it in seconds (the abort note), not after check_timeout_s."""
    from support.launch import run_ranks

    rank0, rank1 = run_ranks(2, _one_rank_has_a_torch_optimizer)
    assert rank0.startswith("ForeignOptimizerError")
    assert rank1.startswith("RankDivergenceError") and "rank 0 reported" in rank1 and "zcompile.optim.AdamW" in rank1
    assert float(rank1.split(" after ")[1].split("s:")[0]) < 30, rank1
