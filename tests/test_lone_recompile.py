"""A rank that recompiles alone for its own input shapes trains, at stages 2 and 3, like DDP.

A collator that pads each rank's batch to its own longest sequence (transformers'
``DataCollatorWithPadding``, most hand-written ones) gives each rank its own lengths, so a length
changes on one rank while the others keep theirs, and Dynamo recompiles on that rank alone. The
compile's rank check waited for ranks that were not compiling, and every rank stopped in a
``RankDivergenceError`` (stage 3 at the second step), unless the user compiled with ``dynamic=True``.
The recompiled graph issues the collectives every rank agreed on at the first compile (they move the
parameters, whose shapes no input changes), so it is not checked again (``rank_check``'s agreed
signatures). Here a plain loop pads per rank, each rank in turn recompiling alone, against DDP with
``torch.optim.SGD`` in the same processes (one 2-rank launch). A recompile whose collectives
differ is still an error on every rank (``test_errors``, the "branch" case).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import zcompile
from support.launch import run_ranks
from support.models import build_model, global_batch, model_loss

# per step, each rank's sequence length: rank 1's changes alone at step 1, rank 0's alone at step 2
LENGTHS = ((16, 12), (16, 14), (10, 14), (13, 9))


def _train(rank: int, world: int, stage: int | None) -> dict:
    """Losses (mean over ranks) and final weights; ``stage`` None: DDP."""
    torch._dynamo.reset()
    model = build_model("gpt")
    if stage is None:
        module, optimizer = DDP(model), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        module = torch.compile(model, backend="zero", options={"stage": stage, "check_timeout_s": 20})
        # SGD: AdamW divides the attention key's bias gradient (zero but for rounding) by its own size
        optimizer = zcompile.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step, lengths in enumerate(LENGTHS):
        tokens, targets = global_batch(step, 2 * world)
        mine = slice(2 * rank, 2 * rank + 2)
        length = lengths[rank]
        loss = model_loss("gpt", module, tokens[mine, :length].contiguous(), targets[mine, :length].contiguous())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    with torch.no_grad() if stage is None else zcompile.gathered(model):
        weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "weights": weights}


def _each(rank: int, world: int) -> dict:
    return {stage: _train(rank, world, stage) for stage in (None, 2, 3)}


def test_a_rank_recompiling_alone_for_its_shapes_trains_like_ddp():
    for results in run_ranks(2, _each, timeout_s=240):
        reference = results[None]
        for stage in (2, 3):
            got = results[stage]
            torch.testing.assert_close(got["losses"], reference["losses"], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, stage=stage: f"stage {stage} losses: {m}")
            for name, weight in reference["weights"].items():
                torch.testing.assert_close(got["weights"][name], weight, rtol=1e-4, atol=1e-5,
                                           msg=lambda m, name=name, stage=stage: f"stage {stage} {name}: {m}")
