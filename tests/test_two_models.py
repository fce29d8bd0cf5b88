"""Two compiled models trained against each other (a GAN), each rank its slice of a global batch,
at stages 1, 2 and 3 on 2 gloo ranks (one launch), against DDP in the same processes.

The loop is the usual one: the discriminator called twice before its backward (real, and the
generator's output detached), its step; then the generator's loss through the discriminator, whose
gradients are cleared unused. Both models run the same ``nn.Sequential.forward``, so Dynamo compiles
one frame for the two of them and marks sizes dynamic on its second compile (automatic dynamic
shapes). Each rank slices its part of the global batch, ``x[rank * b:(rank + 1) * b]``, so the
storage offset of a rank's input differs between ranks and between the two models: rank 1 makes the
offset symbolic where rank 0 keeps 0. Rank 1's forward then saves a symbolic size for its backward,
and AOTAutograd compiles that backward with the forward there, and at its first call on rank 0. The
rank check of a backward's issue order ran at its compile: rank 1's met rank 0's check of the
next forward, a false ``RankDivergenceError`` at stage 3 and, at stage 2, the differ-er crashed
(``TypeError: unhashable type: 'slice'``). It now runs at the backward's first call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zcompile
from support.launch import run_ranks

STEPS, PER_RANK = 3, 4


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the step's global batch (a view at a rank-dependent storage offset)."""
    generator = torch.Generator().manual_seed(100 + step)
    real = torch.randn(PER_RANK * world, 8, generator=generator) * 0.5 + 1.0
    noise = torch.randn(PER_RANK * world, 4, generator=generator)
    part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return real[part], noise[part]


def _train_gan(rank: int, world: int, stage: int | None) -> dict:
    """Losses and final weights of the GAN loop; ``stage`` None: DDP with torch.optim.AdamW."""
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    optimizer_class = torch.optim.AdamW if stage is None else zcompile.optim.AdamW
    opt_g = optimizer_class(generator.parameters(), lr=1e-2, betas=(0.5, 0.999))
    opt_d = optimizer_class(discriminator.parameters(), lr=1e-2, betas=(0.5, 0.999))
    if stage is None:
        gen, disc = DDP(generator), DDP(discriminator)
    else:
        options = {"stage": stage}
        gen = torch.compile(generator, backend="zero", options=options)
        disc = torch.compile(discriminator, backend="zero", options=options)
    bce = nn.BCEWithLogitsLoss()
    ones, zeros = torch.ones(PER_RANK, 1), torch.zeros(PER_RANK, 1)
    losses = []
    for step in range(STEPS):
        real, noise = _batch(step, rank, world)
        fake = gen(noise)
        d_loss = bce(disc(real), ones) + bce(disc(fake.detach()), zeros)
        d_loss.backward()
        opt_d.step()
        opt_d.zero_grad()
        g_loss = bce(disc(fake), ones)
        g_loss.backward()
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()  # the discriminator's gradients of the generator's loss go unused
        for loss in (d_loss, g_loss):
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
    weights = {}
    for name, module in (("generator", generator), ("discriminator", discriminator)):
        with torch.no_grad() if stage is None else zcompile.gathered(module):
            weights.update({f"{name}.{k}": v.detach().clone() for k, v in module.named_parameters()})
    return {"losses": losses, "weights": weights}


def _gan_at_each_stage(rank: int, world: int) -> dict:
    torch._dynamo.reset()
    runs = {"ddp": _train_gan(rank, world, None)}
    for stage in (1, 2, 3):
        torch._dynamo.reset()  # each stage compiles the shared frame afresh, as a new process would
        runs[stage] = _train_gan(rank, world, stage)
    return runs


def test_a_gan_trains_as_ddp_at_every_stage():
    rank0, _ = run_ranks(2, _gan_at_each_stage, timeout_s=240)
    reference = rank0["ddp"]
    for stage in (1, 2, 3):
        run = rank0[stage]
        torch.testing.assert_close(run["losses"], reference["losses"], rtol=1e-6, atol=0)
        for name, weight in reference["weights"].items():
            # 3 AdamW steps of lr 1e-2 from the same start: the same sums in another order
            torch.testing.assert_close(run["weights"][name], weight, rtol=0, atol=1e-6, msg=f"stage {stage} {name}")
