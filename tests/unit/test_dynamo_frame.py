"""``zcompile.common.dynamo_frame.modules_of_compiled_frame``: the model is found when a decorator's
``wrapped(*args, **kwargs)`` is the frame Dynamo compiles (transformers' ``deprecate_kwarg`` on
``LlamaForCausalLM.forward``), as it is when ``forward(self, ...)`` is. A backend that records
what it finds stands in for the zero backend (which attaches the state-dict hooks to them)."""

import functools

import torch

from zcompile.common.dynamo_frame import (
    _fallback_reason,
    eager_fallback_cause,
    modules_of_compiled_frame,
    recompile_causes,
    recompile_reason,
    restarts_analysis,
)


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


class WithDropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.dropout = torch.nn.Dropout(0.0)

    def forward(self, x):
        return self.dropout(self.linear(x))


def test_at_the_recompile_limit_the_guards_that_failed_are_named_with_a_fix_each():
    """A frame Dynamo ran eagerly at the recompile limit: the message names the guards that made it
    compile again (torch's ``guard_failures``), latest first, and the fix for each kind, not "a new
    input shape" whatever the cause (a transformers GPT-2's blocks compiled one by one, evaluated
    with its KV cache: a per-layer ``layer_idx``, the training flag and the cache failed, not shapes)."""
    torch._dynamo.reset()
    model = WithDropout()
    compiled = torch.compile(model, backend="eager", dynamic=False)
    compiled(torch.randn(2, 4))
    model.eval()
    compiled(torch.randn(2, 4))  # the training flag
    model.train()
    compiled(torch.randn(3, 4))  # a new shape
    code = WithDropout.forward.__code__
    causes = recompile_causes(code)
    with torch._dynamo.config.patch(recompile_limit=3):
        message = _fallback_reason(code)
    torch._dynamo.reset()
    assert any("size mismatch at index 0" in cause and "expected" not in cause for cause in causes), causes
    assert any(".training == " in cause for cause in causes), causes
    assert len(causes) == len(set(causes))
    assert "recompile_limit (cache_size_limit) = 3 recompiles" in message
    assert "size mismatch at index 0`" in message and "mark_dynamic" in message
    assert "(model.train() / model.eval())" in message
    assert "layer_idx" not in message and "use_cache" not in message  # fixes for causes not there are not said


def test_a_fallback_error_names_the_op_and_the_setting_that_compiles_it():
    """The fake-tensor errors on which Dynamo runs a frame eagerly: each names its op, and the Dynamo setting
    that puts the op in graphs where there is one; other errors (and Dynamo's restarts) are not fallbacks."""
    from torch._subclasses import fake_tensor

    aten = torch.ops.aten
    what, fix = eager_fallback_cause(fake_tensor.DynamicOutputShapeException(aten.nonzero.default))
    assert what.startswith("aten.nonzero.default's output shape") and "capture_dynamic_output_shape_ops = True" in fix
    what, fix = eager_fallback_cause(fake_tensor.DataDependentOutputException(aten._local_scalar_dense.default))
    assert "aten._local_scalar_dense.default" in what and "capture_scalar_outputs = True" in fix
    what, fix = eager_fallback_cause(fake_tensor.DataDependentOutputException(aten.equal.default))
    assert "aten.equal.default" in what and "capture_" not in fix
    assert eager_fallback_cause(RuntimeError("a pass failed")) is None
    assert restarts_analysis(torch._dynamo.exc.RestartAnalysis()) and not restarts_analysis(RuntimeError())


class RecurrentLM(torch.nn.Module):
    """An LSTM language model: Dynamo does not trace ``nn.LSTM`` unless ``config.allow_rnn``, and runs
    the whole forward eagerly."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.rnn = torch.nn.LSTM(8, 8, batch_first=True)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, tokens):
        hidden, _ = self.rnn(self.embed(tokens))
        return torch.nn.functional.cross_entropy(self.head(hidden).flatten(0, 1), tokens.flatten())


def test_weights_trained_outside_every_graph_are_warned_of_with_dynamos_reason_and_hint(caplog):
    """Stage 3 of a model Dynamo cannot trace shards nothing: the warning names the weights and why
    Dynamo left them out, with its fix (before: only "eager code, a module left uncompiled, or a
    skipped frame")."""
    from torch._dynamo.utils import counters

    import zcompile

    torch._dynamo.reset()
    counters.clear()
    model = RecurrentLM()
    compiled = torch.compile(model, backend="zero", options={"stage": 3})
    opt = zcompile.optim.AdamW(model.named_parameters(), lr=1e-2)
    with caplog.at_level("WARNING", logger="zcompile.sharding.shards"):
        compiled(torch.randint(0, 16, (2, 5))).backward()
        opt.step()
    said = [r.getMessage() for r in caplog.records if "got a gradient outside the compiled graphs" in r.getMessage()]
    assert len(said) == 1 and "rnn.weight_ih_l0" in said[0]
    assert said[0].endswith(
        "Dynamo left code out of its graphs in this process for: Attempted to wrap RNN, GRU, "
        "or LSTM (Set torch._dynamo.config.allow_rnn=True to enable experimental support for "
        "RNN, GRU, and LSTM in Dynamo)"
    )
