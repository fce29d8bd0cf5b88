"""Hugging Face Trainer with zcompile (``zcompile.integrations.hf.ZeroTrainer``) against the plain
DDP Trainer, on 2 gloo ranks (and 4 for resuming on another world size).

The reference is ``transformers.Trainer`` itself on the same processes: it wraps the model in
DistributedDataParallel, clips with ``torch.nn.utils.clip_grad_norm_`` and builds torch's AdamW
from the same arguments. The only arithmetic that differs is the order of the cross-rank
gradient sum (an all-reduce against zcompile's reduce-scatter) and the AdamW kernels' rounding,
about 1e-7 relative per step on this model; after 20 clipped steps the logged losses, the logged
gradient norms and the final weights stay within 1e-6 relative (weights: 1e-6 of their scale).
A lost clip (the issue this integration closes: Trainer's max_grad_norm clipped nothing) moves
the losses by 1e-4 from the third step, and a lost zero_grad by more.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from support.launch import run_ranks  # noqa: E402

STEPS, GRAD_ACCUM, EVAL_EVERY, MAX_GRAD_NORM = 20, 4, 5, 0.2
RTOL = 1e-6
SEQ, VOCAB = 16, 128


class TokenDataset(torch.utils.data.Dataset):
    """Random token sequences, the labels the inputs (the model shifts them)."""

    def __init__(self, count: int, seed: int):
        self.ids = torch.randint(0, VOCAB, (count, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


def _args(output_dir: str, world: int, **overrides) -> transformers.TrainingArguments:
    settings = dict(
        output_dir=output_dir,
        per_device_train_batch_size=8 // world,
        per_device_eval_batch_size=4,
        max_steps=STEPS,
        learning_rate=3e-3,
        max_grad_norm=MAX_GRAD_NORM,
        logging_steps=1,
        lr_scheduler_type="linear",
        warmup_steps=3,
        weight_decay=0.1,
        seed=0,
        data_seed=0,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        gradient_accumulation_steps=GRAD_ACCUM,
        eval_strategy="steps",
        eval_steps=EVAL_EVERY,
    )
    return transformers.TrainingArguments(**{**settings, **overrides})


def _history(trainer) -> dict:
    logs = trainer.state.log_history
    return {
        "losses": [h["loss"] for h in logs if "loss" in h],
        "grad_norms": [h["grad_norm"] for h in logs if "loss" in h],
        "lrs": [h["learning_rate"] for h in logs if "loss" in h],
        "evals": [h["eval_loss"] for h in logs if "eval_loss" in h],
    }


def _train_each_way(rank: int, world: int, out_dir: str) -> dict:
    """The plain DDP Trainer, then ZeroTrainer at stages 2 and 3 (each saving its model)."""
    import zcompile
    from zcompile.integrations.hf import ZeroTrainer

    train, held_out = TokenDataset(STEPS * GRAD_ACCUM * 8, seed=0), TokenDataset(16, seed=1)
    runs = {}
    for way in ("ddp", 2, 3):
        torch._dynamo.reset()
        model = _llama()
        args = _args(os.path.join(out_dir, f"run_{way}"), world)
        if way == "ddp":
            trainer = transformers.Trainer(model=model, args=args, train_dataset=train, eval_dataset=held_out)
        else:
            trainer = ZeroTrainer(
                model=model, args=args, train_dataset=train, eval_dataset=held_out, zero_options={"stage": way}
            )
        trainer.train()
        runs[way] = _history(trainer)
        if way == "ddp":
            runs[way]["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        else:
            assert isinstance(trainer.optimizer.optimizer, zcompile.optim.AdamW)
            assert not isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
            trainer.save_model(os.path.join(out_dir, f"saved_{way}"))
            with zcompile.gathered(model):  # the Trainer-side weights the saved folder must hold
                runs[way]["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    runs["accelerate"] = _accelerate_prepare_error(train)
    return runs


def _accelerate_prepare_error(dataset) -> str:
    """accelerate's prepare(model) wraps a zero-compiled model in DDP: refused at the first call."""
    import accelerate

    torch._dynamo.reset()
    model = torch.compile(_llama(), backend="zero", options={"stage": 2})
    model = accelerate.Accelerator(cpu=True).prepare(model)
    try:
        model(**{k: v[None] for k, v in dataset[0].items()})
    except Exception as error:
        return str(error)
    return "no error"


