"""Hugging Face ``Trainer`` with zcompile: ``ZeroTrainer`` is ``Trainer`` with the model compiled by
the zero backend.

    from zcompile.integrations.hf import ZeroTrainer
    trainer = ZeroTrainer(model=model, args=TrainingArguments(...), train_dataset=..., zero_options={"stage": 3})
    trainer.train()                      # torchrun --nproc-per-node N train.py

What it changes in ``Trainer``, and why:
- the model is compiled with ``torch.compile(model, backend="zero", options=zero_options)`` where
  Trainer would wrap it in DistributedDataParallel (zcompile reduces the gradients itself; DDP on
  top would all-reduce them a second time). ``TrainingArguments(torch_compile_backend="zero")``
  is accepted and means the same (accelerate itself refuses the name). Its compiles trace Python
  floats as constants: with ``dynamic=True`` Dynamo would otherwise trace a transformers model twice;
- the optimizer is ``zcompile.optim.AdamW`` (or ``SGD`` for ``optim="sgd"``) over Trainer's own
  decay / no-decay parameter groups, learning rate, betas and epsilon; Trainer's LR scheduler
  drives it unchanged;
- ``model_init``: each new model Trainer builds (at each ``train()``) is compiled anew, after
  ``torch.compiler.reset()`` drops the last one's graphs;
- with ``label_smoothing_factor``, Trainer's own loss shifts a causal LM's labels as with DDP: Trainer
  recognises the model by the class ``accelerator.unwrap_model`` returns, which would be torch.compile's
  wrapper (labels unshifted, a silently wrong loss);
- ``max_grad_norm`` clips by the global norm over every rank's gradient shards
  (``optimizer.clip_grad_norm_``), and the logged ``grad_norm`` is that norm;
- ``save_model()`` writes a normal Hugging Face folder (``config.json`` + safetensors) of the
  consolidated weights from rank 0 (every rank takes part in gathering them), which
  ``from_pretrained`` loads into a plain model; a Trainer checkpoint also holds zcompile's sharded
  checkpoint (``zcompile/``: master weights, optimizer state, scheduler), from which
  ``trainer.train(resume_from_checkpoint=...)`` resumes, at the same or another number of ranks.
  A peft model (LoRA...) saves its adapter, as Trainer does, gathering only the weights that train,
  and its checkpoints leave the frozen base out (``exclude_frozen_parameters``): the resumed
  Trainer's model, built from the same base, keeps its own, checked against the save's.

Refused with the reason: DeepSpeed or FSDP arguments (another sharding), ``fp16=True``
(accelerate's loss scaling runs on a GPU only, not yet run with zcompile: use ``bf16=True``; a loop
of one's own may use ``torch.amp.GradScaler``, ``zcompile.routes.grad_scaler``),
another ``torch_compile_backend``, and an ``optim`` zcompile has no optimizer for.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from typing import Any

import torch
import transformers

import zcompile.checkpoint
import zcompile.optim
from zcompile.checkpoint.consolidate import full_state_dict
from zcompile.checkpoint.layout import unwrap
from zcompile.common.dynamo_frame import floats_specialized

log = logging.getLogger(__name__)

if not hasattr(transformers.Trainer, "_clip_grad_norm"):  # the hooks overridden below came with transformers 5
    raise ImportError(
        f"zcompile.integrations.hf: needs transformers>=5.0 (found {transformers.__version__}); "
        "pip install -U 'transformers>=5' accelerate"
    )

CHECKPOINT_SUBDIR = "zcompile"  # in a Trainer checkpoint folder: zcompile's sharded checkpoint
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused", "adamw_hf")  # Trainer names zcompile.optim.AdamW stands for
# the fix of both refusals of another sharding (DeepSpeed, FSDP)
_OWN_SHARDING = "zcompile shards the model itself: turn DeepSpeed and FSDP off"


class ZeroTrainer(transformers.Trainer):
    """``transformers.Trainer`` training with zcompile (module docstring).

    ``zero_options``: the zero backend's options (``torch.compile(..., options=...)``; default
    ``{"stage": 3}``). ``optimizer_options``: extra ``zcompile.optim`` arguments (``bucket_mb``,
    ``skip_nonfinite``, ``check_timeout_s``). An optimizer passed in ``optimizers=`` must be a
    ``zcompile.optim`` one.

    ``dynamic``: ``torch.compile``'s. True (the default here) makes every input size symbolic from the
    first compile: Trainer's collators pad each rank's batch to its own longest sequence, and with
    Dynamo's default a batch whose length changes on one rank only recompiles on that rank alone, a
    ``RankDivergenceError`` at stages 2 and 3. None: Dynamo's default (for inputs of one fixed shape).
    """

    def __init__(
        self,
        *args: Any,
        zero_options: dict | None = None,
        optimizer_options: dict | None = None,
        dynamic: bool | None = True,
        **kwargs: Any,
    ):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            _take_over_torch_compile(training_args)
            _refuse_unsupported(training_args)
        self.zero_options = {"stage": 3, **(zero_options or {})}
        self.dynamic = dynamic
        self.optimizer_options = dict(optimizer_options or {})
        self._zero_compiled: torch.nn.Module | None = None
        self._zero_compiled_from: torch.nn.Module | None = None  # the model it compiled
        super().__init__(*args, **kwargs)
        _refuse_unsupported(self.args)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError(
                "zcompile.integrations.hf.ZeroTrainer: DeepSpeed or FSDP is enabled (an accelerate config or "
                f"TrainingArguments); {_OWN_SHARDING}"
            )

    # ---- the model: compiled by the zero backend, never wrapped in DDP ----

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader=None) -> torch.nn.Module:
        """The zero-compiled model, for training and evaluation alike (at stage 3 the plain model's
        weights are shards: it cannot run outside the compiled graphs). Compiled again when Trainer
        has a new model: ``model_init`` builds a fresh one at each ``train()`` (a hyperparameter
        search's trials), which the first compile's wrapper would not have trained."""
        if self._zero_compiled is None or self._zero_compiled_from is not self.model:
            if self._zero_compiled is not None:
                # Trainer replaced the model. Dynamo would keep the last model's graphs, each guarded on
                # its model: one more compile per trial, and past recompile_limit the new model would
                # run eagerly, its weights unsharded.
                log.info("ZeroTrainer: a new model (model_init); torch.compiler.reset() before compiling it")
                torch.compiler.reset()
            self._zero_compiled_from = self.model
            # accelerate's preparation without its DDP wrap (evaluation_mode): device placement and,
            # with bf16=True, the autocast around forward that is Trainer's mixed precision
            prepared = self.accelerator.prepare_model(self.model, evaluation_mode=True)
            self._zero_compiled = torch.compile(
                prepared, backend="zero", options=self.zero_options, dynamic=self.dynamic
            )
        return self._zero_compiled

    # The model's calls: the compile they trigger sees Python floats as constants. With dynamic=True
    # Dynamo would make the model's float attributes symbolic and then trace the whole model twice
    # (zcompile.common.dynamo_frame.floats_specialized): twice the first step's time for nothing.

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with floats_specialized():
            return super().training_step(*args, **kwargs)

    def prediction_step(self, *args: Any, **kwargs: Any) -> tuple:
        with floats_specialized():
            return super().prediction_step(*args, **kwargs)

    def compute_loss(self, model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        # With label_smoothing_factor, Trainer computes the loss itself and shifts a causal LM's labels
        # only if the class of accelerator.unwrap_model(model) is a causal LM's. That unwrap keeps
        # torch.compile's wrapper (OptimizedModule, no causal LM), so the labels would go unshifted:
        # each token scored against itself, a loss that trains silently wrong. The class is read here
        # through the wrapper, as Trainer's DDP path reads it; Trainer's loss unwraps the model for
        # nothing else.
        with _unwrapping_through_compile(self.accelerator):
            return super().compute_loss(model, *args, **kwargs)

    # ---- the optimizer: zcompile's, from Trainer's arguments ----

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            self.optimizer = self._zero_optimizer_from_args(self.model if model is None else model)
        elif not isinstance(_unwrapped(self.optimizer), zcompile.optim.ShardedOptimizer):
            raise TypeError(
                "zcompile.integrations.hf.ZeroTrainer: "
                f"optimizers=({type(_unwrapped(self.optimizer)).__name__}, ...) is not a zcompile.optim optimizer: "
                "its step would not see the gradients, which live on zcompile's shards. Pass zcompile.optim.AdamW / "
                "SGD, or no optimizer to have one built from the TrainingArguments"
            )
        return self.optimizer

    def _zero_optimizer_from_args(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        args = self.args
        optim = str(getattr(args.optim, "value", args.optim))
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        if optim in ADAMW_OPTIMS:
            return zcompile.optim.AdamW(
                groups,
                lr=args.learning_rate,
                betas=(args.adam_beta1, args.adam_beta2),
                eps=args.adam_epsilon,
                **self.optimizer_options,
            )
        if optim == "sgd":
            return zcompile.optim.SGD(groups, lr=args.learning_rate, **self.optimizer_options)
        raise ValueError(
            f"zcompile.integrations.hf.ZeroTrainer: TrainingArguments(optim={optim!r}) has no zcompile "
            f"optimizer; use {' / '.join(ADAMW_OPTIMS)} (zcompile.optim.AdamW) or 'sgd', or pass a "
            "zcompile.optim optimizer in optimizers="
        )

    def _zero_optimizer(self) -> zcompile.optim.ShardedOptimizer:
        return _unwrapped(self.optimizer)

    # ---- clipping and the logged norm: the global norm over every rank's shards ----

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        return self._zero_optimizer().clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: torch.Tensor | None = None) -> torch.Tensor:
        if grad_norm is None:  # no clipping asked for: the norm for the log, clipping nothing
            grad_norm = self._zero_optimizer().clip_grad_norm_(math.inf)
        return grad_norm

    # ---- saving and resuming ----

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A Hugging Face folder of the consolidated fp32 weights, written by rank 0; every rank calls
        it (Trainer does) because every rank holds a part of the weights."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        # collective (a rank-0-only call is a RankDivergenceError in 60 s); the weights on rank 0 only
        state_dict = full_state_dict(
            self.model, rank=0, timeout_s=60.0, exclude_frozen_parameters=_trains_an_adapter(self.model)
        )
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        extra = {"lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None}
        zcompile.checkpoint.save(
            os.path.join(output_dir, CHECKPOINT_SUBDIR),
            self.model,
            self._zero_optimizer(),
            extra=extra,
            exclude_frozen_parameters=_trains_an_adapter(self.model),
        )

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        if _zero_checkpoint(resume_from_checkpoint) is None:  # a checkpoint of another Trainer: its weights
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        # else: the weights come with the optimizer state, from zcompile's checkpoint (below)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        path = _zero_checkpoint(checkpoint) if checkpoint is not None else None
        if path is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        extra = zcompile.checkpoint.load(path, self.model, self._zero_optimizer())
        if self.lr_scheduler is not None and extra.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])


def _trains_an_adapter(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a peft model (LoRA and the like): Trainer saves its adapter alone, and its
    frozen base, which the run never changes, need not be gathered or checkpointed."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(unwrap(model), PeftModel)


def _unwrapped(optimizer: torch.optim.Optimizer) -> Any:
    """accelerate wraps the optimizer (``AcceleratedOptimizer``); zcompile's is inside."""
    return getattr(optimizer, "optimizer", optimizer)


@contextlib.contextmanager
def _unwrapping_through_compile(accelerator: Any):
    """``accelerator.unwrap_model`` also removes torch.compile's wrapper while inside (an attribute of
    this accelerator only, put back on exit)."""
    own = accelerator.__dict__.get("unwrap_model")
    unwrap = accelerator.unwrap_model

    def through_compile(model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        return unwrap(model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=False)

    accelerator.unwrap_model = through_compile
    try:
        yield
    finally:
        if own is None:
            del accelerator.unwrap_model
        else:
            accelerator.unwrap_model = own


def _zero_checkpoint(checkpoint: str) -> str | None:
    path = os.path.join(checkpoint, CHECKPOINT_SUBDIR)
    return path if os.path.isdir(path) else None


def _take_over_torch_compile(args: transformers.TrainingArguments) -> None:
    """``torch_compile_backend="zero"`` means ZeroTrainer; accelerate would refuse the name, and the
    model must not be compiled a second time by accelerate."""
    if not args.torch_compile:
        return
    if args.torch_compile_backend != "zero":
        raise ValueError(
            "zcompile.integrations.hf.ZeroTrainer: "
            f"TrainingArguments(torch_compile_backend={args.torch_compile_backend!r}): ZeroTrainer compiles the "
            "model with the zero backend itself; drop torch_compile, or set torch_compile_backend='zero'"
        )
    if args.torch_compile_mode is not None:
        raise ValueError(
            "zcompile.integrations.hf.ZeroTrainer: torch_compile_mode is not supported by the zero backend; "
            "pass its options in zero_options= instead"
        )
    args.torch_compile, args.torch_compile_backend = False, None


def _refuse_unsupported(args: transformers.TrainingArguments) -> None:
    if args.fp16:
        raise ValueError(
            "zcompile.integrations.hf.ZeroTrainer: fp16=True is not supported: accelerate's fp16 loss scaling "
            "runs on a GPU only and has not been run with zcompile. Use bf16=True (or zero_options="
            "{'param_dtype': 'bf16'}); in a training loop of your own, torch.amp.GradScaler works over "
            "zcompile.optim"
        )
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        raise ValueError(
            "zcompile.integrations.hf.ZeroTrainer: TrainingArguments(deepspeed=...) / fsdp=... ask for another "
            f"sharding; {_OWN_SHARDING}"
        )
