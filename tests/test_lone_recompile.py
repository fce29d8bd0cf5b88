"""A rank that recompiles alone for its own input shapes trains, at stages 2 and 3, like DDP.

A collator that pads each rank's batch to its own longest sequence (transformers'
``DataCollatorWithPadding``, most hand-written ones) gives each rank its own lengths, so a length
changes on one rank while the others keep theirs, and Dynamo recompiles on that rank alone. The
compile's rank check waited for ranks that were not compiling, and every rank stopped in a
``RankDivergenceError`` (stage 3 at the second step), unless the user compiled with
``dynamic=True``; with two micro-batches a step, stage 3's agreement on each call then compared the
compile ids of the ranks' graphs (0/0 against 0/1). The recompiled graph issues the collectives
every rank agreed on at the first compile (they move the parameters, whose shapes no input changes),
so it is not checked again (``rank_check``'s agreed signatures), and a call is named by its
collectives and mode (``rank_check.call_identity``). Here a plain loop pads per rank, each rank in
turn recompiling alone, against DDP with ``torch.optim.SGD`` in the same processes (one 2-rank
launch). A recompile whose collectives differ is still an error on every rank (``test_errors``, the
"branch" case).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import zcompile
from support.launch import run_ranks
from support.models import build_model, global_batch, model_loss

# per step, two micro-batches, each with each rank's sequence length: rank 1's changes alone at the
# second micro-batch of step 0 (its call then meets rank 0's call of the first graph: stage 3 agrees on
# every call after a step's first), rank 0's alone at the first of step 1
LENGTHS = (((16, 12), (16, 14)), ((10, 14), (13, 9)))


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
    for step, micro_batches in enumerate(LENGTHS):
        for micro, lengths in enumerate(micro_batches):
            tokens, targets = global_batch(2 * step + micro, 2 * world)
            mine, length = slice(2 * rank, 2 * rank + 2), lengths[rank]
            loss = model_loss("gpt", module, tokens[mine, :length].contiguous(), targets[mine, :length].contiguous())
            (loss / len(micro_batches)).backward()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        optimizer.step()
        optimizer.zero_grad()
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
            torch.testing.assert_close(
                got["losses"],
                reference["losses"],
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, stage=stage: f"stage {stage} losses: {m}",
            )
            for name, weight in reference["weights"].items():
                torch.testing.assert_close(
                    got["weights"][name],
                    weight,
                    rtol=1e-4,
                    atol=1e-5,
                    msg=lambda m, name=name, stage=stage: f"stage {stage} {name}: {m}",
                )
