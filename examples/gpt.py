"""A small GPT (decoder-only transformer) in plain PyTorch, used by the example and the tests.

Pre-norm blocks, causal self-attention through ``scaled_dot_product_attention``, GELU MLP and an
output head tied to the token embedding (one parameter used twice). With ``fused_qkv=False`` the
attention has separate q, k, v projections, which ``parallelize`` splits by heads for tensor
parallelism (a fused one split column-wise would give a rank parts of q and k, not whole heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 512
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    tie_weights: bool = True
    fused_qkv: bool = True  # one q/k/v projection; False: three, which tensor parallelism can split


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        if config.fused_qkv:
            self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        else:
            self.q, self.k, self.v = (nn.Linear(config.n_embd, config.n_embd) for _ in range(3))
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        if hasattr(self, "qkv"):
            q, k, v = self.qkv(x).split(channels, dim=2)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        shape = (batch, time, -1, self.head_dim)  # -1: the heads this rank holds (all, without tensor parallelism)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, -1))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(), nn.Linear(4 * config.n_embd, config.n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.head.weight = self.wte.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def parallelize(model: GPT, tp_mesh, sequence_parallel: bool = False) -> GPT:
    """Tensor parallelism over ``tp_mesh`` (torch's ``parallelize_module``, Megatron's split): in each
    block q, k, v and the MLP's first layer column-wise (by heads, by hidden units), the attention's
    and the MLP's output layers row-wise; embeddings and the head stay replicated.

    ``sequence_parallel``: between those layers (the norms, the residual stream) each tp rank holds
    its slice of the sequence instead of all of it: the row-wise layers reduce-scatter over the
    sequence, the column-wise ones gather it back, and the norms' activations shrink by the tp degree."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    config, tp = model.config, tp_mesh.size()
    if config.fused_qkv:
        raise ValueError("GPT tensor parallelism needs GPTConfig(fused_qkv=False): a fused qkv splits across q and k")
    if config.n_head % tp:
        raise ValueError(f"GPT tensor parallelism: {config.n_head} heads do not divide over {tp} ranks")
    # the sequence is dim 1 of the activations between layers; whole (Replicate) where a layer needs it
    split, whole = (Shard(1),), (Replicate(),)
    gather = PrepareModuleInput(input_layouts=split, desired_input_layouts=whole, use_local_output=True)
    out = {"output_layouts": Shard(1)} if sequence_parallel else {}
    plan = {
        **{f"attn.{name}": ColwiseParallel() for name in ("q", "k", "v")},
        "attn.proj": RowwiseParallel(**out),
        "mlp.0": ColwiseParallel(),
        "mlp.2": RowwiseParallel(**out),
    }
    if sequence_parallel:
        plan |= {norm: SequenceParallel(use_local_output=True) for norm in ("ln_1", "ln_2")}
        plan |= {"attn": gather, "mlp": gather}
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)
    if sequence_parallel:  # the embeddings' output cut into the sequence's slices, and gathered for the head
        scatter = PrepareModuleInput(input_layouts=whole, desired_input_layouts=split, use_local_output=True)
        edges = {"blocks.0": scatter, "ln_f": SequenceParallel(use_local_output=True), "head": gather}
        parallelize_module(model, tp_mesh, edges)
    return model


def synthetic_batch(
    step: int, batch_size: int, config: GPTConfig, seed: int = 1234
) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable token stream (a noisy repeating pattern), identical on every rank for a step.

    Each rank takes its slice of this global batch, so a run on N ranks sees exactly the data of
    a single-process run.
    """
    generator = torch.Generator().manual_seed(seed + step)
    start = torch.randint(0, config.vocab_size, (batch_size, 1), generator=generator)
    stride = torch.randint(1, 7, (batch_size, 1), generator=generator)
    ramp = torch.arange(config.block_size + 1).unsqueeze(0)
    tokens = (start + stride * ramp) % config.vocab_size
    noise = torch.rand(tokens.shape, generator=generator) < 0.05
    tokens = torch.where(noise, torch.randint(0, config.vocab_size, tokens.shape, generator=generator), tokens)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
