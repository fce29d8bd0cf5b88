"""A user's unchanged loss-scaling loop (``torch.amp.GradScaler``: scale, backward, ``unscale_``,
clip, ``step``, ``update``) with one rank's loss infinite at one step, and its single-process
reference on the global batch: what the GradScaler tests train and compare."""

from __future__ import annotations

import math

import torch

from support.models import build_model, global_batch

STEPS, BATCH, OVERFLOW_STEP, INIT_SCALE = 4, 8, 1, 2.0**10


def scaled_loss(model, step: int, rank: int, world: int) -> torch.Tensor:
    """This rank's mean loss over its slice of the global batch; the last rank's is infinite at OVERFLOW_STEP."""
    tokens, targets = global_batch(step, BATCH)
    per_rank = BATCH // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    loss = model(tokens[mine], targets[mine])
    return loss * math.inf if (step == OVERFLOW_STEP and rank == world - 1) else loss


def scaled_loop(model, loss_fn, optimizer, clip: bool) -> dict:
    """STEPS steps of the loop; the scale after each and, with ``clip``, the pre-clip norms."""
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    scales, norms = [], []
    for step in range(STEPS):
        scaler.scale(loss_fn(step)).backward()
        if clip:
            scaler.unscale_(optimizer)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scales.append(scaler.get_scale())
    return {"scales": scales, "norms": norms}


def scaled_reference(world: int, clip: bool, model_name: str = "gpt") -> dict:
    """One process, torch's SGD and GradScaler, the global batch's loss (the ranks' mean losses averaged)."""
    model = build_model(model_name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    run = scaled_loop(
        model, lambda step: sum(scaled_loss(model, step, r, world) for r in range(world)) / world, optimizer, clip
    )
    run["params"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    return run