@pytest.fixture(scope="module")
def each_way(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("hf"))
    return run_ranks(2, _train_each_way, out_dir, timeout_s=600)[0], out_dir


def _assert_close_lists(actual: list, expected: list, what: str) -> None:
    assert len(actual) == len(expected) > 0, (what, actual, expected)
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= RTOL * abs(e), (what, step, actual, expected)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_trainer_trains_like_the_ddp_trainer(each_way, stage):
    """Clipped (the norms are above MAX_GRAD_NORM), accumulated over 4 micro-batches, evaluated every
    5 steps, with Trainer's decay / no-decay groups and linear schedule: as plain DDP does."""
    runs, _ = each_way
    ddp, zero = runs["ddp"], runs[stage]
    assert len(ddp["losses"]) == STEPS and len(ddp["evals"]) == STEPS // EVAL_EVERY
    assert min(ddp["grad_norms"]) > MAX_GRAD_NORM  # every step really clips
    _assert_close_lists(zero["losses"], ddp["losses"], "loss")
    _assert_close_lists(zero["grad_norms"], ddp["grad_norms"], "grad_norm")
    _assert_close_lists(zero["evals"], ddp["evals"], "eval_loss")
    assert zero["lrs"] == ddp["lrs"]
    for name, value in ddp["params"].items():
        torch.testing.assert_close(
            zero["params"][name], value, rtol=RTOL, atol=RTOL * value.abs().max().item(), msg=name
        )


@pytest.mark.parametrize("stage", [2, 3])
def test_save_model_is_a_folder_from_pretrained_loads(each_way, stage):
    runs, out_dir = each_way
    plain = transformers.LlamaForCausalLM.from_pretrained(os.path.join(out_dir, f"saved_{stage}"))
    saved = dict(plain.named_parameters())
    assert set(saved) == set(runs[stage]["params"])
    for name, value in runs[stage]["params"].items():
        assert torch.equal(saved[name].detach(), value), name


def test_accelerate_wrapping_a_zero_model_in_ddp_is_refused_with_the_pattern(each_way):
    runs, _ = each_way
    message = runs["accelerate"]
    assert "runs inside DistributedDataParallel" in message and "prepare everything but the model" in message, message


# ---- checkpoints: resume at the same and at another number of ranks ----

RESUME_STEPS, SAVE_EVERY = 8, 4
# Checkpoint tests train on fixed-length data: static shapes (torch.compile's own default) compile a
# Llama in about a third of dynamic=True's time here; ZeroTrainer's default, dynamic=True, is what
# the first fixture and the padded-batch test train with.
STATIC = {"dynamic": None}


def _resume_args(out_dir: str, world: int) -> transformers.TrainingArguments:
    return _args(
        out_dir,
        world,
        max_steps=RESUME_STEPS,
        save_strategy="steps",
        save_steps=SAVE_EVERY,
        gradient_accumulation_steps=1,
        eval_strategy="no",
    )


def _trainer(out_dir: str, world: int):
    from zcompile.integrations.hf import ZeroTrainer

    torch._dynamo.reset()
    return ZeroTrainer(
        model=_llama(),
        args=_resume_args(out_dir, world),
        train_dataset=TokenDataset(RESUME_STEPS * 8, seed=0),
        zero_options={"stage": 3},
        **STATIC,
    )


def _train_then_resume(rank: int, world: int, out_dir: str) -> tuple[dict, dict]:
    """Uninterrupted (saving at step 4), then a fresh model and trainer resuming from step 4."""
    uninterrupted = _trainer(out_dir, world)
    uninterrupted.train()
    resumed = _trainer(out_dir, world)
    resumed.train(resume_from_checkpoint=os.path.join(out_dir, f"checkpoint-{SAVE_EVERY}"))
    return _history(uninterrupted), _history(resumed)


