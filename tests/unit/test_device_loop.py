"""A training loop on one rank of whatever device there is: the CUDA paths that gloo tests never take.

The multi-rank tests run on CPU tensors, where the optimizer runs torch's fused CPU AdamW, the
clip and checkpoint code move CPU tensors and no Triton kernel is compiled. On a GPU
(``benchmarks/gpu_check.py`` runs this file there) the same loop runs on CUDA tensors: the Triton
AdamW, gradient shards on the GPU, ``clip_grad_norm_`` routed to the shards, a DCP checkpoint of
CUDA shards resumed into a fresh model, ``zcompile.gathered``. On a CPU it runs stage 3 only (the
other stages' CPU paths are the multi-rank tests').

The loop: the example GPT (tied embedding), two parameter groups, a warmup schedule, two
micro-batches a step, ``torch.nn.utils.clip_grad_norm_`` at a norm the gradients exceed, an
evaluation under ``no_grad`` every other step; the reference is the same loop on a copy of the
model, eager, with ``torch.optim.AdamW`` (eps 1e-6, as ``support.training`` explains). Tolerances: one rank, the same ATen kernels forward and
backward, so losses and norms differ only where the updates do: the fused AdamW rounds an ulp
apart from torch's per step (``test_fused_optim.py``: 10 steps within rtol 1e-5), which the
moments carry, so rtol 1e-5 on losses and norms and atol 1e-5 on weights of size ~0.1-1 after
``STEPS`` updates of lr 1e-2 (plus the zero-gradient noise term of ``PARAM_ATOL``). A wrong clip, learning rate or skipped update is off by >= 1e-3.
"""

from __future__ import annotations

import pytest
import torch

import zcompile
import zcompile.checkpoint
import zcompile.optim
from support.models import GPT, GPTConfig, synthetic_batch
from support.training import ADAM_EPS, GRAD_ABS_ERROR

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
STAGES = (1, 2, 3) if DEVICE == "cuda" else (3,)
STEPS, RESUME_AT, MICRO, MAX_NORM, LR = 5, 3, 2, 0.5, 1e-2
# weights: the updates' ulp differences (1e-5), plus the key third of the qkv bias, whose gradient is
# zero in theory and rounding noise in practice, which Adam divides by its eps (support.training)
PARAM_ATOL = 1e-5 + STEPS * LR * GRAD_ABS_ERROR / ADAM_EPS
CONFIG = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)


def _groups(model):
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 5e-3},
    ]


def _batch(index: int):
    return tuple(t.to(DEVICE) for t in synthetic_batch(index, 4, CONFIG))


def _build():
    torch.manual_seed(0)
    return GPT(CONFIG).to(DEVICE)


def _train(model, run, optimizer, scheduler, steps) -> dict:
    out = {"losses": [], "norms": [], "eval": [], "lrs": []}
    for step in steps:
        total = 0.0
        for micro in range(MICRO):
            loss = run(*_batch(step * MICRO + micro)) / MICRO
            loss.backward()
            total += loss.item()
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        out["losses"].append(total)
        out["lrs"].append([group["lr"] for group in optimizer.param_groups])
        if step % 2:
            model.eval()
            with torch.no_grad():
                out["eval"].append(run(*_batch(10_000)).item())
            model.train()
    return out


def _warmup(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))


@pytest.fixture(scope="module")
def reference():
    model = _build()
    optimizer = torch.optim.AdamW(_groups(model), lr=LR, eps=ADAM_EPS)
    out = _train(model, model, optimizer, _warmup(optimizer), range(STEPS))
    out["params"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_loop_on_the_device_matches_eager_and_resumes(stage, reference, tmp_path):
    torch._dynamo.reset()
    model = _build()
    compiled = torch.compile(model, backend="zero", options={"stage": stage})
    optimizer = zcompile.optim.AdamW(_groups(model), lr=LR, eps=ADAM_EPS)
    scheduler = _warmup(optimizer)
    first = _train(model, compiled, optimizer, scheduler, range(RESUME_AT))
    zcompile.checkpoint.save(tmp_path / "ckpt", model, optimizer, extra={"scheduler": scheduler.state_dict()})
    rest = _train(model, compiled, optimizer, scheduler, range(RESUME_AT, STEPS))
    with zcompile.gathered(model):
        params = {name: p.detach().clone() for name, p in model.named_parameters()}

    assert max(reference["norms"]) > MAX_NORM  # the clip clips
    for key in ("losses", "norms", "eval"):
        torch.testing.assert_close(
            first[key] + rest[key], reference[key], rtol=1e-5, atol=0, msg=lambda text: f"{key}: {text}"
        )
    assert first["lrs"] + rest["lrs"] == reference["lrs"]
    for name, expected in reference["params"].items():
        assert params[name].device.type == DEVICE
        torch.testing.assert_close(params[name], expected, rtol=0, atol=PARAM_ATOL, msg=lambda text: f"{name}: {text}")

    # a fresh model and optimizer, resumed from the checkpoint, train the last steps the same
    torch._dynamo.reset()
    fresh = _build()
    fresh_compiled = torch.compile(fresh, backend="zero", options={"stage": stage})
    fresh_optimizer = zcompile.optim.AdamW(_groups(fresh), lr=LR, eps=ADAM_EPS)
    fresh_scheduler = _warmup(fresh_optimizer)
    extra = zcompile.checkpoint.load(tmp_path / "ckpt", fresh, fresh_optimizer)
    fresh_scheduler.load_state_dict(extra["scheduler"])
    resumed = _train(fresh, fresh_compiled, fresh_optimizer, fresh_scheduler, range(RESUME_AT, STEPS))
    for key in ("losses", "norms", "eval"):
        torch.testing.assert_close(
            resumed[key], rest[key], rtol=1e-6, atol=0, msg=lambda text: f"resumed {key}: {text}"
        )
