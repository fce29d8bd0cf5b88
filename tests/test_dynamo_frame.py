"""``zcompile.dynamo_frame.modules_of_compiled_frame``: the model is found when a decorator's
``wrapped(*args, **kwargs)`` is the frame Dynamo compiles (transformers' ``deprecate_kwarg`` on
``LlamaForCausalLM.forward``), as it is when ``forward(self, ...)`` is. A backend that records
what it finds stands in for the zero backend (which attaches the state-dict hooks to them)."""

import functools

import torch

from zcompile.dynamo_frame import modules_of_compiled_frame, recompile_reason


def _star_wrapped(forward):
    @functools.wraps(forward)
    def wrapped(*args, **kwargs):  # the model is args[0]
        return forward(*args, **kwargs)

    return wrapped


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x).relu()


class Wrapped(Plain):
    forward = _star_wrapped(Plain.forward)


def _found_by_backend(model: torch.nn.Module) -> list[torch.nn.Module]:
    found = []

    def backend(gm, example_inputs):
        found.extend(modules_of_compiled_frame())
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(torch.randn(2, 4))
    return found


def test_the_model_is_found_in_a_star_args_wrapper_as_in_its_own_forward():
    for model in (Plain(), Wrapped()):
        found = _found_by_backend(model)
        assert any(m is model for m in found), (type(model).__name__, found)
        assert len(found) == len({id(m) for m in found})  # each once


def test_a_recompile_names_the_guard_that_failed():
    """The plan check's label for a recompile (a rank recompiling alone names the input that changed:
    each rank padding its batch to its own longest sequence)."""
    reasons = []

    def backend(gm, example_inputs):
        reasons.append(recompile_reason())
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(Plain(), backend=backend)
    compiled(torch.randn(2, 4))
    compiled(torch.randn(3, 4))
    torch._dynamo.reset()
    assert reasons[0] is None  # a first compile
    assert "size mismatch at index 0. expected 2, actual 3" in reasons[1], reasons
