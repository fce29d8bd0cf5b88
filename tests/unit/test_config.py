import pytest
import torch

from zcompile import ZeroConfig


def test_defaults_and_dict_round_trip():
    config = ZeroConfig.from_options({"stage": 2, "param_dtype": "bf16"})
    assert config.stage == 2
    assert config.param_dtype is torch.bfloat16
    assert config.effective_reduce_dtype is torch.bfloat16
    assert ZeroConfig.from_options(None) == ZeroConfig()
    assert ZeroConfig.from_options(config) is config


def test_unknown_option_lists_valid_ones():
    with pytest.raises(ValueError) as error:
        ZeroConfig.from_options({"stag": 3})
    message = str(error.value)
    assert "stag" in message
    for name in ("stage", "param_dtype", "reduce_dtype", "compiler"):
        assert name in message


@pytest.mark.parametrize(
    "options, fragment",
    [
        ({"stage": 4}, "'stage' must be 1, 2 or 3"),
        ({"stage": "3"}, "'stage' must be 1, 2 or 3"),
        ({"stage": True}, "'stage' must be 1, 2 or 3"),
        ({"param_dtype": "int8"}, "'param_dtype'"),
        ({"param_dtype": torch.int32}, "floating dtype"),
        ({"compiler": "tvm"}, "'compiler' must be one of"),
        ({"group": "world"}, "ProcessGroup"),
        ({"check_timeout_s": 0}, "check_timeout_s"),
        ({"broadcast_buffers": "yes"}, "'broadcast_buffers' must be a bool"),
        ({"sync_module_states": 1}, "'sync_module_states' must be a bool"),
        ({"compiler": "inductor", "activation_memory_budget": "64MiB"}, "needs compiler='eager'"),
        ({"on_compile": 3}, "callable"),
        ({"keep_gathered_mb": -1}, "'keep_gathered_mb' must be a finite number >= 0"),
        # NaN passed every range check (nan < 0 is False) and infinity failed in an int conversion
        ({"bucket_mb": float("nan")}, "'bucket_mb' must be a finite number"),
        ({"bucket_mb": float("inf")}, "'bucket_mb' must be a finite number"),
        ({"keep_gathered_mb": float("nan")}, "'keep_gathered_mb' must be a finite number"),
        ({"memory_budget_mb": float("nan")}, "'memory_budget_mb' must be a positive finite number"),
        ({"check_timeout_s": float("nan")}, "'check_timeout_s' must be a positive finite number"),
        ({"check_timeout_s": True}, "'check_timeout_s' must be a positive finite number"),
        ({"activation_memory_budget": "infMiB"}, "'activation_memory_budget' as a string is MiB"),
        ({"activation_memory_budget": float("nan")}, "'activation_memory_budget' must be a fraction"),
        ({"stage": 2, "keep_gathered_mb": 4}, "keep_gathered_mb keeps stage-3 gathered weights"),
    ],
)
def test_bad_values_name_the_option(options, fragment):
    with pytest.raises((ValueError, TypeError), match=fragment):
        ZeroConfig.from_options(options)


def test_options_must_be_a_mapping():
    with pytest.raises(TypeError, match="options must be a dict"):
        ZeroConfig.from_options([("stage", 3)])


def test_backend_is_registered_by_entry_point():
    import torch._dynamo

    assert "zero" in torch._dynamo.list_backends()


@pytest.mark.parametrize(
    "options, device, marked, chosen",
    [
        ({}, "cpu", False, "eager"),
        ({}, "cuda", False, "inductor"),
        ({}, "cuda", True, "eager"),  # inductor refuses marked blocks
        ({"activation_memory_budget": "64MiB"}, "cuda", False, "eager"),  # a budget in MiB: eager only
        ({"activation_memory_budget": 0.5}, "cuda", False, "inductor"),
        ({"compiler": "eager"}, "cuda", False, "eager"),
        ({"compiler": "inductor"}, "cpu", False, "inductor"),
    ],
)
def test_auto_compiler_is_inductor_on_cuda_and_eager_elsewhere(options, device, marked, chosen):
    config = ZeroConfig.from_options(options)
    assert config.compiler == options.get("compiler", "auto")
    assert config.for_graph(device, marked).compiler == chosen


def test_a_cpu_compile_with_default_options_runs_the_eager_compiler():
    """The default, ``"auto"``, is what the backend hands its graphs: eager on this CPU."""
    from support.models import build_model, global_batch

    seen = []
    model = torch.compile(build_model("gpt"), backend="zero", options={"on_compile": seen.append})
    tokens, targets = global_batch(0, 1)
    model(tokens, targets).backward()
    assert seen and {graphs.context.config.compiler for graphs in seen} == {"eager"}
