"""``zcompile.options_from_deepspeed``: DeepSpeed configs (the ZeRO++ example of DeepSpeed's docs, a
stage-2 bf16 one, a stage-3 one with offload, Hugging Face's "auto" values) read into options that
``ZeroConfig`` accepts, the optimizer's arguments and the loop's numbers, with every key that
zcompile cannot honour named; and a world-of-one run trained from a config equal to the same run
with the options written by hand."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import zcompile
from support.models import build_model, global_batch
from zcompile.config import ZeroConfig
from zcompile.integrations.deepspeed import DeepSpeedPort, options_from_deepspeed

MIB = 2**20

# DeepSpeed's ZeRO++ tutorial (docs/_tutorials/zeropp.md), its configuration snippet as given
ZEROPP = {
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": 10000000,
        "reduce_scatter": True,
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": 16,
        "zero_quantized_gradients": True,
        "contiguous_gradients": True,
        "overlap_comm": True,
    }
}

STAGE2_BF16 = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "steps_per_print": 100,
    "wall_clock_breakdown": False,
    "optimizer": {"type": "Adam", "params": {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
        "round_robin_gradients": True,
    },
}

STAGE3_OFFLOAD = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 4,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95]}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": 5e8,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 1e5,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


def _keys(port: DeepSpeedPort) -> list[str]:
    return [key for key, _ in port.not_honoured]


def test_zeropp_example_from_deepspeeds_docs():
    port = options_from_deepspeed(ZEROPP)
    # no precision key: fp32, 4 bytes a gradient element
    assert port.options == {
        "stage": 3,
        "bucket_mb": 10_000_000 * 4 / MIB,
        "overlap": True,
        "quantize_weights": True,
        "quantize_grads": True,
        "hpz_size": 16,
    }
    assert port.options["bucket_mb"] == 38.14697265625
    config = ZeroConfig.from_options(port.options)
    assert (config.stage, config.quantize_weights, config.quantize_grads, config.hpz_size) == (3, True, True, 16)
    assert port.not_honoured == ()
    assert port.optimizer is None and port.optimizer_kwargs == {} and port.max_grad_norm is None
    assert (
        "zero_optimization.contiguous_gradients: ignored, zcompile's buckets are flat buffers by construction"
        in port.log
    )
    assert any(line.startswith("zero_optimization.reduce_scatter: ignored") for line in port.log)


def test_stage2_bf16_config():
    port = options_from_deepspeed(STAGE2_BF16)
    bucket = 2e8 * 2 / MIB  # bf16: 2 bytes an element
    assert bucket == 381.4697265625
    assert port.options == {"stage": 2, "param_dtype": "bf16", "bucket_mb": bucket, "overlap": True}
    assert ZeroConfig.from_options(port.options).param_dtype == torch.bfloat16
    # DeepSpeed's "Adam" with its default adam_w_mode=true is AdamW; allgather_bucket_size sizes the step's all-gather
    assert port.optimizer == "AdamW"
    assert port.optimizer_kwargs == {
        "lr": 2e-5,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.01,
        "bucket_mb": bucket,
        "max_grad_norm": 1.0,
    }
    assert port.max_grad_norm == 1.0
    assert (port.gradient_accumulation_steps, port.train_micro_batch_size_per_gpu) == (4, 8)
    assert port.grad_scaler is None
    assert port.not_honoured == ()
    optimizer = port.make_optimizer(torch.nn.Linear(4, 4).parameters())
    assert isinstance(optimizer, zcompile.optim.AdamW)
    assert (optimizer.max_grad_norm, optimizer.bucket_mb) == (1.0, bucket)
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.999) and optimizer.param_groups[0]["lr"] == 2e-5


def test_stage3_with_offload_names_what_is_not_honoured(caplog):
    with caplog.at_level(logging.WARNING, logger="zcompile.integrations.deepspeed"):
        port = options_from_deepspeed(STAGE3_OFFLOAD, world_size=4)
    assert port.options == {
        "stage": 3,
        "param_dtype": "bf16",
        "bucket_mb": 5e8 * 2 / MIB,
        "overlap": True,
        "prefetch": 1,  # 5e7 elements x 2 bytes = 95.4 MiB, less than one bucket of 953.7 MiB: at least 1
        "memory_budget_mb": 1e9 * 2 / MIB,
        "keep_gathered_mb": 1e9 / 2 * 2 / MIB,
    }
    ZeroConfig.from_options(port.options)
    assert sorted(_keys(port)) == [
        "scheduler",
        "zero_optimization.offload_optimizer",
        "zero_optimization.offload_param",
        "zero_optimization.stage3_param_persistence_threshold",
    ]
    reasons = dict(port.not_honoured)
    assert "device 'cpu'" in reasons["zero_optimization.offload_optimizer"]
    assert "device 'nvme'" in reasons["zero_optimization.offload_param"]
    assert "'WarmupLR'" in reasons["scheduler"]
    # DeepSpeed's rule: 64 = 4 x steps x 4 ranks
    assert (port.train_micro_batch_size_per_gpu, port.gradient_accumulation_steps) == (4, 4)
    # FusedAdam's default weight decay, 0, written out (zcompile.optim.AdamW's own is 0.01)
    assert port.optimizer_kwargs == {"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.0}
    assert "zero_optimization.offload_optimizer" in caplog.text
    summary = port.summary()
    assert "not honoured (4):" in summary and "zero_optimization.offload_param: device 'nvme'" in summary
    assert "zcompile.optim.AdamW(params, lr=0.0001, betas=(0.9, 0.95), weight_decay=0.0)" in summary


def test_stage3_prefetch_counts_buckets_of_the_mapped_size():
    zero = {"stage": 3, "reduce_bucket_size": 2**20, "stage3_prefetch_bucket_size": 3 * 2**20 + 5}
    port = options_from_deepspeed({"fp16": {"enabled": True}, "zero_optimization": zero})
    assert port.options["bucket_mb"] == 2.0  # 2**20 elements x 2 bytes
    assert port.options["prefetch"] == 3  # 6 MiB and a little over: 3 buckets of 2 MiB
    port = options_from_deepspeed({"zero_optimization": {**zero, "stage3_prefetch_bucket_size": 0}})
    assert port.options["prefetch"] == 0
    # without reduce_bucket_size, zcompile's default buckets of 4 MiB: DeepSpeed's default 5e7 in bf16 is 95.4 MiB
    port = options_from_deepspeed(
        {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5e7}}
    )
    assert "bucket_mb" not in port.options and port.options["prefetch"] == 23


def test_a_config_file_path(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(STAGE2_BF16))
    for given in (path, str(path)):
        port = options_from_deepspeed(given)
        assert port == options_from_deepspeed(STAGE2_BF16)
        assert port.options["bucket_mb"] == 381.4697265625
    assert zcompile.options_from_deepspeed(path).optimizer_kwargs["lr"] == 2e-5
    with pytest.raises(FileNotFoundError, match="zcompile.options_from_deepspeed: no DeepSpeed config file at"):
        options_from_deepspeed(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{ not json")
    with pytest.raises(ValueError, match="zcompile.options_from_deepspeed: .*bad.json' is not valid JSON"):
        options_from_deepspeed(tmp_path / "bad.json")


@pytest.mark.parametrize("stage", [4, -1, "3", True, None])
def test_an_invalid_stage_is_a_clear_error(stage):
    with pytest.raises(
        ValueError, match=r"^zcompile.options_from_deepspeed: zero_optimization.stage must be 0, 1, 2 or 3 .*got"
    ):
        options_from_deepspeed({"zero_optimization": {"stage": stage}})


def test_stage_0_becomes_stage_1_and_is_named():
    for config in ({"zero_optimization": {"stage": 0}}, {}):
        port = options_from_deepspeed(config)
        assert port.options == {"stage": 1}
        assert _keys(port) == ["zero_optimization.stage"]
        assert "stage 1 is nearest" in port.not_honoured[0][1]
    assert "absent" in options_from_deepspeed({}).not_honoured[0][1]
    assert options_from_deepspeed({"zero_optimization": True}).options == {"stage": 1}


def test_plain_adam_is_adamw_only_without_weight_decay():
    adam = {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False}}
    port = options_from_deepspeed({"zero_optimization": {"stage": 1}, "optimizer": adam})
    assert (port.optimizer, port.optimizer_kwargs, port.not_honoured) == (
        "AdamW",
        {"lr": 1e-3, "weight_decay": 0.0},
        (),
    )
    adam["params"]["weight_decay"] = 0.1
    port = options_from_deepspeed({"zero_optimization": {"stage": 1}, "optimizer": adam})
    assert port.optimizer_kwargs == {"lr": 1e-3, "weight_decay": 0.1}
    assert _keys(port) == ["optimizer.params.adam_w_mode"]
    sgd = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}
    port = options_from_deepspeed({"zero_optimization": {"stage": 1}, "optimizer": sgd})
    assert (port.optimizer, port.optimizer_kwargs) == ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True})
    port = options_from_deepspeed({"zero_optimization": {"stage": 1}, "optimizer": {"type": "Lamb"}})
    assert port.optimizer is None and _keys(port) == ["optimizer.type"]


def test_fp16_keeps_a_grad_scaler_and_names_the_loss_scale_settings_it_has_not():
    fp16 = {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1}
    port = options_from_deepspeed({"fp16": fp16, "zero_optimization": {"stage": 3}})
    assert port.options == {"stage": 3, "param_dtype": "fp16"}
    assert port.grad_scaler == {"init_scale": 4096.0, "growth_interval": 500}
    torch.amp.GradScaler("cpu", **port.grad_scaler)  # the arguments are GradScaler's
    assert _keys(port) == ["fp16.hysteresis", "fp16.min_loss_scale"]
    port = options_from_deepspeed({"fp16": {"enabled": True, "loss_scale": 128}, "zero_optimization": {"stage": 2}})
    assert port.grad_scaler == {"init_scale": 128.0, "growth_interval": 1000}
    # a static scale, and stage 2's fp16 gradient shards that GradScaler refuses to unscale
    assert _keys(port) == ["fp16.loss_scale", "fp16.enabled"]
    with pytest.raises(
        ValueError, match="^zcompile.options_from_deepspeed: fp16.enabled and bf16.enabled are both true"
    ):
        options_from_deepspeed({"fp16": {"enabled": True}, "bf16": {"enabled": True}})


def test_unknown_keys_auto_values_and_zeropp_below_stage_3():
    config = {
        "zero_optimization": {"stage": 2, "zero_quantized_gradients": True, "reduce_bucket_size": "auto", "zz": 1},
        "sparse_attention": {"mode": "fixed"},
        "my_own_key": 1,
        "communication_data_type": "fp32",
        "bf16": {"enabled": True},
        "train_micro_batch_size_per_gpu": "auto",
    }
    port = options_from_deepspeed(config)
    # DeepSpeed applies qgZ at stage 3 only: ignored here as DeepSpeed ignores it
    assert port.options == {"stage": 2, "param_dtype": "bf16", "reduce_dtype": "fp32"}
    reasons = dict(port.not_honoured)
    assert (
        reasons["sparse_attention"] == reasons["my_own_key"] == reasons["zero_optimization.zz"] == "unknown to zcompile"
    )
    assert "Trainer" in reasons["zero_optimization.reduce_bucket_size"]
    assert port.train_micro_batch_size_per_gpu is None
    assert any(
        "zero_quantized_gradients: ignored, DeepSpeed applies ZeRO++ at stage 3 only" in line for line in port.log
    )
    port = options_from_deepspeed({"zero_optimization": {"stage": 3, "stage3_foo": 1}})
    assert port.options == {"stage": 3}
    assert port.not_honoured == (("zero_optimization.stage3_foo", "unknown to zcompile"),)
    # the reduce dtype sizes gradient buckets: fp32 communication, 4 bytes an element
    port = options_from_deepspeed({**config, "zero_optimization": {"stage": 2, "reduce_bucket_size": 2**20}})
    assert port.options["bucket_mb"] == 4.0


def test_stage3_memory_keys_map_to_the_budget_and_kept_weights():
    zero = {"stage": 3, "stage3_max_live_parameters": 3 * 2**20, "stage3_max_reuse_distance": 2**20}
    port = options_from_deepspeed({"bf16": {"enabled": True}, "zero_optimization": zero})
    assert port.options == {"stage": 3, "param_dtype": "bf16", "memory_budget_mb": 6.0, "keep_gathered_mb": 1.0}
    # below stage 3 DeepSpeed reads none of them; keep_gathered_mb would be refused there
    port = options_from_deepspeed({"zero_optimization": {**zero, "stage": 2}})
    assert port.options == {"stage": 2} and port.not_honoured == ()


def test_a_run_trained_from_the_config_equals_the_options_written_by_hand():
    """Stage 3, bf16, buckets, prefetch, budget, kept weights, clipping and accumulation from a
    DeepSpeed config: two steps of the tiny GPT, losses equal to the run configured by hand."""
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "reduce_bucket_size": 16384,  # x 2 bytes: 1/32 MiB
            "stage3_prefetch_bucket_size": 32768,  # 2 buckets
            "stage3_max_live_parameters": 65536,  # 1/8 MiB
            "stage3_max_reuse_distance": 16384,  # half of it x 2 bytes: 1/64 MiB
        },
    }
    by_hand = {
        "stage": 3,
        "param_dtype": "bf16",
        "bucket_mb": 0.03125,
        "overlap": True,
        "prefetch": 2,
        "memory_budget_mb": 0.125,
        "keep_gathered_mb": 0.015625,
    }
    optimizer_by_hand = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=0.5)
    port = options_from_deepspeed(config)
    assert port.options == by_hand and port.not_honoured == ()
    assert port.optimizer == "AdamW" and port.optimizer_kwargs == optimizer_by_hand
    assert (port.gradient_accumulation_steps, port.train_micro_batch_size_per_gpu) == (2, 2)

    def train(options: dict, make_optimizer) -> tuple[list[float], float]:
        torch._dynamo.reset()
        model = build_model("gpt")
        optimizer = make_optimizer(model.parameters())
        compiled = torch.compile(model, backend="zero", options=options)
        losses = []
        for step in range(2):
            total = 0.0
            for micro in range(port.gradient_accumulation_steps):
                tokens, targets = global_batch(step * 2 + micro, port.train_micro_batch_size_per_gpu)
                loss = compiled(tokens, targets) / port.gradient_accumulation_steps
                loss.backward()
                total += loss.item()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(total)
        return losses, optimizer.last_grad_norm

    ported, ported_norm = train(port.options, port.make_optimizer)
    hand, hand_norm = train(by_hand, lambda params: zcompile.optim.AdamW(params, **optimizer_by_hand))
    assert ported == hand and ported_norm == hand_norm
    assert 5.0 < ported[0] < 6.0 and ported[1] < ported[0]  # ln(256) = 5.55 at the start, then it learns


def test_amsgrad_maps_to_the_optimizers_own():
    port = options_from_deepspeed(
        {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "amsgrad": True}}}
    )
    assert port.optimizer_kwargs["amsgrad"] is True and port.not_honoured == ()
    optimizer = port.make_optimizer(torch.nn.Linear(4, 4).parameters())
    assert optimizer.param_groups[0]["amsgrad"] is True
