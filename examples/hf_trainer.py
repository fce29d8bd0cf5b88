"""Train a small Llama (built from a config, no download) with Hugging Face Trainer and zcompile.

    pip install -e '.[hf]'
    torchrun --nproc-per-node 2 examples/hf_trainer.py                       # stage 3, CPU, gloo
    torchrun --nproc-per-node 2 examples/hf_trainer.py --stage 2 --out runs/llama
    torchrun --nproc-per-node 4 examples/hf_trainer.py --steps 60 --out runs/llama --resume   # 2 -> 4 ranks

``ZeroTrainer`` is ``transformers.Trainer`` with the model compiled by the zero backend: the
optimizer (AdamW from the TrainingArguments), the LR schedule, ``max_grad_norm`` clipping,
gradient accumulation, evaluation and logging are Trainer's. Checkpoints go to ``--out`` every
``--save-every`` steps (zcompile's sharded checkpoint inside Trainer's folder) and the final model
to ``--out/final``, a normal Hugging Face folder: ``LlamaForCausalLM.from_pretrained(out/final)``.
The data is arithmetic progressions of tokens (``Progressions``): the loss falls from ln(512) = 6.2.
"""

from __future__ import annotations

import argparse
import os

import torch
import transformers

from zcompile.integrations.hf import ZeroTrainer


class Progressions(torch.utils.data.Dataset):
    """``count`` arithmetic progressions of ``seq`` tokens modulo ``vocab`` (random start and stride
    1-8), labelled with themselves (causal LM): learnable, so the loss falls well below ln(vocab)."""

    def __init__(self, count: int, seq: int, vocab: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (count, 1), generator=generator)
        stride = torch.randint(1, 9, (count, 1), generator=generator)
        self.tokens = (start + stride * torch.arange(seq)) % vocab

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step, all ranks")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--out", default="runs/hf_trainer")
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    parser.add_argument(
        "--param-dtype",
        default=None,
        help="e.g. bf16: ZeRO's mixed precision (bf16 weights and gradients, fp32 masters and moments on the shards)",
    )
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_device = args.global_batch // (world * args.grad_accum)
    if per_device * world * args.grad_accum != args.global_batch:
        parser.error(
            f"--global-batch {args.global_batch} is not a multiple of ranks x --grad-accum "
            f"({world} x {args.grad_accum})"
        )
    torch.manual_seed(0)  # the same initial weights on every rank
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = transformers.LlamaForCausalLM(config)
    training_args = transformers.TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=1e-2,
        weight_decay=0.1,
        warmup_steps=5,
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        logging_steps=5,
        eval_strategy="steps",
        eval_steps=10,
        per_device_eval_batch_size=8,
        save_strategy="steps",
        save_steps=args.save_every,
        use_cpu=True,
        seed=0,
        report_to=[],
        disable_tqdm=True,
    )
    trainer = ZeroTrainer(
        model=model,
        args=training_args,
        zero_options={"stage": args.stage, "param_dtype": args.param_dtype},
        train_dataset=Progressions(256, 64, config.vocab_size, seed=0),
        eval_dataset=Progressions(32, 64, config.vocab_size, seed=1),
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    trainer.save_model(os.path.join(args.out, "final"))


if __name__ == "__main__":
    main()
