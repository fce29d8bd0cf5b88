"""A DeepSpeed config read into zcompile's options, optimizer arguments and training-loop numbers.

    port = zcompile.options_from_deepspeed("ds_config.json")   # or the config as a dict
    print(port.summary())                                       # what maps where, what is not honoured
    model = torch.compile(model, backend="zero", options=port.options)
    optimizer = port.make_optimizer(model.parameters())         # zcompile.optim.AdamW / SGD

DeepSpeed itself is not imported: the config is read as JSON. Only the keys present in the config
are mapped (DeepSpeed's defaults differ from zcompile's in places; ``port.log`` names the ones that
matter). Conversions:

- element counts become MiB as ``elements x bytes of one element / 2**20``, the element being what
  DeepSpeed counts: a gradient (``reduce_bucket_size``) in the reduce dtype (``communication_data_type``,
  else the training dtype), a parameter (``allgather_bucket_size``, ``stage3_*``) in the training
  dtype (bf16 and fp16: 2 bytes; fp32: 4);
- ``reduce_bucket_size`` -> ``bucket_mb`` (zcompile's one bucket size for the graphs' all-gathers and
  reduce-scatters); ``allgather_bucket_size`` -> the optimizer's ``bucket_mb`` at stages 1 and 2 (the
  step's all-gather of the updated weights; DeepSpeed's stage 3 does not read it either);
- ``stage3_prefetch_bucket_size`` -> ``prefetch``, approximately: the number of ``bucket_mb`` buckets
  its bytes hold (at least 1; 0 elements: no prefetch);
- ``stage3_max_live_parameters`` -> ``memory_budget_mb``: both cap the gathered weights that
  prefetching may hold;
- ``stage3_max_reuse_distance`` -> ``keep_gathered_mb``, approximately: DeepSpeed keeps a weight
  gathered when its next use comes within that many elements of other weights; from a weight's use
  in forward to its use in backward come the layers after it twice (forward, then backward), so
  the last layers of forward holding half the distance stay gathered, which is what
  ``keep_gathered_mb`` keeps (per compiled graph);
- ``zero_quantized_weights``, ``zero_quantized_gradients``, ``zero_hpz_partition_size`` (above 1) ->
  ``quantize_weights``, ``quantize_grads``, ``hpz_size`` at stage 3 (DeepSpeed applies ZeRO++ at
  stage 3 only, so below it they are ignored as DeepSpeed ignores them);
- ``bf16.enabled`` / ``fp16.enabled`` -> ``param_dtype``; fp16 also gives ``grad_scaler``, the
  arguments of the ``torch.amp.GradScaler`` the training loop keeps (zcompile scales no loss itself);
- ``gradient_clipping`` -> ``max_grad_norm`` (also in ``optimizer_kwargs``: ``step()`` clips).

Stage 0 (ZeRO off) becomes stage 1, the nearest, and is named in ``not_honoured``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Iterable
from typing import Any

from zcompile.config import ZeroConfig

log = logging.getLogger(__name__)

PREFIX = "zcompile.options_from_deepspeed: "
MIB = 2**20
_OPTION_ORDER = [f.name for f in dataclasses.fields(ZeroConfig)]
_DEFAULT_BUCKET_MB = next(f.default for f in dataclasses.fields(ZeroConfig) if f.name == "bucket_mb")
_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_COMM_DTYPES = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}  # DeepSpeed's communication_data_type values
_AUTOCAST_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16"}
AUTO = "'auto' is Hugging Face Trainer's to fill in; zcompile keeps its own default: write the value"
_LOGGING = (
    "DeepSpeed's logging and monitoring; zcompile.step_report(model, optimizer) reports a step's collectives and memory"
)
_DS_DETAIL = "a DeepSpeed implementation setting with no zcompile counterpart"
_OFFLOAD = (
    "zcompile keeps parameters and optimizer state on the training device (no CPU or NVMe offload); "
    "spread the states over more ranks; zcompile.estimate_memory predicts the per-rank memory"
)
_PERSISTENCE = (
    "zcompile shards every parameter, however small; small parameters share collectives through "
    "bucket_mb instead of staying whole on every rank"
)

# top-level keys that change nothing zcompile would do differently
_IGNORED_TOP = {
    "steps_per_print": _LOGGING,
    "wall_clock_breakdown": _LOGGING,
    "dump_state": _LOGGING,
    "memory_breakdown": _LOGGING,
    "flops_profiler": _LOGGING,
    "tensorboard": _LOGGING,
    "wandb": _LOGGING,
    "csv_monitor": _LOGGING,
    "comet": _LOGGING,
    "comms_logger": _LOGGING,
    "zero_allow_untested_optimizer": "zcompile takes zcompile.optim's optimizers only",
    "zero_force_ds_cpu_optimizer": "zcompile takes zcompile.optim's optimizers only",
    "checkpoint": "DeepSpeed's checkpoint-engine settings; zcompile.checkpoint.save/load take none",
}
# zero_optimization keys zcompile has no use for, whatever their value
_IGNORED_ZERO = {
    "contiguous_gradients": "zcompile's buckets are flat buffers by construction",
    "round_robin_gradients": "it spreads gradient copies to an offloaded optimizer; zcompile does not offload",
    "load_from_fp32_weights": "zcompile's checkpoints hold the fp32 master weights",
    "elastic_checkpoint": "zcompile.checkpoint.load reshards to any number of ranks",
    "ignore_unused_parameters": "zcompile has no unused-parameter check to turn off",
    "sub_group_size": "it tiles DeepSpeed's offloaded optimizer step; zcompile's step is bucketed by the optimizer's bucket_mb",
    "cpu_offload_use_pin_memory": "zcompile does not offload",
    "stage3_gather_16bit_weights_on_model_save": "zcompile.checkpoint.full_state_dict(model) gathers the weights for saving",
    "stage3_gather_fp16_weights_on_model_save": "zcompile.checkpoint.full_state_dict(model) gathers the weights for saving",
    "stage3_module_granularity_threshold": "zcompile gathers by buckets of the compiled graph, not by module hooks",
    "stage3_use_all_reduce_for_fetch_params": "zcompile's gathers are all-gathers in the compiled graph",
    "use_multi_rank_bucket_allreduce": "zcompile reduce-scatters in the compiled backward (stages 2, 3) or at the step (stage 1)",
    "grad_hooks": "zcompile reduces stage 1's gradients at the step, stages 2 and 3's in the compiled backward",
    "legacy_stage1": _DS_DETAIL,
    "memory_efficient_linear": _DS_DETAIL,
    "override_module_apply": _DS_DETAIL,
    "log_trace_cache_warnings": _DS_DETAIL,
    "enable_sanity_checks": _DS_DETAIL,
    "pipeline_loading_checkpoint": _DS_DETAIL,
    "leaf_module": _DS_DETAIL,
    "save_muon_momentum_buffer_in_memory": _DS_DETAIL,
}
# DeepSpeed's field names of the stage3_* aliases (its pydantic model takes both)
_STAGE3_ALIASES = {
    name: f"stage3_{name}"
    for name in (
        "prefetch_bucket_size",
        "param_persistence_threshold",
        "model_persistence_threshold",
        "max_live_parameters",
        "max_reuse_distance",
        "gather_16bit_weights_on_model_save",
        "module_granularity_threshold",
        "use_all_reduce_for_fetch_params",
        "allgather_sequential",
    )
}
_ZEROPP = ("zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size")


@dataclasses.dataclass(frozen=True)
class DeepSpeedPort:
    """What ``options_from_deepspeed`` read from a DeepSpeed config.

    Attributes:
        options: ``torch.compile(model, backend="zero", options=...)``; validated by
            ``zcompile.ZeroConfig``.
        optimizer: ``"AdamW"`` or ``"SGD"`` (a ``zcompile.optim`` class), None when the config names
            none or one zcompile has not.
        optimizer_kwargs: the optimizer's keyword arguments (``lr``, ``betas``...), with zcompile's own
            (``bucket_mb``, ``max_grad_norm``, ``skip_nonfinite``) where the config sets them; without
            an optimizer, those alone, for the optimizer you build.
        max_grad_norm: from ``gradient_clipping`` (None: no clipping); ``optimizer_kwargs`` has it too,
            so ``step()`` clips. Calling ``optimizer.clip_grad_norm_(max_grad_norm)`` yourself instead
            is the same.
        gradient_accumulation_steps: micro-batches per ``optimizer.step()``: call the model and
            ``backward()`` on each, the loss divided by it as DeepSpeed's ``engine.backward`` does.
        train_micro_batch_size_per_gpu: the batch each rank's model call takes.
        grad_scaler: with fp16, the arguments of the ``torch.amp.GradScaler`` to keep in the loop.
        not_honoured: ``(key, reason)`` for each key present that zcompile cannot honour.
        log: one line per key read: what it maps to and how, or why it is ignored.
    """

    options: dict[str, Any]
    optimizer: str | None
    optimizer_kwargs: dict[str, Any]
    max_grad_norm: float | None
    gradient_accumulation_steps: int | None
    train_micro_batch_size_per_gpu: int | None
    grad_scaler: dict[str, Any] | None
    not_honoured: tuple[tuple[str, str], ...]
    log: tuple[str, ...]

    def make_optimizer(self, params: Iterable) -> Any:
        """``zcompile.optim.<optimizer>(params, **optimizer_kwargs)``."""
        if self.optimizer is None:
            raise ValueError(
                f"{PREFIX}the config names no optimizer zcompile has; build zcompile.optim.AdamW or SGD "
                "yourself, with **port.optimizer_kwargs for the settings the config gave"
            )
        import zcompile.optim

        return getattr(zcompile.optim, self.optimizer)(params, **self.optimizer_kwargs)

    def summary(self) -> str:
        """A few lines: the options, the optimizer, the loop's numbers, and what is not honoured."""
        arguments = "".join(f", {k}={v!r}" for k, v in self.optimizer_kwargs.items())
        lines = [
            f"torch.compile(model, backend='zero', options={self.options!r})",
            f"optimizer: zcompile.optim.{self.optimizer}(params{arguments})"
            if self.optimizer
            else f"optimizer: none from the config; zcompile.optim arguments: {self.optimizer_kwargs!r}",
            f"gradient_accumulation_steps={self.gradient_accumulation_steps}, "
            f"train_micro_batch_size_per_gpu={self.train_micro_batch_size_per_gpu}, max_grad_norm={self.max_grad_norm}",
        ]
        if self.grad_scaler is not None:
            scaler = ", ".join(f"{k}={v!r}" for k, v in self.grad_scaler.items())
            lines.append(f"fp16: keep a torch.amp.GradScaler({scaler}) in the loop")
        if self.not_honoured:
            lines.append(f"not honoured ({len(self.not_honoured)}):")
            lines += [f"  {key}: {reason}" for key, reason in self.not_honoured]
        else:
            lines.append("every key is honoured")
        lines.append(f"(port.log: {len(self.log)} lines on where each key went)")
        return "\n".join(lines)


