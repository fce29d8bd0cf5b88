"""The one place zcompile reads Dynamo internals: the modules of the frame being compiled, and why
a frame runs eagerly.

A backend receives a graph and its example inputs, not the ``nn.Module`` they came from; but the
module's own ``state_dict`` / ``load_state_dict`` must learn that its parameters are sharded (see
``zcompile.sharding.state_dict_hooks``). While the backend runs, Dynamo's instruction translator holds the
compiled frame's locals (``self`` for a ``forward``). Reading them uses
``torch._dynamo.symbolic_convert.InstructionTranslator.current_tx`` (torch 2.11-2.13); when that
is not available the caller gets no modules and logs it, and nothing else changes.

When eager code touches a sharded parameter, the error says why Dynamo did not compile it
(``eager_fallback_reason``: the recompile limit, or a skipped frame / graph break), read from the
cache entries of the frames on the Python stack; at the recompile limit, with the guards that failed
and a fix for each (``recompile_causes``, from ``torch._dynamo.utils.guard_failures``). A compile
that is a recompile says why (``recompile_reason``: the guard that failed, from Dynamo's metrics of
the compile in progress).
Where weights got gradients outside every graph, the warning lists why Dynamo left code out of its
graphs in this process (``graph_break_reasons``: its graph breaks and the frames it could not trace,
with Dynamo's own hint, from ``torch._dynamo.utils.counters``).
Functions that must only ever be traced inline are kept from being compiled as frames of their own
(``never_compiled_as_frames``). A compile error is read for what Dynamo does next: trace the frame
again (``restarts_analysis``), or run it eagerly, with the op that failed and the setting that
compiles it (``eager_fallback_cause``). ``floats_specialized`` compiles with Python floats as
constants, which spares a frame compiled with ``dynamic=True`` a second trace.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys

import torch

log = logging.getLogger(__name__)


def modules_of_compiled_frame() -> list[torch.nn.Module]:
    """The ``nn.Module`` objects among the locals of the frame Dynamo is compiling (its free variables
    included) and the globals its code names, and in their tuples, lists and dicts one level down
    (may be empty). One level down: a decorator's wrapper ``wrapped(*args, **kwargs)`` around a
    model's ``forward`` (transformers' ``deprecate_kwarg`` on ``LlamaForCausalLM.forward``) is the
    frame compiled, and the model is ``args[0]``. The globals: a compiled training step may use a
    global ``model`` (``@torch.compile def loss_of(x, y): return loss_fn(model(x), y)``). A module
    missed here does not learn it is sharded: its stage-3 ``state_dict()`` would return freed storages."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        root = InstructionTranslator.current_tx().output.root_tx
        values = list(root.f_locals.values())
        values += [root.f_globals[name] for name in root.f_code.co_names if name in root.f_globals]
    except Exception as error:  # internals moved: degrade to no hooks, never fail the compile
        log.debug("zcompile: cannot read the compiled frame's locals (%s: %s)", type(error).__name__, error)
        return []
    found: list[torch.nn.Module] = []
    for value in values:
        inner = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else (value,)
        found.extend(item for item in inner if isinstance(item, torch.nn.Module) and all(item is not m for m in found))
    return found


def compile_mode() -> list:
    """What, besides its collectives, tells one compile of a frame from another that a rank may run
    alone: grad mode (an evaluation under ``torch.no_grad()``) and the training flags of the frame's
    modules (``model.eval()``), as ``[grad enabled, digest of the flags]``."""
    flags = "".join("1" if module.training else "0" for top in modules_of_compiled_frame() for module in top.modules())
    return [torch.is_grad_enabled(), hashlib.sha1(flags.encode()).hexdigest()[:12]]


def recompile_reason() -> str | None:
    """Why Dynamo is compiling this frame again, while the backend runs: the first guard that failed
    ("0/0: tensor 'x' size mismatch at index 1. expected 11, actual 32"); None for a first compile,
    or where torch keeps it elsewhere (read from ``torch._dynamo.utils.get_metrics_context``, torch 2.13)."""
    try:
        from torch._dynamo.utils import get_metrics_context

        reason = get_metrics_context()._metrics.get("recompile_reason")
    except Exception as error:  # internals moved: the messages lose a detail, nothing else changes
        log.debug("zcompile: cannot read Dynamo's recompile reason (%s: %s)", type(error).__name__, error)
        return None
    return reason if isinstance(reason, str) else None


