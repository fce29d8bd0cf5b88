"""The models the tests train (the example GPT, with graph breaks, frozen or bf16 variants, a
contrastive loss gathering across ranks, and two Hugging Face models), their loss, and the deterministic global batch of a step."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "examples"))

from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

VOCAB = 256


class GPTWithBreaks(GPT):
    """The GPT with graph breaks (several Dynamo graphs per forward) and a buffer.

    ``in_loop``: the break sits inside the loop over blocks, so Dynamo runs the whole forward
    frame eagerly and compiles each block's frame: embeddings and head train outside any graph.
    """

    def __init__(self, config: GPTConfig, in_loop: bool = False):
        super().__init__(config)
        self.in_loop = in_loop
        self.register_buffer("logit_scale", torch.tensor(0.75))

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        torch._dynamo.graph_break()
        for block in self.blocks:
            x = block(x)
            if self.in_loop:
                torch._dynamo.graph_break()
        torch._dynamo.graph_break()
        logits = self.head(self.ln_f(x)) * self.logit_scale
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


class GPTCheckpointed(GPT):
    """The GPT with each block under ``torch.utils.checkpoint`` (non-reentrant): user activation
    checkpointing, which Dynamo traces and the zero backend must keep recomputing correctly."""

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        logits = self.head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


class GPTDropout(GPT):
    """The GPT with dropout (p=0.25) after the embeddings and after each block: random draws that a
    backward must never make again. Its runs are deterministic when the RNG is seeded before each
    forward (``RunSpec.seed_each_forward``)."""

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.drop = torch.nn.Dropout(0.25)

    def forward(self, idx, targets):
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1])))
        for block in self.blocks:
            x = self.drop(block(x))
        logits = self.head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


class GPTContrastive(GPT):
    """The GPT plus a contrastive term over every rank's sequence embeddings, CLIP's habit: in the
    compiled forward, each rank all-gathers the others' embeddings (two views: a sequence's first
    and second half) with torch's differentiable functional all-gather, and scores every pair.

    Every rank computes the global batch's contrastive loss, and the gather's backward sums its
    gradient over ranks, so with DDP's mean the step is one process's on the global batch, which
    has nothing to gather (``zcompile``'s passes must leave the model's own 2-D gathers alone)."""

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        logits = self.head(x)
        lm = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        half = idx.shape[1] // 2
        views = [
            torch.nn.functional.normalize(x[:, part].mean(1), dim=-1) for part in (slice(None, half), slice(half, None))
        ]
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            import torch.distributed._functional_collectives as funcol

            # torch 2.13's name; torch 2.11 has only the older one
            gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
            views = [gather(view, 0, torch.distributed.group.WORLD) for view in views]
        first, second = views
        scores = first @ second.T * 5.0
        return lm + torch.nn.functional.cross_entropy(scores, torch.arange(len(scores)))


def small_llama_config(**overrides):
    """A transformers Llama of 2 layers, 64 wide, 4 heads over 2 key-value heads (no KV cache): the
    tests' small Llama for simulations and plans; ``overrides`` set any field."""
    import transformers

    fields = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    return transformers.LlamaConfig(**{**fields, **overrides})


def build_model(name: str) -> torch.nn.Module:
    """The models the tests train, each deterministic (seeded; those with dropout when the RNG is
    seeded before each forward)."""
    torch.manual_seed(0)
    small = GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=32)
    if name == "gpt_breaks":
        return GPTWithBreaks(small)
    if name == "gpt_loop_breaks":  # untied: a stage-3 parameter must not be used both in and out of graphs
        return GPTWithBreaks(
            GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=False), in_loop=True
        )
    if name == "gpt_checkpointed":
        return GPTCheckpointed(small)
    if name == "gpt_dropout":
        return GPTDropout(small)
    if name == "gpt_contrastive":
        return GPTContrastive(small)
    if name == "gpt_frozen":  # position embedding and first block's norm frozen
        model = GPT(small)
        model.wpe.weight.requires_grad_(False)
        for param in model.blocks[0].ln_1.parameters():
            param.requires_grad_(False)
        return model
    if name == "gpt_sparse_embedding":  # nn.Embedding(sparse=True): sparse gradients (untied: the head's is dense)
        model = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=False))
        model.wte.sparse = model.wpe.sparse = True
        return model
    if name == "gpt_bf16":  # the whole model in bf16 (model.to(torch.bfloat16)), no param_dtype option
        return GPT(small).to(torch.bfloat16)
    if name == "gpt":
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=32))
    if name == "gpt_split_qkv":  # separate q, k, v projections: what tensor parallelism splits by heads
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_embd=32, fused_qkv=False))
    if name == "gpt_untied_odd":  # sizes not divisible by 2 or 4, no tied weights
        return GPT(GPTConfig(vocab_size=VOCAB - 3, block_size=16, n_layer=2, n_head=3, n_embd=21, tie_weights=False))
    if name == "hf_gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(
            GPT2Config(
                n_layer=2,
                n_embd=32,
                n_head=2,
                vocab_size=VOCAB,
                n_positions=16,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        )
        # Transformers derives the loss from the class name, finds none in "GPT2LMHeadModel" and calls
        # logger.warning_once in every forward: a graph break there (Dynamo traces the model twice
        # over, 6 s of a 10 s two-rank run). Graph breaks have tests of their own (test_features.py).
        model.loss_type = "ForCausalLM"
        return model
    if name == "hf_gpt2_dropout":  # transformers' defaults: dropout 0.1 on embeddings, attention, residuals
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16))
        model.loss_type = "ForCausalLM"  # as hf_gpt2's
        return model
    if name == "hf_llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(
            LlamaConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=VOCAB,
                max_position_embeddings=32,
            )
        )
    raise ValueError(name)


def model_loss(name: str, model: Callable, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if name.startswith("hf_"):
        return model(input_ids=tokens, labels=tokens).loss
    return model(tokens, targets)


def global_batch(step: int, batch_size: int, seq_lens: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, targets = synthetic_batch(step, batch_size, GPTConfig(vocab_size=VOCAB - 3, block_size=16))
    if seq_lens:
        length = seq_lens[step % len(seq_lens)]
        tokens, targets = tokens[:, :length].contiguous(), targets[:, :length].contiguous()
    return tokens, targets