def options_from_deepspeed(config: dict | str | os.PathLike, *, world_size: int | None = None) -> DeepSpeedPort:
    """Reads a DeepSpeed config (a dict, or the path of its JSON file) into a ``DeepSpeedPort``
    (module docstring: the conversions). ``world_size`` (default: the initialized process group's,
    else unknown) only infers a batch number DeepSpeed would derive from ``train_batch_size``."""
    raw = _load(config)
    if world_size is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            world_size = dist.get_world_size()
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"{PREFIX}world_size must be an int >= 1 or None, got {world_size!r}")
    port = _Reader(raw, world_size).port()
    for line in port.log:
        log.debug("%s", line)
    if port.not_honoured:
        log.warning(
            "%sDeepSpeed keys not honoured: %s (DeepSpeedPort.not_honoured says why)",
            PREFIX,
            ", ".join(key for key, _ in port.not_honoured),
        )
    return port


def _load(config: Any) -> dict:
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{PREFIX}no DeepSpeed config file at {path!r}; pass the path of the JSON file given to "
                "deepspeed.initialize(config=...), or the config as a dict"
            )
        with open(path, encoding="utf-8") as f:
            try:
                loaded = json.load(f)
            except json.JSONDecodeError as error:
                raise ValueError(f"{PREFIX}{path!r} is not valid JSON ({error}); fix the file") from error
        if not isinstance(loaded, dict):
            raise ValueError(f"{PREFIX}{path!r} holds a JSON {type(loaded).__name__}, not an object; fix the file")
        return loaded
    raise TypeError(f"{PREFIX}config must be a dict or the path of a JSON file, got {type(config).__name__}")


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _mib(elements: int, element_bytes: int) -> float:
    return elements * element_bytes / MIB