def _resume(rank: int, world: int, out_dir: str) -> dict:
    trainer = _trainer(out_dir, world)
    trainer.train(resume_from_checkpoint=os.path.join(out_dir, f"checkpoint-{SAVE_EVERY}"))
    return _history(trainer)


def test_resume_from_checkpoint_continues_exactly_also_on_1_rank(tmp_path):
    """The same world size resumes bitwise; another one (the 2-rank checkpoint's shards read whole by
    one process, with the same global batch) to rounding. Resharding onto more ranks than were saved,
    and a Llama's 2 -> 4, is test_checkpoint.py's."""
    uninterrupted, resumed = run_ranks(2, _train_then_resume, str(tmp_path), timeout_s=600)[0]
    assert os.path.isdir(tmp_path / f"checkpoint-{SAVE_EVERY}" / "zcompile")  # the sharded checkpoint
    # the resumed log starts with the checkpoint's history (steps 1-4) and goes on from there
    assert resumed["losses"] == uninterrupted["losses"] and resumed["grad_norms"] == uninterrupted["grad_norms"]
    on_one = run_ranks(1, _resume, str(tmp_path), timeout_s=600)[0]
    # one process sums the same global batch's gradients in another order: rounding only
    _assert_close_lists(on_one["losses"], uninterrupted["losses"], "loss on 1 rank")
    _assert_close_lists(on_one["grad_norms"], uninterrupted["grad_norms"], "grad_norm on 1 rank")


def _peft_llama():
    from peft import LoraConfig, get_peft_model

    base = _llama()
    torch.manual_seed(1)  # the adapter's own initial values (B is random too, so every step moves A)
    return get_peft_model(
        base,
        LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights="gaussian"
        ),
    )


def _peft_train_then_resume(rank: int, world: int, out_dir: str) -> dict:
    """A peft LoRA model at stage 3: checkpoints without the frozen base, the resume, the saved adapter."""
    import torch.distributed.checkpoint as dcp

    import zcompile
    from zcompile.integrations.hf import ZeroTrainer

    def trainer():
        torch._dynamo.reset()
        return ZeroTrainer(
            model=_peft_llama(),
            args=_resume_args(out_dir, world),
            train_dataset=TokenDataset(RESUME_STEPS * 8, seed=0),
            zero_options={"stage": 3},
            **STATIC,
        )

    uninterrupted = trainer()
    uninterrupted.train()
    uninterrupted.save_model(os.path.join(out_dir, "adapter"))
    model = uninterrupted.model
    with zcompile.gathered(model):  # the trained adapter, read from the model itself
        adapter = {
            name.replace(".default", ""): p.detach().clone() for name, p in model.named_parameters() if p.requires_grad
        }
    resumed = trainer()
    resumed.train(resume_from_checkpoint=os.path.join(out_dir, f"checkpoint-{SAVE_EVERY}"))
    saved = dcp.FileSystemReader(os.path.join(out_dir, f"checkpoint-{SAVE_EVERY}", "zcompile")).read_metadata()
    return {
        "uninterrupted": _history(uninterrupted),
        "resumed": _history(resumed),
        "adapter": adapter,
        "checkpointed": sorted(
            k.removeprefix("model/").replace(".default", "")
            for k in saved.state_dict_metadata
            if k.startswith("model/")
        ),
    }


def test_a_peft_model_saves_its_adapter_and_resumes_from_checkpoints_without_its_base(tmp_path):
    """``ZeroTrainer`` with a LoRA model (peft): the checkpoint holds the adapter's weights (the frozen
    base left out, ``exclude_frozen_parameters``), the resume is bitwise the uninterrupted run, and
    ``save_model`` writes peft's adapter folder with the trained weights (gathered alone)."""
    pytest.importorskip("peft")
    import safetensors.torch

    result = run_ranks(2, _peft_train_then_resume, str(tmp_path), timeout_s=600)[0]
    adapter = result["adapter"]
    assert len(adapter) == 8 and all(".lora_" in name for name in adapter)  # q and v, A and B, 2 layers
    assert result["checkpointed"] == sorted(adapter)
    assert result["resumed"]["losses"] == result["uninterrupted"]["losses"]
    written = safetensors.torch.load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert sorted(written) == sorted(adapter)
    for name, value in adapter.items():
        assert torch.equal(written[name], value), name