def forward_modules_on_stack() -> list[torch.nn.Module]:
    """The modules whose ``forward`` is on the Python stack, innermost first: while the backend
    compiles a graph of a function called from a model's forward (a loss after a graph break),
    the model it belongs to."""
    modules, frame = [], sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self") if frame.f_code.co_name == "forward" else None
        if isinstance(owner, torch.nn.Module) and all(owner is not m for m in modules):
            modules.append(owner)
        frame = frame.f_back
    return modules


def outer_data_parallel_wrapper() -> str | None:
    """The class name of a data-parallel wrapper (DDP, DataParallel, FSDP) whose ``forward`` is on
    the Python stack: the model being compiled runs inside it. Read while the backend compiles a
    graph, which Dynamo does during the first call, from inside the wrapper's ``forward``."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self") if frame.f_code.co_name == "forward" else None
        if isinstance(owner, (DistributedDataParallel, DataParallel, FullyShardedDataParallel)):
            return type(owner).__name__
        frame = frame.f_back
    return None


def eager_fallback_reason() -> str:
    """Why the calling code runs eagerly, read from Dynamo's caches of the frames on the stack.

    A frame whose code has compiled entries but is executing in Python was run uncompiled by
    Dynamo: at the recompile limit when it holds that many entries, otherwise skipped or split at a
    graph break. Uses ``torch._dynamo.eval_frame._debug_get_cache_entry_list`` (torch 2.11-2.13).
    """
    try:
        from torch._dynamo import eval_frame

        frame, fell_back, innermost_user_code = sys._getframe(1), None, None
        while frame is not None:
            if frame.f_code.co_filename == eval_frame.__file__:  # under a torch.compile'd call
                if fell_back is not None:
                    return _fallback_reason(fell_back)
                return _skipped_reason(innermost_user_code) if innermost_user_code is not None else OUTSIDE_COMPILE
            if fell_back is None and eval_frame._debug_get_cache_entry_list(frame.f_code):
                fell_back = frame.f_code
            if innermost_user_code is None and not frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
                innermost_user_code = frame.f_code
            frame = frame.f_back
        return OUTSIDE_COMPILE
    except Exception as error:  # internals moved: say less, never fail here
        log.debug("zcompile: cannot read Dynamo's cache entries (%s: %s)", type(error).__name__, error)
    return ""


OUTSIDE_COMPILE = "It runs outside torch.compile (eager code, or the original module rather than the compiled one)."


def _fallback_reason(code) -> str:
    where = f"{code.co_name!r} ({code.co_filename}:{code.co_firstlineno})"
    limit = torch._dynamo.config.recompile_limit
    if len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code)) >= limit:
        causes = recompile_causes(code)
        # the fix for each kind of guard that failed; where none could be read, a shape's (the usual cause)
        fixes = list(dict.fromkeys(fix for cause in causes for pattern, fix in _RECOMPILE_FIXES if pattern in cause))
        shown = "; ".join(f"`{cause}`" for cause in causes[:SHOWN_CAUSES])
        more = f" and {len(causes) - SHOWN_CAUSES} more" if len(causes) > SHOWN_CAUSES else ""
        named = f" The guards that failed, the latest first: {shown}{more}." if causes else ""
        return (
            f"Dynamo ran {where} eagerly because it hit torch._dynamo.config.recompile_limit (cache_size_limit) "
            f"= {limit} recompiles.{named} "
            + "".join(f"{fix[0].upper()}{fix[1:]}. " for fix in (fixes if causes else [_RECOMPILE_FIXES[0][1]]))
            + "Or raise torch._dynamo.config.cache_size_limit (TORCH_LOGS=recompiles shows each recompile)."
        )
    return (
        f"Dynamo ran {where} eagerly (a skipped frame or a graph break there; TORCH_LOGS=graph_breaks says "
        f"why{_reasons_so_far()}): make it compile, or keep it out of the training step."
    )


def _reasons_so_far() -> str:
    reasons = graph_break_reasons()
    return f"; in this process so far: {'; '.join(reasons)}" if reasons else ""


SHOWN_CAUSES = 4
# what a failed guard's text says -> the fix for it (each said once)
_RECOMPILE_FIXES = (
    (
        "size mismatch",
        "a new input shape each time: mark the changing dimension dynamic (torch._dynamo.mark_dynamic, "
        "or torch.compile(dynamic=True)), or pad inputs to a few fixed shapes",
    ),
    ("stride mismatch", "a new input layout each time: pass contiguous inputs"),
    ("dtype mismatch", "a new input dtype each time: cast inputs to one dtype"),
    (".training ==", "train and eval mode each compile their own graph (model.train() / model.eval())"),
    (
        "layer_idx",
        "an integer attribute differs per layer (blocks compiled one by one each specialize on it): "
        "torch._dynamo.config.allow_unspec_int_on_nn_module = True",
    ),
    (
        "is_initialized",
        "a key/value cache passes through the layers: use_cache=False where nothing generates "
        "(training and evaluation losses)",
    ),
)


def recompile_causes(code) -> list[str]:
    """The guards whose failure made Dynamo compile ``code`` again, distinct and latest first, each
    without its compile id, values or source comment (``size mismatch at index 0``, ``self.training ==
    True``). Read from ``torch._dynamo.utils.guard_failures`` (torch 2.11-2.13: at each recompile, why
    each compiled entry refused the call); empty where that moved."""
    try:
        from torch._dynamo.utils import guard_failures

        reasons = list(guard_failures.get(code, ()))
    except Exception as error:  # internals moved: the message loses a detail, nothing else changes
        log.debug("zcompile: cannot read Dynamo's guard failures (%s: %s)", type(error).__name__, error)
        return []
    causes: list[str] = []
    for reason in reversed(reasons):
        first_line = str(reason).split("\n", 1)[0]
        guard = first_line.split(": ", 1)[-1].split("  #", 1)[0].split(". expected", 1)[0].strip()
        if guard and guard not in causes:
            causes.append(guard)
    return causes


# torch's and zcompile's own frames: the frame that runs eagerly is the user's code below them
_ZCOMPILE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # zcompile/, this is zcompile/common/
_LIBRARY_DIRS = (os.path.dirname(torch.__file__), _ZCOMPILE_DIR + os.sep)


def _skipped_reason(code) -> str:
    """Under a compiled call, and no frame on the way has compiled entries: Dynamo gave up on a frame
    (a graph break inside a loop makes it run the whole frame eagerly) and runs it, from ``code`` on."""
    return (
        f"Dynamo runs {code.co_name!r} ({code.co_filename}:{code.co_firstlineno}) eagerly under the compiled "
        "call: it gave up on a frame there (a graph break inside a loop does that, such as LayerDrop's "
        f"`if torch.rand([]) < p` in transformers' layer loops; TORCH_LOGS=graph_breaks says where"
        f"{_reasons_so_far()}). Make it "
        "compile (take the break out: config.layerdrop = 0), or train with stage 1 or 2, where eager code may "
        "use the weights."
    )


# hints Dynamo gives every graph break: they name no fix
_GENERIC_HINTS = (
    "It may be possible to write Dynamo tracing rules",
    "Remove the graph break",
    "Avoid calling",
    "Use `torch._dynamo.config",
)


def graph_break_reasons(shown: int = SHOWN_CAUSES) -> list[str]:
    """Why Dynamo left code out of its graphs in this process so far: its graph breaks and the frames
    it could not trace (``torch._dynamo.utils.counters``' ``graph_break`` and ``unimplemented``,
    torch 2.11-2.13), the most frequent first, each as its summary line and Dynamo's first hint that
    names a fix (``Attempted to wrap RNN, GRU, or LSTM (Set torch._dynamo.config.allow_rnn=True ...)``).
    Empty where that moved."""
    try:
        from torch._dynamo.utils import counters

        seen = counters["graph_break"] + counters["unimplemented"]
    except Exception as error:  # internals moved: the warning loses a detail, nothing else changes
        log.debug("zcompile: cannot read Dynamo's graph breaks (%s: %s)", type(error).__name__, error)
        return []
    reasons: list[str] = []
    for text, _ in seen.most_common():
        lines = [line.strip() for line in str(text).splitlines() if line.strip()]
        summary = lines[0] if lines else ""
        hint = next(
            (
                line.removeprefix("Hint:").strip()
                for line in lines[1:]
                if line.startswith("Hint:") and not line.removeprefix("Hint:").strip().startswith(_GENERIC_HINTS)
            ),
            None,
        )
        reason = f"{summary} ({hint})" if hint else summary
        if reason and reason not in reasons:
            reasons.append(reason)
    return reasons[:shown]


def floats_specialized() -> contextlib.AbstractContextManager:
    """Compiles under it trace Python floats as constants (``torch._dynamo.config.specialize_float``,
    guarded on their values). With ``dynamic=True`` Dynamo otherwise makes a model's float attributes
    (an RMSNorm's ``variance_epsilon``, a rotary embedding's ``attention_scaling``) symbolic; an op
    that needs the number specializes it, and AOTAutograd, after tracing the joint graph, asks Dynamo
    to trace the whole frame again (``TensorifyScalarRestartAnalysis``): a second trace of the whole
    frame, which under this does not happen."""
    return torch._dynamo.config.patch(specialize_float=True)


def restarts_analysis(error: BaseException) -> bool:
    """Whether ``error`` is Dynamo's request to trace the frame again (``RestartAnalysis``: a scalar
    tensorified, a speculation to replay), not a failure: the trace that follows must see the
    parameters as this one did."""
    restart = getattr(torch._dynamo.exc, "RestartAnalysis", None)
    return restart is not None and isinstance(error, restart)


def eager_fallback_cause(error: BaseException) -> tuple[str, str] | None:
    """(what failed, how to compile it) for a compile ``error`` on which Dynamo, instead of raising,
    runs the frame the graph came from eagerly (torch's ``exceptions_allowed_to_be_fallback``, fake
    tensors' exceptions: its own warning then says "report an issue to the backend compiler repo");
    None for any other error."""
    from torch._subclasses import fake_tensor

    op = getattr(error, "func", None) or str(error)
    if isinstance(error, fake_tensor.DynamicOutputShapeException):
        return (
            f"{op}'s output shape depends on the tensor's values (a boolean mask as an index, nonzero, unique)",
            "Set `torch._dynamo.config.capture_dynamic_output_shape_ops = True` before the first compiled "
            "call: the op then compiles into the graph",
        )
    if isinstance(error, fake_tensor.DataDependentOutputException):
        if any(name in str(op) for name in ("_local_scalar_dense", "select")):  # .item(), an index read from data
            return (
                f"{op} reads a value from the tensor's data (`.item()`, an index taken from a tensor)",
                "Set `torch._dynamo.config.capture_scalar_outputs = True` before the first compiled call: the "
                "op then compiles into the graph",
            )
        return (f"{op}'s result depends on the tensor's values", "Compute it outside the compiled model")
    if isinstance(
        error,
        (
            fake_tensor.UnsupportedOperatorException,
            fake_tensor.UnsupportedFakeTensorException,
            fake_tensor.UnsupportedMutationAliasingException,
        ),
    ):
        return (
            f"{op} cannot be traced with fake tensors ({type(error).__name__}: {error})",
            "Replace it with ops that can be",
        )
    return None


def never_compiled_as_frames(*functions) -> None:
    """Dynamo never compiles ``functions``, nor the Python functions they call, as frames of their own
    (called from eager code under a compiled call), while a graph being traced still inlines them.
    ``set_code_exec_strategy`` with a recursive skip marks each code object for the frame evaluator
    only (torch 2.11-2.13; idempotent); where that is missing, ``skip_code`` skips the frame alone.
    Without either, nothing changes but the log says so."""
    eval_frame = torch._dynamo.eval_frame
    set_strategy = getattr(eval_frame, "set_code_exec_strategy", None)
    strategy, action = getattr(eval_frame, "FrameExecStrategy", None), getattr(eval_frame, "FrameAction", None)
    skip_code = getattr(eval_frame, "skip_code", None)
    for function in functions:
        code = getattr(getattr(function, "__func__", function), "__code__", None)
        if code is not None and None not in (set_strategy, strategy, action):
            set_strategy(code, strategy(action.SKIP, action.SKIP))  # the helpers it calls too
        elif code is not None and skip_code is not None:
            skip_code(code)
        else:
            log.debug("cannot keep %r from being compiled as a frame of its own", function)