class _Reader:
    """Reads one config; each ``_read_*`` fills the fields of the port and the log."""

    def __init__(self, raw: dict, world_size: int | None):
        self.raw = raw
        self.world_size = world_size
        self.options: dict[str, Any] = {}
        self.optimizer: str | None = None
        self.optimizer_kwargs: dict[str, Any] = {}
        self.zcompile_optim: dict[str, Any] = {}  # bucket_mb, max_grad_norm, skip_nonfinite
        self.max_grad_norm: float | None = None
        self.gas: int | None = None
        self.micro: int | None = None
        self.grad_scaler: dict[str, Any] | None = None
        self.not_honoured: list[tuple[str, str]] = []
        self.log: list[str] = []
        self.param_dtype: str | None = None
        self.reduce_dtype: str | None = None

    # ---- the log ----

    def mapped(self, key: str, value: Any, target: str, result: Any, how: str = "") -> None:
        self.log.append(f"{key} = {value!r} -> {target} = {result!r}" + (f" ({how})" if how else ""))

    def ignored(self, key: str, why: str) -> None:
        self.log.append(f"{key}: ignored, {why}")

    def refuse(self, key: str, why: str) -> None:
        self.not_honoured.append((key, why))
        self.log.append(f"{key}: not honoured, {why}")

    # ---- values ----

    def section(self, key: str) -> dict:
        value = self.raw.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ValueError(f"{PREFIX}{key} must be a JSON object, got {value!r}; fix the config")
        return value

    def flag(self, key: str, value: Any) -> bool | None:
        """A boolean setting; None for 'auto' (named in not_honoured)."""
        if _is_auto(value):
            self.refuse(key, AUTO)
            return None
        if not isinstance(value, bool):
            raise ValueError(f"{PREFIX}{key} must be true or false, got {value!r}; fix the config")
        return value

    def number(self, key: str, value: Any, *, integer: bool = False, positive: bool = False) -> float | int | None:
        """A number >= 0 (> 0 with ``positive``); an integral float (JSON's 5e8) as an int with
        ``integer``; None for 'auto' (named in not_honoured)."""
        if _is_auto(value):
            self.refuse(key, AUTO)
            return None
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
        ok = ok and (value > 0 if positive else value >= 0) and (not integer or float(value).is_integer())
        if not ok:
            kind = "an integer" if integer else "a number"
            raise ValueError(
                f"{PREFIX}{key} must be {kind} {'> 0' if positive else '>= 0'}, got {value!r}; fix the config"
            )
        return int(value) if integer else float(value)

    # ---- the sections ----

    def port(self) -> DeepSpeedPort:
        self._read_precision()
        self._read_communication()
        stage = self._read_zero()
        self._read_optimizer()
        self._read_clipping()
        self._read_batch()
        self._read_rest()
        if self.param_dtype == "fp16" and stage == 2:
            self.refuse(
                "fp16.enabled",
                "at stage 2 with param_dtype='fp16' zcompile keeps fp16 gradient shards, which "
                "torch.amp.GradScaler refuses to unscale: use stage 1 or 3, or bf16",
            )
        options = {name: self.options[name] for name in _OPTION_ORDER if name in self.options}
        self._validate(options)
        return DeepSpeedPort(
            options=options,
            optimizer=self.optimizer,
            optimizer_kwargs={**self.optimizer_kwargs, **self.zcompile_optim},
            max_grad_norm=self.max_grad_norm,
            gradient_accumulation_steps=self.gas,
            train_micro_batch_size_per_gpu=self.micro,
            grad_scaler=self.grad_scaler,
            not_honoured=tuple(self.not_honoured),
            log=tuple(self.log),
        )

    @staticmethod
    def _validate(options: dict) -> None:
        """The options through ``ZeroConfig``'s own validation: a mapping that built an invalid
        options dict is this module's bug, reported as such."""
        try:
            ZeroConfig.from_options(options)
        except (TypeError, ValueError) as error:  # pragma: no cover - a mapping bug
            raise ValueError(
                f"{PREFIX}the options built from the config are invalid ({error}); please report it with the config"
            ) from error

    def _read_precision(self) -> None:
        fp16, bf16 = self.section("fp16"), self.section("bf16")
        bf16_key = "bf16"
        if not bf16 and "bfloat16" in self.raw:  # DeepSpeed's older name, read when bf16 is absent
            bf16, bf16_key = self.section("bfloat16"), "bfloat16"
        elif "bfloat16" in self.raw:
            self.ignored("bfloat16", "bf16 is present, and DeepSpeed reads bf16 first")
        fp16_on = self.flag("fp16.enabled", fp16.get("enabled", False))
        bf16_on = self.flag(f"{bf16_key}.enabled", bf16.get("enabled", False))
        if fp16_on and bf16_on:
            raise ValueError(
                f"{PREFIX}fp16.enabled and {bf16_key}.enabled are both true (DeepSpeed refuses it too); enable one"
            )
        if bf16_on:
            self.param_dtype = self.options["param_dtype"] = "bf16"
            self.mapped(f"{bf16_key}.enabled", True, "param_dtype", "bf16", "fp32 master weights and optimizer state")
            self._read_bf16_keys(bf16, bf16_key)
        elif bf16:
            self.ignored(bf16_key, "bf16 is not enabled")
        if fp16_on:
            self.param_dtype = self.options["param_dtype"] = "fp16"
            self.mapped("fp16.enabled", True, "param_dtype", "fp16", "fp32 master weights; keep a torch.amp.GradScaler")
            self._read_fp16_keys(fp16)
        elif fp16:
            self.ignored("fp16", "fp16 is not enabled")
        self._read_amp()

    def _read_bf16_keys(self, bf16: dict, name: str) -> None:
        for key, value in bf16.items():
            path = f"{name}.{key}"
            if key == "enabled":
                continue
            if key == "check_grad_overflow":
                skip = self.flag(path, value)
                if skip is not None:
                    self.zcompile_optim["skip_nonfinite"] = skip
                    self.mapped(
                        path, value, "optimizer skip_nonfinite", skip, "a non-finite step is skipped on every rank"
                    )
            elif key == "immediate_grad_update":
                self.ignored(path, "zcompile reduces the gradients onto their shards as it computes them")
            elif key in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
                if value is True:
                    self.refuse(path, "zcompile keeps fp32 master weights, gradient shards and optimizer state")
                else:
                    self.ignored(path, "zcompile keeps them in fp32, as this asks")
            else:
                self.refuse(path, "unknown to zcompile")

    def _read_fp16_keys(self, fp16: dict) -> None:
        # DeepSpeed's dynamic scaler doubles after loss_scale_window clean steps and halves on an
        # overflow, as GradScaler's growth_factor=2 and backoff_factor=0.5 do; its defaults:
        # initial_scale_power 16, loss_scale_window 1000 (GradScaler's growth_interval is 2000)
        scaler = {"init_scale": 2.0**16, "growth_interval": 1000}
        for key, value in fp16.items():
            path = f"fp16.{key}"
            if key == "enabled":
                continue
            if key == "initial_scale_power":
                power = self.number(path, value, integer=True)
                if power is not None:
                    scaler["init_scale"] = 2.0**power
                    self.mapped(path, value, "GradScaler init_scale", 2.0**power, "2**initial_scale_power")
            elif key == "loss_scale_window":
                window = self.number(path, value, integer=True, positive=True)
                if window is not None:
                    scaler["growth_interval"] = window
                    self.mapped(path, value, "GradScaler growth_interval", window)
            elif key == "loss_scale":
                scale = self.number(path, value)
                if scale:
                    scaler["init_scale"] = scale
                    self.refuse(
                        path,
                        f"a static loss scale: torch.amp.GradScaler scales dynamically (it starts at {scale} here); "
                        "use 0 (dynamic) or bf16",
                    )
                elif scale is not None:
                    self.ignored(path, "0 is dynamic loss scaling, GradScaler's")
            elif key == "hysteresis":
                delay = self.number(path, value, integer=True)
                if delay == 1:
                    self.ignored(path, "GradScaler lowers the scale at every overflow, as hysteresis 1 does")
                elif delay is not None:
                    self.refuse(path, "torch.amp.GradScaler lowers the scale at every overflow (hysteresis 1)")
            elif key == "consecutive_hysteresis":
                if value is True:
                    self.refuse(path, "torch.amp.GradScaler has no hysteresis to refill")
                else:
                    self.ignored(path, "off")
            elif key == "min_loss_scale":
                self.refuse(path, "torch.amp.GradScaler has no lower bound on the scale")
            elif key == "auto_cast":
                self.ignored(path, "the compiled graphs run under autocast to param_dtype, inputs included")
            elif key == "fp16_master_weights_and_grads":
                if value is True:
                    self.refuse(path, "zcompile keeps fp32 master weights and optimizer state")
                else:
                    self.ignored(path, "zcompile keeps fp32 master weights, as this asks")
            else:
                self.refuse(path, "unknown to zcompile")
        self.grad_scaler = scaler
        self.log.append(
            f"fp16 -> torch.amp.GradScaler({', '.join(f'{k}={v!r}' for k, v in scaler.items())}) in the loop "
            "(growth_factor 2 and backoff_factor 0.5 are DeepSpeed's; zcompile scales no loss itself)"
        )

    def _read_amp(self) -> None:
        amp = self.section("amp")
        if amp:
            if amp.get("enabled") is True:
                self.refuse("amp", "NVIDIA apex AMP; use bf16 or fp16 (param_dtype) instead")
            else:
                self.ignored("amp", "off")
        autocast = self.section("torch_autocast")
        if not autocast:
            return
        enabled = self.flag("torch_autocast.enabled", autocast.get("enabled", False))
        if not enabled:
            self.ignored("torch_autocast", "off")
            return
        if self.param_dtype is not None:
            self.refuse("torch_autocast", f"bf16/fp16 already set param_dtype={self.param_dtype!r}")
            return
        name = autocast.get("dtype", "bfloat16")
        dtype = _AUTOCAST_DTYPES.get(str(name).lower().removeprefix("torch."))
        if dtype is None:
            raise ValueError(
                f"{PREFIX}torch_autocast.dtype must be 'bfloat16' or 'float16', got {name!r}; fix the config"
            )
        self.param_dtype = self.options["param_dtype"] = dtype
        self.mapped(
            "torch_autocast.dtype",
            name,
            "param_dtype",
            dtype,
            "approximate: zcompile also gathers the weights in that dtype, where DeepSpeed autocasts the compute only",
        )
        if "lower_precision_safe_modules" in autocast:
            self.refuse("torch_autocast.lower_precision_safe_modules", "param_dtype applies to every module")

    def _read_communication(self) -> None:
        if "communication_data_type" in self.raw:
            value = self.raw["communication_data_type"]
            if value is not None:
                dtype = _COMM_DTYPES.get(str(value).lower())
                if dtype is None:
                    raise ValueError(
                        f"{PREFIX}communication_data_type must be 'fp32', 'fp16' or 'bf16' (as DeepSpeed's), "
                        f"got {value!r}; fix the config"
                    )
                self.reduce_dtype = self.options["reduce_dtype"] = dtype
                self.mapped("communication_data_type", value, "reduce_dtype", dtype)
        op = self.raw.get("gradient_allreduce_op")
        if op is not None:
            if str(op).lower() == "mean":
                self.ignored("gradient_allreduce_op", "zcompile averages the gradients over ranks, as DDP does")
            else:
                self.refuse("gradient_allreduce_op", f"{op!r}: zcompile always averages the gradients over ranks")
        if self.raw.get("prescale_gradients") is True:
            self.refuse("prescale_gradients", "zcompile divides by the world size once, in the reduce-scatter's mean")
        elif "prescale_gradients" in self.raw:
            self.ignored("prescale_gradients", "off")
        if "gradient_predivide_factor" in self.raw:
            factor = self.number("gradient_predivide_factor", self.raw["gradient_predivide_factor"], positive=True)
            if factor == 1:
                self.ignored("gradient_predivide_factor", "1 divides by nothing")
            elif factor is not None:
                self.refuse(
                    "gradient_predivide_factor",
                    "zcompile has no pre-division; to keep large sums in range, reduce in fp32 (reduce_dtype='fp32')",
                )
        if self.raw.get("sparse_gradients") is True:
            self.refuse("sparse_gradients", "zcompile reduces dense gradients only")
        elif "sparse_gradients" in self.raw:
            self.ignored("sparse_gradients", "off")

    def _reduce_dtype(self) -> str:
        """The dtype the gradients are reduced in: communication_data_type, else the training dtype."""
        return self.reduce_dtype or self.param_dtype or "fp32"

    def _read_zero(self) -> int:
        zero = self.raw.get("zero_optimization")
        if isinstance(zero, bool):  # DeepSpeed's deprecated form: true is stage 1
            stage_value, zero_key, zero = (1 if zero else 0), "zero_optimization", {}
        elif zero is None or isinstance(zero, dict):
            zero = zero or {}
            stage_value, zero_key = zero.get("stage", 0), "zero_optimization.stage"
        else:
            raise ValueError(f"{PREFIX}zero_optimization must be a JSON object, got {zero!r}; fix the config")
        if isinstance(stage_value, bool) or not isinstance(stage_value, int) or stage_value not in (0, 1, 2, 3):
            raise ValueError(
                f"{PREFIX}zero_optimization.stage must be 0, 1, 2 or 3 (DeepSpeed's ZeRO stages), got "
                f"{stage_value!r}; fix the config (zcompile runs stages 1, 2 and 3)"
            )
        if stage_value == 0:
            stage = 1
            absent = (
                " (absent: DeepSpeed's default, stage 0)" if "stage" not in zero and zero_key.endswith("stage") else ""
            )
            self.refuse(
                zero_key,
                f"stage 0{absent} is plain data parallelism, which zcompile has not; stage 1 is nearest: "
                "the same gradient traffic per step, the optimizer state sharded",
            )
        else:
            stage = stage_value
            self.mapped(zero_key, stage_value, "stage", stage)
        self.options["stage"] = stage
        grad_bytes, param_bytes = _BYTES[self._reduce_dtype()], _BYTES[self.param_dtype or "fp32"]
        units = f"elements x {grad_bytes} bytes / 2**20"
        zero = {_STAGE3_ALIASES.get(k, k): v for k, v in zero.items()}

        if "reduce_bucket_size" in zero:
            elements = self.number("zero_optimization.reduce_bucket_size", zero["reduce_bucket_size"], integer=True)
            if elements is not None:
                self.options["bucket_mb"] = _mib(elements, grad_bytes)
                self.mapped(
                    "zero_optimization.reduce_bucket_size",
                    zero["reduce_bucket_size"],
                    "bucket_mb",
                    self.options["bucket_mb"],
                    units,
                )
        if "allgather_bucket_size" in zero:
            key = "zero_optimization.allgather_bucket_size"
            elements = self.number(key, zero["allgather_bucket_size"], integer=True)
            if stage == 3:
                self.ignored(key, "DeepSpeed's stage 3 gathers by stage3_prefetch_bucket_size, not by this")
            elif elements is not None:
                self.zcompile_optim["bucket_mb"] = _mib(elements, param_bytes)
                self.mapped(
                    key,
                    zero["allgather_bucket_size"],
                    "optimizer bucket_mb",
                    self.zcompile_optim["bucket_mb"],
                    f"the step's all-gather of the updated weights; elements x {param_bytes} bytes / 2**20",
                )
        if "overlap_comm" in zero:
            overlap = self.flag("zero_optimization.overlap_comm", zero["overlap_comm"])
            if overlap is not None:
                self.options["overlap"] = overlap
                self.mapped("zero_optimization.overlap_comm", overlap, "overlap", overlap)
        self._read_stage3(zero, stage, param_bytes)
        self._read_zeropp(zero, stage)
        self._read_zero_rest(zero)
        return stage

    def _read_stage3(self, zero: dict, stage: int, param_bytes: int) -> None:
        stage3 = [k for k in zero if k.startswith("stage3_") and k not in _IGNORED_ZERO]
        if stage != 3:
            for key in stage3:
                self.ignored(
                    f"zero_optimization.{key}", f"a stage-3 setting at stage {stage} (DeepSpeed ignores it too)"
                )
            return
        units = f"elements x {param_bytes} bytes / 2**20"
        if "stage3_max_live_parameters" in zero:
            key = "zero_optimization.stage3_max_live_parameters"
            elements = self.number(key, zero["stage3_max_live_parameters"], integer=True)
            if elements:
                self.options["memory_budget_mb"] = _mib(elements, param_bytes)
                self.mapped(
                    key, zero["stage3_max_live_parameters"], "memory_budget_mb", self.options["memory_budget_mb"], units
                )
            elif elements == 0:
                self.options["prefetch"] = 0
                self.mapped(key, 0, "prefetch", 0, "no gathered weights beyond the one in use")
        if "stage3_prefetch_bucket_size" in zero and self.options.get("prefetch") == 0:
            self.ignored(
                "zero_optimization.stage3_prefetch_bucket_size", "stage3_max_live_parameters 0 prefetches nothing"
            )
        elif "stage3_prefetch_bucket_size" in zero:
            key = "zero_optimization.stage3_prefetch_bucket_size"
            elements = self.number(key, zero["stage3_prefetch_bucket_size"], integer=True)
            if elements is not None:
                bucket_mb = self.options.get("bucket_mb", _DEFAULT_BUCKET_MB)
                if elements == 0:
                    depth, how = 0, "no prefetch"
                elif bucket_mb == 0:
                    depth, how = 1, "bucket_mb 0 gathers one parameter at a time: one ahead"
                else:
                    depth = max(1, int(_mib(elements, param_bytes) // bucket_mb))
                    how = f"approximate: buckets of {bucket_mb:g} MiB in {elements} x {param_bytes} bytes, at least 1"
                self.options["prefetch"] = depth
                self.mapped(key, zero["stage3_prefetch_bucket_size"], "prefetch", depth, how)
        if "stage3_max_reuse_distance" in zero:
            key = "zero_optimization.stage3_max_reuse_distance"
            elements = self.number(key, zero["stage3_max_reuse_distance"], integer=True)
            if elements is not None:
                self.options["keep_gathered_mb"] = _mib(elements // 2, param_bytes)
                self.mapped(
                    key,
                    zero["stage3_max_reuse_distance"],
                    "keep_gathered_mb",
                    self.options["keep_gathered_mb"],
                    f"approximate: the last layers of forward, half the distance (module docstring); "
                    f"elements / 2 x {param_bytes} bytes / 2**20, per compiled graph",
                )
        for key in ("stage3_param_persistence_threshold", "stage3_model_persistence_threshold"):
            if key in zero:
                self.refuse(f"zero_optimization.{key}", _PERSISTENCE)
        if zero.get("stage3_allgather_sequential") is True:
            self.refuse(
                "zero_optimization.stage3_allgather_sequential",
                "bucket_mb sizes gathers and reduce-scatters together; bucket_mb=0 gives one collective per parameter",
            )
        elif "stage3_allgather_sequential" in zero:
            self.ignored("zero_optimization.stage3_allgather_sequential", "off")
        read = {
            "stage3_max_live_parameters",
            "stage3_prefetch_bucket_size",
            "stage3_max_reuse_distance",
            "stage3_param_persistence_threshold",
            "stage3_model_persistence_threshold",
            "stage3_allgather_sequential",
        }
        for key in stage3:
            if key not in read:
                self.refuse(f"zero_optimization.{key}", "unknown to zcompile")

    def _read_zeropp(self, zero: dict, stage: int) -> None:
        for name in _ZEROPP:
            if name not in zero:
                continue
            key = f"zero_optimization.{name}"
            if name == "zero_hpz_partition_size":
                value = self.number(key, zero[name], integer=True)
                on = value is not None and value > 1
            else:
                value = on = self.flag(key, zero[name])
            if not on:
                self.ignored(key, "off")
            elif stage != 3:
                self.ignored(key, f"DeepSpeed applies ZeRO++ at stage 3 only, and this config's stage is {stage}")
            elif name == "zero_hpz_partition_size":
                self.options["hpz_size"] = value
                self.mapped(key, value, "hpz_size", value, "it must divide the world size, else zcompile turns hpZ off")
            else:
                target = "quantize_weights" if name == "zero_quantized_weights" else "quantize_grads"
                self.options[target] = True
                self.mapped(key, True, target, True)

    def _read_zero_rest(self, zero: dict) -> None:
        done = {"stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm", *_ZEROPP}
        for name, value in zero.items():
            key = f"zero_optimization.{name}"
            if name in done or (name.startswith("stage3_") and name not in _IGNORED_ZERO):
                continue
            if name in _IGNORED_ZERO:
                self.ignored(key, _IGNORED_ZERO[name])
            elif name == "reduce_scatter":
                if value is False:
                    self.refuse(
                        key, "zcompile always reduce-scatters (no all-reduce form); the averaged gradients are the same"
                    )
                else:
                    self.ignored(key, "zcompile reduce-scatters by construction")
            elif name == "allgather_partitions":
                if value is False:
                    self.refuse(key, "zcompile always all-gathers (no broadcast form); the weights are the same")
                else:
                    self.ignored(key, "zcompile all-gathers by construction")
            elif name in ("offload_param", "offload_optimizer"):
                device = value.get("device", "none") if isinstance(value, dict) else value
                if value is None or str(device).lower() == "none":
                    self.ignored(key, "device 'none': off")
                else:
                    self.refuse(key, f"device {device!r}: {_OFFLOAD}")
            elif name in ("cpu_offload", "cpu_offload_param"):
                if value is True:
                    self.refuse(key, _OFFLOAD)
                else:
                    self.ignored(key, "off")
            elif name == "zero_quantized_nontrainable_weights":
                if value is True:
                    self.refuse(key, "zcompile keeps frozen weights in their dtype (MixZ++ has no counterpart)")
                else:
                    self.ignored(key, "off")
            elif name == "zeropp_loco_param":
                if value:
                    self.refuse(key, "zcompile's quantize_grads has no LoCo error feedback")
                else:
                    self.ignored(key, "off")
            elif name == "mics_shard_size":
                if isinstance(value, int) and value > 0:
                    self.refuse(key, "MiCS sub-group sharding: zcompile shards over the whole data-parallel group")
                else:
                    self.ignored(key, "off")
            elif name == "mics_hierarchical_params_gather":
                if value is True:
                    self.refuse(key, "a MiCS setting: zcompile has no MiCS")
                else:
                    self.ignored(key, "off")
            elif name == "zenflow":
                self.refuse(key, "ZenFlow's offloaded optimizer: zcompile does not offload")
            else:
                self.refuse(key, "unknown to zcompile")

    def _read_optimizer(self) -> None:
        opt = self.section("optimizer")
        if not opt:
            self.log.append("optimizer: absent; build zcompile.optim.AdamW or SGD with **port.optimizer_kwargs")
            return
        type_name = opt.get("type")
        if not isinstance(type_name, str):
            raise ValueError(
                f"{PREFIX}optimizer.type must be a name such as 'AdamW', got {type_name!r}; fix the config"
            )
        params = opt.get("params") or {}
        if not isinstance(params, dict):
            raise ValueError(f"{PREFIX}optimizer.params must be a JSON object, got {params!r}; fix the config")
        for key in opt:
            if key not in ("type", "params"):
                self.refuse(f"optimizer.{key}", "unknown to zcompile")
        lower = type_name.lower()
        if lower in ("adam", "adamw"):
            self._read_adam(type_name, params)
        elif lower == "sgd":
            self.optimizer = "SGD"
            self.mapped("optimizer.type", type_name, "optimizer", "SGD", "zcompile.optim.SGD")
            for key, value in params.items():
                path = f"optimizer.params.{key}"
                if key in ("lr", "momentum", "dampening", "weight_decay"):
                    self._keep(path, key, self.number(path, value))
                elif key == "nesterov":
                    self._keep(path, key, self.flag(path, value))
                else:
                    self.refuse(path, "unknown to zcompile.optim.SGD")
        else:
            self.refuse(
                "optimizer.type",
                f"{type_name!r}: zcompile.optim has AdamW and SGD; build one with **port.optimizer_kwargs",
            )

    def _keep(self, path: str, name: str, value: Any) -> None:
        if value is not None:
            self.optimizer_kwargs[name] = value
            self.mapped(path, value, f"optimizer {name}", value)

    def _read_adam(self, type_name: str, params: dict) -> None:
        self.optimizer = "AdamW"
        lower = type_name.lower()
        torch_adam = params.get("torch_adam", False) is True
        adam_w_mode = params.get("adam_w_mode", True)
        if not isinstance(adam_w_mode, bool):
            raise ValueError(
                f"{PREFIX}optimizer.params.adam_w_mode must be true or false, got {adam_w_mode!r}; fix the config"
            )
        decoupled = lower == "adamw" or adam_w_mode
        self.mapped("optimizer.type", type_name, "optimizer", "AdamW", "decoupled weight decay" if decoupled else "")
        for key, value in params.items():
            path = f"optimizer.params.{key}"
            if key in ("lr", "eps", "weight_decay"):
                self._keep(path, key, self.number(path, value))
            elif key == "betas":
                if _is_auto(value):
                    self.refuse(path, AUTO)
                    continue
                if not (isinstance(value, (list, tuple)) and len(value) == 2):
                    raise ValueError(f"{PREFIX}{path} must be two numbers, got {value!r}; fix the config")
                betas = tuple(self.number(path, b) for b in value)
                self._keep(path, "betas", betas)
            elif key == "adam_w_mode":
                self.log.append(f"{path} = {value!r}: " + ("AdamW" if decoupled else "Adam with L2 weight decay"))
            elif key == "torch_adam":
                self.ignored(path, "zcompile's AdamW update is one fused kernel either way")
            elif key == "bias_correction":
                if value is False:
                    self.refuse(path, "zcompile.optim.AdamW always corrects the moments' bias")
                else:
                    self.ignored(path, "zcompile.optim.AdamW corrects the moments' bias")
            elif key == "amsgrad":
                self._keep(path, "amsgrad", self.flag(path, value))
            elif key == "fp32_optimizer_states":
                if value is False:
                    self.refuse(path, "zcompile keeps the optimizer state in fp32")
                else:
                    self.ignored(path, "zcompile keeps the optimizer state in fp32")
            elif key == "max_grad_norm":
                self.refuse(path, "DeepSpeed refuses it too: use gradient_clipping")
            else:
                self.refuse(path, "unknown to zcompile.optim.AdamW")
        if "weight_decay" not in params:
            # FusedAdam and DeepSpeedCPUAdam default to 0; torch_adam builds torch.optim.AdamW (0.01)
            decay = 0.01 if torch_adam and decoupled else 0.0
            self.optimizer_kwargs["weight_decay"] = decay
            self.log.append(
                f"optimizer.params.weight_decay: absent -> optimizer weight_decay = {decay} (DeepSpeed's default "
                "for this optimizer; zcompile.optim.AdamW's own is 0.01)"
            )
        decay = self.optimizer_kwargs.get("weight_decay", 0.0)
        if not decoupled and decay:
            self.refuse(
                "optimizer.params.adam_w_mode",
                f"false: Adam with L2 weight decay ({decay}) has no zcompile optimizer; the port's AdamW decays "
                "the weights decoupled, which trains differently: set adam_w_mode true or weight_decay 0",
            )
        elif not decoupled:
            self.log.append("optimizer: Adam without weight decay is AdamW with weight_decay=0")

    def _read_clipping(self) -> None:
        if "gradient_clipping" not in self.raw:
            self.log.append(
                "gradient_clipping: absent -> max_grad_norm = None (DeepSpeed's default clips at 1.0 in recent "
                "releases, at 0 (off) in older ones: set it to match yours)"
            )
            return
        norm = self.number("gradient_clipping", self.raw["gradient_clipping"])
        if norm:
            self.max_grad_norm = self.zcompile_optim["max_grad_norm"] = norm
            self.mapped("gradient_clipping", norm, "max_grad_norm", norm, "the global norm over every rank's shards")
        elif norm == 0:
            self.mapped("gradient_clipping", 0, "max_grad_norm", None, "0: no clipping")

    def _read_batch(self) -> None:
        values = {}
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            if key in self.raw:
                values[key] = self.number(key, self.raw[key], integer=True, positive=True)
        total = values.get("train_batch_size")
        micro = values.get("train_micro_batch_size_per_gpu")
        gas = values.get("gradient_accumulation_steps")
        world = self.world_size
        how = {}
        if total is not None and world is not None:  # DeepSpeed's own inference (runtime/config.py)
            if micro is not None and gas is not None:
                if total != micro * gas * world:
                    raise ValueError(
                        f"{PREFIX}train_batch_size {total} != train_micro_batch_size_per_gpu {micro} x "
                        f"gradient_accumulation_steps {gas} x world size {world} (DeepSpeed refuses it too); fix the config"
                    )
            elif micro is not None:
                gas, how["gradient_accumulation_steps"] = (
                    total // (micro * world),
                    "train_batch_size / micro batch / world",
                )
            elif gas is not None:
                micro, how["train_micro_batch_size_per_gpu"] = (
                    total // (gas * world),
                    "train_batch_size / steps / world",
                )
            else:
                gas, micro = 1, total // world
                how = dict.fromkeys(
                    ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu"), "from train_batch_size"
                )
        elif total is not None and (micro is None or gas is None):
            self.log.append("train_batch_size: the missing batch number needs the world size: pass world_size=")
        if gas is None and micro is not None and total is None:
            gas, how["gradient_accumulation_steps"] = 1, "DeepSpeed's default"
        self.gas, self.micro = gas, micro
        for key, value in (("gradient_accumulation_steps", gas), ("train_micro_batch_size_per_gpu", micro)):
            if value is not None:
                self.mapped(key, self.raw.get(key, "(absent)"), key, value, how.get(key, "your loop's number"))
        if total is not None:
            self.log.append(f"train_batch_size = {total}: micro batch x accumulation steps x ranks, in your loop")

    def _read_rest(self) -> None:
        known = {
            "train_batch_size",
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
            "optimizer",
            "fp16",
            "bf16",
            "bfloat16",
            "amp",
            "torch_autocast",
            "gradient_clipping",
            "zero_optimization",
            "communication_data_type",
            "gradient_allreduce_op",
            "prescale_gradients",
            "gradient_predivide_factor",
            "sparse_gradients",
        }
        for key, value in self.raw.items():
            if key in known:
                continue
            if key in _IGNORED_TOP:
                self.ignored(key, _IGNORED_TOP[key])
            elif key == "scheduler":
                name = value.get("type") if isinstance(value, dict) else value
                self.refuse(
                    key,
                    f"{name!r}: build the torch.optim.lr_scheduler equivalent over the zcompile optimizer (it steps it unchanged)",
                )
            elif key == "activation_checkpointing":
                self.refuse(
                    key,
                    "it configures deepspeed.checkpointing calls in the model; with zcompile use "
                    "torch.utils.checkpoint in the model, or the activation_memory_budget option",
                )
            elif key == "data_types":
                self.refuse(key, "zcompile has no setting for the gradient accumulation dtype")
            else:
                self.refuse(key, "unknown to zcompile")