def _best_at_end(rank: int, world: int, out_dir: str) -> dict:
    """Stage 3, ``load_best_model_at_end``: Trainer loads the best checkpoint's weights with
    ``model.load_state_dict`` on every rank (it failed in ShardedParameterError: the Llama's forward
    is wrapped in ``wrapped_func(*args, **kwargs)``, where the state-dict hooks were not attached)."""
    import safetensors.torch

    from zcompile.checkpoint.consolidate import full_state_dict
    from zcompile.integrations.hf import ZeroTrainer

    torch._dynamo.reset()
    args = _args(
        out_dir,
        world,
        max_steps=12,
        gradient_accumulation_steps=1,
        eval_steps=3,
        save_strategy="steps",
        save_steps=3,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        learning_rate=3e-2,
    )
    trainer = ZeroTrainer(
        model=_llama(),
        args=args,
        train_dataset=TokenDataset(12 * 8, seed=0),
        eval_dataset=TokenDataset(16, seed=1),
        zero_options={"stage": 3},
        **STATIC,
    )
    trainer.train()
    weights = full_state_dict(trainer.model, rank=0)
    if rank != 0:
        return {}
    best = trainer.state.best_model_checkpoint
    saved = safetensors.torch.load_file(os.path.join(best, "model.safetensors"))
    last = safetensors.torch.load_file(os.path.join(out_dir, "checkpoint-12", "model.safetensors"))
    return {
        "best": os.path.basename(best),
        "keys": sorted(saved) == sorted(k for k in weights if k in saved),
        "from_best": max((weights[k] - saved[k]).abs().max().item() for k in saved),
        "best_from_last": max((last[k] - saved[k]).abs().max().item() for k in saved),
    }


def test_load_best_model_at_end_loads_the_best_checkpoints_weights_at_stage_3(tmp_path):
    result = run_ranks(2, _best_at_end, str(tmp_path), timeout_s=600)[0]
    assert result["best"] != "checkpoint-12" and result["best_from_last"] > 1e-3, result  # loading changes weights
    assert result["keys"] and result["from_best"] == 0.0, result


def test_refusals_name_the_fix(tmp_path):
    from zcompile.integrations.hf import ZeroTrainer

    dataset = TokenDataset(8, seed=0)
    with pytest.raises(ValueError, match="fp16=True is not supported.*bf16=True"):
        ZeroTrainer(
            model=_llama(),
            args=_args(str(tmp_path), 1, eval_strategy="no", fp16=True, use_cpu=False),
            train_dataset=dataset,
        )
    with pytest.raises(ValueError, match="torch_compile_backend='inductor'.*set torch_compile_backend='zero'"):
        ZeroTrainer(
            model=_llama(),
            args=_args(str(tmp_path), 1, eval_strategy="no", torch_compile_backend="inductor"),
            train_dataset=dataset,
        )
    trainer = ZeroTrainer(
        model=_llama(), args=_args(str(tmp_path), 1, eval_strategy="no", optim="adafactor"), train_dataset=dataset
    )
    with pytest.raises(ValueError, match=r"optim='adafactor'\) has no zcompile optimizer"):
        trainer.create_optimizer()
    trainer = ZeroTrainer(
        model=_llama(),
        args=_args(str(tmp_path), 1, eval_strategy="no"),
        train_dataset=dataset,
        optimizers=(torch.optim.AdamW(_llama().parameters()), None),
    )
    with pytest.raises(TypeError, match="not a zcompile.optim optimizer"):
        trainer.create_optimizer()
    # torch_compile_backend="zero" (which accelerate refuses by name) is ZeroTrainer's own compile
    args = _args(str(tmp_path), 1, eval_strategy="no", torch_compile_backend="zero")
    trainer = ZeroTrainer(model=_llama(), args=args, train_dataset=dataset)
    assert not trainer.args.torch_compile


def _three_steps(out_dir, zero: bool, dynamic: bool | None = True, **overrides) -> dict:
    """Three steps of 8 sequences in one process, by the plain Trainer or ZeroTrainer at stage 3
    (``dynamic``: ZeroTrainer's), with TrainingArguments ``overrides``; the logged history."""
    from zcompile.integrations.hf import ZeroTrainer

    torch._dynamo.reset()
    args = _args(
        str(out_dir), 1, **{"eval_strategy": "no", "max_steps": 3, "gradient_accumulation_steps": 1, **overrides}
    )
    kwargs = dict(
        model=_llama(), args=args, train_dataset=TokenDataset(24, seed=0), eval_dataset=TokenDataset(8, seed=1)
    )
    trainer = (
        ZeroTrainer(**kwargs, zero_options={"stage": 3}, dynamic=dynamic) if zero else transformers.Trainer(**kwargs)
    )
    trainer.train()
    return _history(trainer)


def test_label_smoothing_shifts_a_causal_lms_labels_as_the_plain_trainer_does(tmp_path):
    """With ``label_smoothing_factor`` Trainer computes the loss itself and shifts the labels when it
    recognises a causal LM by its class, which it read from the compiled wrapper: the labels stayed
    unshifted, each token scored against itself (first loss 5.18 where the DDP Trainer's was 4.87 on 2
    ranks), and nothing said so. The plain Trainer in the same process is the reference, in training
    and in evaluation."""
    smoothed = dict(eval_strategy="steps", eval_steps=3, label_smoothing_factor=0.1)
    plain = _three_steps(tmp_path / "plain", zero=False, **smoothed)
    zero = _three_steps(tmp_path / "zero", zero=True, **STATIC, **smoothed)
    _assert_close_lists(zero["losses"], plain["losses"], "loss")
    _assert_close_lists(zero["evals"], plain["evals"], "eval_loss")


def test_model_init_trains_a_fresh_model_at_each_train_call(tmp_path):
    """``Trainer(model_init=...)`` builds a fresh model at each ``train()`` (a hyperparameter search's
    trials). ZeroTrainer kept its first compile, so the second call trained the first model on:
    losses 4.62, 4.71, ... where a fresh model starts at 4.87, and nothing said so. Each call must log
    the plain Trainer's losses, through a compile of its own: the last model's graphs are dropped
    first (with recompile_limit 1 here, as with 8 from a ninth trial, the new model would otherwise
    run eagerly, unsharded)."""
    from zcompile.integrations.hf import ZeroTrainer

    torch._dynamo.reset()
    args = _args(str(tmp_path), 1, eval_strategy="no", max_steps=3, gradient_accumulation_steps=1)
    kwargs = dict(model_init=_llama, args=args, train_dataset=TokenDataset(24, seed=0))
    plain = transformers.Trainer(**kwargs)
    plain.train()
    compiles = []
    trainer = ZeroTrainer(**kwargs, zero_options={"stage": 3, "on_compile": compiles.append}, **STATIC)
    with torch._dynamo.config.patch(recompile_limit=1):
        for trial in range(2):
            trainer.train()
            _assert_close_lists(_history(trainer)["losses"], _history(plain)["losses"], f"loss, trial {trial}")
            assert len(compiles) == trial + 1, len(compiles)


@pytest.fixture(scope="module")
def fp32_zero_run(tmp_path_factory) -> tuple[list[float], list[str]]:
    """ZeroTrainer's losses over 3 steps in fp32, one process, and Dynamo's compile attempts."""
    from torch._dynamo.utils import compilation_time_metrics

    compilation_time_metrics.clear()
    losses = _three_steps(tmp_path_factory.mktemp("fp32"), zero=True)["losses"]
    return losses, sorted(name for name in compilation_time_metrics if name.startswith("compile_attempt_"))


def test_the_model_is_traced_once_with_dynamic_shapes(fp32_zero_run):
    """ZeroTrainer compiles with dynamic=True, where Dynamo made the Llama's float attributes (its
    RMSNorms' eps, the rotary scaling) symbolic, specialized them, and after AOTAutograd's joint trace
    traced the whole model again (two compile attempts: twice the first step's time). Its compiles
    trace floats as constants: one attempt."""
    _, attempts = fp32_zero_run
    assert attempts == ["compile_attempt_0"], attempts


def test_bf16_mixed_precision_is_applied(tmp_path, fp32_zero_run):
    """bf16=True is accelerate's autocast around forward: ZeroTrainer keeps it (it was silently
    dropped with the DDP wrap it replaces). One process: the plain Trainer is the reference."""
    fp32, _ = fp32_zero_run
    zero_bf16 = _three_steps(tmp_path, zero=True, bf16=True)["losses"]
    plain_bf16 = _three_steps(tmp_path, zero=False, bf16=True)["losses"]
    # the first loss comes from the same weights through bf16 autocast: as the plain Trainer's, and
    # 1e-5 relative away from fp32 (later steps: the weights drift apart by bf16 rounding)
    assert abs(zero_bf16[0] - plain_bf16[0]) <= 1e-6 * abs(plain_bf16[0]), (zero_bf16, plain_bf16)
    assert abs(zero_bf16[0] - fp32[0]) > 5e-6 * abs(fp32[0]), (zero_bf16, fp32)
    for a, b in zip(zero_bf16, plain_bf16, strict=True):
        assert abs(a - b) <= 5e-5 * abs(b), (zero_bf16, plain_bf16)


# ---- batches padded per rank to their own longest sequence ----


class VariedLengthDataset(torch.utils.data.Dataset):
    """Token sequences of 6 to 16 tokens, for a collator that pads each batch to its longest."""

    def __init__(self, count: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(6, SEQ + 1, (count,), generator=generator)
        self.items = [torch.randint(1, VOCAB, (int(n),), generator=generator) for n in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.items[index]}


def pad_to_longest(batch: list[dict]) -> dict:
    """What Trainer's padding collators do: each batch (so each rank's) as long as its longest
    sequence, the padding masked out of attention and loss."""
    length = max(len(item["input_ids"]) for item in batch)
    ids = torch.zeros(len(batch), length, dtype=torch.long)
    mask = torch.zeros(len(batch), length, dtype=torch.long)
    for row, item in enumerate(batch):
        ids[row, : len(item["input_ids"])] = item["input_ids"]
        mask[row, : len(item["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _padded_each_way(rank: int, world: int, out_dir: str) -> dict:
    from zcompile.integrations.hf import ZeroTrainer

    runs = {}
    for way in ("ddp", 3):
        torch._dynamo.reset()
        args = _args(
            os.path.join(out_dir, f"padded_{way}"),
            world,
            max_steps=6,
            gradient_accumulation_steps=1,
            eval_strategy="no",
        )
        common = dict(
            model=_llama(), args=args, train_dataset=VariedLengthDataset(64, seed=0), data_collator=pad_to_longest
        )
        graphs = []
        trainer = (
            transformers.Trainer(**common)
            if way == "ddp"
            else ZeroTrainer(**common, zero_options={"stage": way, "on_compile": graphs.append})
        )
        trainer.train()
        runs[way] = {**_history(trainer), "compiles": len(graphs)}
    return runs


def test_batches_padded_per_rank_train_like_the_ddp_trainer(tmp_path):
    """Each rank's batch is as long as its own longest sequence, so lengths differ between ranks and
    steps. With Dynamo's default shapes, a step whose length changed on one rank only recompiled on
    that rank alone: a RankDivergenceError at stage 3 (at the second step of a probe with 8-32 tokens).
    ZeroTrainer compiles with dynamic=True: one compile, the DDP Trainer's losses."""
    runs = run_ranks(2, _padded_each_way, str(tmp_path), timeout_s=300)[0]
    assert runs[3]["compiles"] == 1, runs[3]
    _assert_close_lists(runs[3]["losses"], runs["ddp"]["losses"], "loss")
    _assert_close_lists(runs[3]["grad_norms"], runs["ddp"]["grad_norms"], "grad_norm")
